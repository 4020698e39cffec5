source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# 1. the pure path's products in a chain of 32 calls, MLX's CUDA graphs on and off: do the
#    captured cuBLAS products (child graphs) cost a chain more with graphs on?
for g in 1 0; do
  MLX_USE_CUDA_GRAPHS=$g timeout 100 python3 benchmarks/skinny_matmul.py --tokens 4096 32768 --chain 32 \
    > $OUT/skinny_graphs$g.log 2>&1
  echo "== MLX_USE_CUDA_GRAPHS=$g"; grep "^| [0-9]" $OUT/skinny_graphs$g.log | tail -16
done
# 2. spectral's decode step read in blocks (session 57): stacked against per sequence
timeout 230 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 10 --max-seqs 24 --steps 4 \
  --prefill-repeats 1 --methods spectral "spectral, per sequence" \
  --out $OUT/serve_capacity-8k-spectral.md > $OUT/serve_8k_spectral.log 2>&1
grep "^{" $OUT/serve_8k_spectral.log | cut -c1-260; grep -A3 Traceback $OUT/serve_8k_spectral.log | tail -3
