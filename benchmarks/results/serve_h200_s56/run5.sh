source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# vecinfer after its decode step reads each index from the two words it spans (run 3, a sum
# over every word of the buffer: 5.0 / 5.4 tok/s, peaks 37.1 / 108.1 GB per sequence / stacked)
timeout 200 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 5 --max-seqs 32 --steps 2 \
  --prefill-repeats 1 --methods vecinfer "vecinfer, stacked" \
  --out $OUT/serve_capacity-llama3-8b-8k-vecinfer-fields.md > $OUT/serve_8k_vecinfer_fields.log 2>&1
grep "^{" $OUT/serve_8k_vecinfer_fields.log | cut -c1-260; grep -A3 Traceback $OUT/serve_8k_vecinfer_fields.log | tail -3
