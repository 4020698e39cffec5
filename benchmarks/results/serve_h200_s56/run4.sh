source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# a2ats after its chosen rows are taken by one index a row (runs 1-2, take_along_axis:
# stacked 22-23 tok/s, per sequence 43-44), 8 x 8k
timeout 400 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 10 --max-seqs 64 --steps 12 \
  --prefill-repeats 1 --methods a2ats "a2ats, stacked" \
  --out $OUT/serve_capacity-llama3-8b-8k-a2ats-rows.md > $OUT/serve_8k_a2ats_rows.log 2>&1
grep "^{" $OUT/serve_8k_a2ats_rows.log | cut -c1-260; grep -A3 Traceback $OUT/serve_8k_a2ats_rows.log | tail -3
