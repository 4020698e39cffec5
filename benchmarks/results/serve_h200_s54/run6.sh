source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
python3 benchmarks/serve_capacity.py --prompt 16384 --kv-gb 20 --steps 8 --prefill-repeats 1 \
  --methods full "keyformer 2048" "keyformer 2048, per sequence" \
  --out $OUT/serve_capacity-llama3-8b-keyformer.md > $OUT/serve_keyformer.log 2>&1
grep "^{" $OUT/serve_keyformer.log | cut -c1-200; tail -8 $OUT/serve_keyformer.log
