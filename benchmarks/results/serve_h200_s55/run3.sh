source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# continuous batching's lengths: 8k, 16k, 24k and 32k prompts in one batch (masked attention
# for full and StreamingLLM, padded slots for eviction, per-sequence counts for KIVI's launch,
# one stacked group a length for age_tiered)
timeout 540 python3 benchmarks/serve_capacity.py --mix 4 --steps 8 --prefill-repeats 1 --methods "mlx-lm KVCache" full \
  "kivi 4-bit" "snapkv 2048" "streaming_llm 4+2044" age_tiered "keyformer 2048" \
  --out $OUT/serve_capacity-llama3-8b-mix4.md > $OUT/serve_mix4.log 2>&1
grep "^{" $OUT/serve_mix4.log | cut -c1-200; grep -B2 "^RuntimeError\|^ValueError" $OUT/serve_mix4.log | head -20; tail -12 $OUT/serve_mix4.log
