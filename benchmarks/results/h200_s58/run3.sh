source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30's kivi-4bit target at 32k, batch 8 (8 copies of one prompt, 40 GB of KV room: both
# hold all 8), MLX's CUDA graphs on and off
for g in 1 0; do
  MLX_USE_CUDA_GRAPHS=$g timeout 250 python3 benchmarks/serve_capacity.py --prompt 32768 --kv-gb 40 \
    --max-seqs 8 --steps 8 --prefill-repeats 1 --methods full "kivi 4-bit" \
    --out $OUT/serve_32k_b8_graphs$g.md > $OUT/serve_32k_b8_graphs$g.log 2>&1
  echo "== MLX_USE_CUDA_GRAPHS=$g"; grep "^{" $OUT/serve_32k_b8_graphs$g.log | cut -c1-260
  grep -A3 Traceback $OUT/serve_32k_b8_graphs$g.log | tail -3
done
