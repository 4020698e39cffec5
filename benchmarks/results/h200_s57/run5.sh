source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# one sequence of spectral with its reader in blocks (session 57), beside mlx-lm's KVCache
timeout 190 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --steps 16 --rounds 2 \
  --warmup-rounds 1 --prefill-repeats 1 --methods "mlx-lm KVCache" spectral \
  --out $OUT/decode_spectral_4k.json > $OUT/decode_spectral_4k.log 2>&1
grep "^| 4096" $OUT/decode_spectral_4k.log | cut -d"|" -f3,6,9,11,12,13,15
