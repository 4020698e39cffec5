source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# 1. vecinfer's stacked step read a block of rows at a time (session 57) against per sequence
timeout 200 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 5 --max-seqs 24 --steps 4 \
  --prefill-repeats 1 --methods vecinfer "vecinfer, per sequence" \
  --out $OUT/serve_capacity-8k-vecinfer.md > $OUT/serve_8k_vecinfer.log 2>&1
grep "^{" $OUT/serve_8k_vecinfer.log | cut -c1-260; grep -A3 Traceback $OUT/serve_8k_vecinfer.log | tail -3
# 2. issue 30's kivi-4bit targets at 32k, batch 1, MLX's CUDA graphs on and off (one process each)
for g in 1 0; do
  MLX_USE_CUDA_GRAPHS=$g timeout 150 python3 benchmarks/decode.py --preset llama3-8b --contexts 32768 \
    --steps 16 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --methods "mlx-lm KVCache" kivi-4bit \
    --out $OUT/decode32k_graphs$g.json > $OUT/decode32k_graphs$g.log 2>&1
  echo "== MLX_USE_CUDA_GRAPHS=$g"; grep "^| 32768" $OUT/decode32k_graphs$g.log | cut -d"|" -f3,11,12,13,15
done
