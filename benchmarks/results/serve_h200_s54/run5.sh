source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
python3 benchmarks/serve_capacity.py --steps 8 --methods "mlx-lm KVCache" full cam age_tiered xquant gear \
  palu vecinfer kvtc --out $OUT/serve_capacity-llama3-8b-families.md > $OUT/serve_families.log 2>&1
grep "^{" $OUT/serve_families.log | cut -c1-160; tail -16 $OUT/serve_families.log
