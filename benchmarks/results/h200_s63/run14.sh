source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 63): (1) the decode-read tests of sessions 60-62 on CUDA (run 11's part 1,
# capped at 120 s); (2) overlapped decode at 4k, each method in its own process beside its own
# mlx-lm KVCache, warmed 64 steps (run 12's list, in order of the issue's targets)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 120 python3 -m pytest -q -p no:cacheprovider --no-header -x \
  tests/test_*_decode_read.py > $OUT/decode_read_cuda.log 2>&1; echo "pytest rc=$?"
tail -6 $OUT/decode_read_cuda.log | cut -c1-300
METHODS=${METHODS:-"kivi-4bit kitty skvq zipcache gear kvquant cachegen palu vecinfer age_tiered nsnquant"}
timeout $((585 - SECONDS)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
  --steps 16 --rounds 2 --prefill-repeats 1 --budget-s $((500 - SECONDS)) \
  --methods "mlx-lm KVCache" $METHODS --out $OUT/decode_4k_s63a.json > $OUT/decode_4k_s63a.log 2>&1
grep "^|" $OUT/decode_4k_s63a.log | cut -c1-300; grep -A3 Traceback $OUT/decode_4k_s63a.log | tail -4
