source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# after the packed layouts' writes are evaluated with each step (before, h2o's and keyformer's
# scores and every eviction layout's positions stayed lazy past the timed steps)
timeout 420 python3 benchmarks/serve_capacity.py --steps 8 --prefill-repeats 1 --methods full "snapkv 2048" \
  "keyformer 2048" "streaming_llm 4+2044" --out $OUT/serve_capacity-llama3-8b-evaluated.md > $OUT/serve_evaluated.log 2>&1
grep "^{" $OUT/serve_evaluated.log | cut -c1-200; tail -8 $OUT/serve_evaluated.log
