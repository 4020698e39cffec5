source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# xquant stacked (its groups planned for every layer) against per sequence, 32k, 40 GB
timeout 235 python3 benchmarks/serve_capacity.py --steps 8 --prefill-repeats 1 --methods full xquant \
  "xquant, per sequence" --out $OUT/serve_capacity-llama3-8b-xquant.md > $OUT/serve_xquant.log 2>&1
grep "^{" $OUT/serve_xquant.log | cut -c1-200; tail -4 $OUT/serve_xquant.log
