source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 59): the methods whose decode rows are now held exactly and coded, tiered or
# merged 32 at a time (spectral, amc, vecinfer, nsnquant, minicache), overlapped decode at 4k
# and 32k, each in its own process beside its own mlx-lm KVCache baseline
timeout 560 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 --isolate \
  --steps 16 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --budget-s 420 \
  --methods "mlx-lm KVCache" spectral amc vecinfer nsnquant minicache \
  --out $OUT/decode_windows_s59.json > $OUT/decode_windows_s59.log 2>&1
grep "^|" $OUT/decode_windows_s59.log | cut -c1-300; grep -A3 Traceback $OUT/decode_windows_s59.log | tail -4
