source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
python3 benchmarks/check_kivi_rows.py --bits 4 --sweep 528:4 792:6 1056:4 1056:8 1584:6 2112:8 3168:6 4224:8 2>&1 | tee $OUT/sweep_kivi_rows_4bit.log
python3 benchmarks/serve_capacity.py --methods "mlx-lm KVCache" full "kivi 4-bit, per sequence" \
  "streaming_llm 4+2044" "streaming_llm 4+2044, per sequence" "snapkv 2048" "pyramidkv 2048" \
  --out $OUT/serve_capacity-llama3-8b-others.md > $OUT/serve_others.log 2>&1
tail -14 $OUT/serve_others.log
