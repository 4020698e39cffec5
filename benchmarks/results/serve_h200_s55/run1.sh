source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# the stacked stores against the same stores per sequence, 32k prompts, 40 GB of KV
timeout 560 python3 benchmarks/serve_capacity.py --steps 8 --prefill-repeats 1 --methods "mlx-lm KVCache" full \
  gear "gear, per sequence" age_tiered "age_tiered, per sequence" turboquant "turboquant, per sequence" \
  kitty skvq zipcache --out $OUT/serve_capacity-llama3-8b-stacked.md > $OUT/serve_stacked.log 2>&1
grep "^{" $OUT/serve_stacked.log | cut -c1-200; tail -5 $OUT/serve_stacked.log
