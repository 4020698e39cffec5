source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 61): run 9 again with WARMUP_STEPS = 64 (every method's first 32-row
# flushes and their compilation before the timed steps): overlapped decode at 4k, each method
# in its own process beside its own mlx-lm KVCache; METHODS overrides the list
METHODS=${METHODS:-"kivi-4bit zipcache skvq kitty gear cachegen palu svdq vecinfer minicache"}
timeout 570 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
  --steps 16 --rounds 2 --prefill-repeats 1 --budget-s 500 \
  --methods "mlx-lm KVCache" $METHODS --out $OUT/decode_4k_s61.json > $OUT/decode_4k_s61.log 2>&1
grep "^|" $OUT/decode_4k_s61.log | cut -c1-300; grep -A3 Traceback $OUT/decode_4k_s61.log | tail -4
