source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# which of the two row gathers disagreed at 2^31 elements in run1.sh
timeout 60 python3 benchmarks/gather_rows.py --repeats 5 --shapes 64,8,32768,128,2048 32,8,32768,128,2048 \
  > $OUT/gather_rows_large.log 2>&1; tail -4 $OUT/gather_rows_large.log
# decode at 4k, overlapped, under MLX's CUDA graph settings (one process each, MLX's
# defaults first): do the periodic steps' spikes (run1.sh) cost the quantizers their
# tokens per second, and what does each setting cost the baseline?
M=("mlx-lm KVCache" full kivi-4bit h2o svdq palu cachegen)
for s in default MLX_MAX_MB_PER_BUFFER=1000000 MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_USE_CUDA_GRAPHS=0; do
  env $([ $s = default ] || echo $s) timeout 140 python3 benchmarks/decode.py --preset llama3-8b \
    --contexts 4096 --steps 32 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --methods "${M[@]}" \
    --out $OUT/decode_$s.json > $OUT/decode_$s.log 2>&1
  echo "== $s"; grep "^| 4096" $OUT/decode_$s.log | cut -d"|" -f3,11,12,13,15 
done
