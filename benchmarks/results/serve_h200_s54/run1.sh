source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
python3 benchmarks/check_kivi_rows.py --bits 4 2>&1 | tee $OUT/check_kivi_rows_4bit.log
python3 benchmarks/check_kivi_rows.py --bits 2 2>&1 | tee $OUT/check_kivi_rows_2bit.log
python3 benchmarks/serve_capacity.py --methods "mlx-lm KVCache" full "kivi 4-bit" "kivi 4-bit, per sequence" \
  "kivi 2-bit" --out $OUT/serve_capacity-llama3-8b-kivi.md > $OUT/serve_kivi.log 2>&1
tail -20 $OUT/serve_kivi.log
