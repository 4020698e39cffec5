source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# a2ats: where a stacked step of 8 sequences spends its device time against per sequence
# (runs 1-2: stacked 0.52x per sequence), kernel by kernel under ncu, 2 layers, 8k
timeout 330 python3 benchmarks/decode_kernels.py --out-dir $OUT/kernels --layers 2 --context 8192 \
  --batch 8 --warm 6 --steps 2 --timeout 160 --methods "a2ats, stacked" "a2ats, per sequence" > $OUT/kernels.log 2>&1
cat $OUT/kernels.log; python3 benchmarks/decode_kernels.py --report $OUT/kernels --top 10 > $OUT/kernels_a2ats_b8.md; cat $OUT/kernels_a2ats_b8.md
# vecinfer: the memory a decode step holds stacked against per sequence (run 1: stacked ran out at 63)
timeout 220 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 5 --max-seqs 32 --steps 2 \
  --prefill-repeats 1 --methods vecinfer "vecinfer, stacked" \
  --out $OUT/serve_capacity-llama3-8b-8k-vecinfer32.md > $OUT/serve_8k_vecinfer32.log 2>&1
grep "^{" $OUT/serve_8k_vecinfer32.log | cut -c1-260; grep -A3 Traceback $OUT/serve_8k_vecinfer32.log | tail -3
