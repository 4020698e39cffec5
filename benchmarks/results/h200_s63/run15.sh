source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 63): run 14's decode table again with every packed store's decode step
# read as its whole history decoded to float16 + one fused SDPA (benchmarks/dense_read.py,
# imported by each process's sitecustomize under VQ_DENSE_READ=1)
cp benchmarks/dense_read.py shim/ && printf 'import os\nif os.environ.get("VQ_DENSE_READ") in ("1", "2"):\n    import dense_read  # noqa\n' >> shim/sitecustomize.py
METHODS=${METHODS:-"kivi-4bit kitty skvq zipcache gear kvquant cachegen palu vecinfer age_tiered nsnquant"}
VQ_DENSE_READ=1 timeout 585 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
  --steps 16 --rounds 2 --prefill-repeats 1 --budget-s 500 \
  --methods "mlx-lm KVCache" $METHODS --out $OUT/decode_4k_s63_dense.json > $OUT/decode_4k_s63_dense.log 2>&1
grep "^|" $OUT/decode_4k_s63_dense.log | cut -c1-300; grep -A3 Traceback $OUT/decode_4k_s63_dense.log | tail -4
