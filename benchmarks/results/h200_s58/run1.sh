source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# the kernels of two decode steps under ncu, with each kernel's thread-block cluster: do svdq,
# palu and cachegen (slow with MLX's CUDA graphs, notes/cuda_graphs.md) launch kernels with a
# cluster taller than 1 in y or z, and kitty and skvq (not slowed) none?
timeout 560 python3 benchmarks/decode_kernels.py --layers 2 --warm 20 --steps 2 --timeout 95 \
  --out-dir $OUT/kernels --methods "mlx-lm KVCache" svdq palu cachegen kitty skvq > $OUT/kernels_run.log 2>&1
python3 benchmarks/decode_kernels.py --report $OUT/kernels > $OUT/kernels.md 2>&1; cat $OUT/kernels.md | cut -c1-400
tail -5 $OUT/kernels_run.log
