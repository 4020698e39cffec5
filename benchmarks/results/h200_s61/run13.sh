source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 61), part 2 of run 12: overlapped decode at 4k of the methods whose reads
# session 61 cut (spectral, amc, nsnquant, kvquant, a2ats, anchorkv, keyformer, the composed
# eviction + kivi stores), each in its own process beside its own mlx-lm KVCache
METHODS=${METHODS:-"spectral amc nsnquant kvquant a2ats anchorkv keyformer"}
timeout 570 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
  --steps 16 --rounds 2 --prefill-repeats 1 --budget-s 430 \
  --methods "mlx-lm KVCache" $METHODS "h2o 2048 + kivi-2bit" "tova 2048 + kivi-4bit" \
  --out $OUT/decode_4k_s61b.json > $OUT/decode_4k_s61b.log 2>&1
grep "^|" $OUT/decode_4k_s61b.log | cut -c1-300; grep -A3 Traceback $OUT/decode_4k_s61b.log | tail -4
