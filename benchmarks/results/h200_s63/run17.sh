source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 63), one call when only one is left: run 16's comparison for three
# methods (own read, VQ_DENSE_READ=1), kivi-4bit's lean dense read (VQ_DENSE_READ=2), then
# the decode-read tests on CUDA with what is left of the call
cp benchmarks/dense_read.py shim/ && printf 'import os\nif os.environ.get("VQ_DENSE_READ") in ("1", "2"):\n    import dense_read  # noqa\n' >> shim/sitecustomize.py
SPECS=${SPECS:-"0:kivi-4bit kitty skvq:130,1:kivi-4bit kitty skvq:130,2:kivi-4bit:20"}  # variant:methods:budget s
IFS=, read -ra specs <<< "$SPECS"
for spec in "${specs[@]}"; do
  IFS=: read dense methods budget <<< "$spec"
  VQ_DENSE_READ=$dense timeout $((budget + 110)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 16 --rounds 2 --prefill-repeats 1 --budget-s $budget \
    --methods "mlx-lm KVCache" $methods --out $OUT/decode_4k_dense$dense.json > $OUT/decode_4k_dense$dense.log 2>&1
  echo "VQ_DENSE_READ=$dense"; grep "^|" $OUT/decode_4k_dense$dense.log | cut -c1-300
  grep -A3 Traceback $OUT/decode_4k_dense$dense.log | tail -4
done
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
[ $SECONDS -lt 500 ] && MLX_DEFAULT_DEVICE=gpu timeout $((580 - SECONDS)) python3 -m pytest -q -p no:cacheprovider --no-header \
  tests/test_*_decode_read.py > $OUT/decode_read_cuda.log 2>&1; echo "pytest rc=$? after ${SECONDS}s"
tail -6 $OUT/decode_read_cuda.log | cut -c1-300
