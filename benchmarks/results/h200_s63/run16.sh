source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 63): overlapped decode at 4k, each method in its own process beside its
# own mlx-lm KVCache, warmed 64 steps: first with the stores' own reads, then with every
# packed store's decode step read as its history decoded to float16 + one fused SDPA
# (benchmarks/dense_read.py, imported by each process's sitecustomize under VQ_DENSE_READ=1).
# VQ_DENSE_READ=2: only all-group-affine parts (kivi), as their rows by one mx.dequantize each.
# METHODS, BUDGET (seconds a variant) and VARIANTS (of VQ_DENSE_READ) from the caller.
METHODS=${METHODS:-"kivi-4bit kitty skvq gear palu"}
BUDGET=${BUDGET:-190}
cp benchmarks/dense_read.py shim/ && printf 'import os\nif os.environ.get("VQ_DENSE_READ") in ("1", "2"):\n    import dense_read  # noqa\n' >> shim/sitecustomize.py
for dense in ${VARIANTS:-0 1}; do
  VQ_DENSE_READ=$dense timeout $((BUDGET + 100)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 16 --rounds 2 --prefill-repeats 1 --budget-s $BUDGET \
    --methods "mlx-lm KVCache" $METHODS --out $OUT/decode_4k_dense$dense.json > $OUT/decode_4k_dense$dense.log 2>&1
  echo "VQ_DENSE_READ=$dense"; grep "^|" $OUT/decode_4k_dense$dense.log | cut -c1-300
  grep -A3 Traceback $OUT/decode_4k_dense$dense.log | tail -4
done
