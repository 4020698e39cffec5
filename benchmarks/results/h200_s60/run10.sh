source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# run 9's last call (the 91 s of device time left): skvq and kitty beside mlx-lm's KVCache in
# one process, 3 untimed rounds of 16 steps (their first flushes and kernel compilations
# before the timed ones; decode.py now warms at least 64 steps itself)
timeout 95 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --steps 16 --rounds 2 \
  --warmup-rounds 3 --prefill-repeats 1 --methods "mlx-lm KVCache" skvq kitty --out $OUT/warm.json
