source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# 1. rows of a (B, H, T, D) float16 buffer: take_along_axis broadcast over D against a take of
#    the flattened rows (the eviction store's compaction shapes, a2ats's, serving's)
timeout 90 python3 benchmarks/gather_rows.py --shapes 1,8,8192,128,3300 8,8,8192,128,3300 \
  1,8,32768,128,2048 64,8,32768,128,2048 > $OUT/gather_rows.log 2>&1; tail -12 $OUT/gather_rows.log
# 2. svdq's, palu's and cachegen's slow steps at 4k, with MLX's CUDA graphs and without
for g in 1 0; do
  MLX_USE_CUDA_GRAPHS=$g timeout 200 python3 benchmarks/periodic_steps.py --preset llama3-8b \
    --contexts 4096 --steps 48 --runs 2 --methods svdq palu cachegen \
    --out $OUT/periodic_graphs$g.json > $OUT/periodic_graphs$g.log 2>&1
  echo "== MLX_USE_CUDA_GRAPHS=$g"; grep -v "^\s*$" $OUT/periodic_graphs$g.log | tail -14
done
