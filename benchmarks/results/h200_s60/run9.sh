source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 60): overlapped decode at 4k of the methods whose steps were cut in
# sessions 59-60 (windows coded 32 at a time; reads with fewer graph nodes), each in its own
# process beside its own mlx-lm KVCache; METHODS overrides the list
METHODS=${METHODS:-"spectral amc vecinfer nsnquant minicache zipcache skvq kitty kvquant kivi-4bit"}
timeout 560 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
  --steps 16 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --budget-s 470 \
  --methods "mlx-lm KVCache" $METHODS --out $OUT/decode_4k_s60.json > $OUT/decode_4k_s60.log 2>&1
grep "^|" $OUT/decode_4k_s60.log | cut -c1-300; grep -A3 Traceback $OUT/decode_4k_s60.log | tail -4
