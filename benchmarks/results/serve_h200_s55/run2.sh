source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# after run 1: a group's arrays are joined layer by layer when the batch forms (kitty and skvq
# ran out of memory holding every layer's two copies); the other stacked stores
timeout 560 python3 benchmarks/serve_capacity.py --steps 8 --prefill-repeats 1 --methods full \
  kitty skvq cachegen nsnquant svdq spectral amc rocketkv \
  --out $OUT/serve_capacity-llama3-8b-stacked2.md > $OUT/serve_stacked2.log 2>&1
grep "^{" $OUT/serve_stacked2.log | cut -c1-200; grep -B2 "^RuntimeError\|^ValueError" $OUT/serve_stacked2.log | head -20; tail -12 $OUT/serve_stacked2.log
