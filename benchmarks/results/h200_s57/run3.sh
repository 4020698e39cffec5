source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# run2.sh's comparison (MLX's CUDA graphs on, off) over more methods
M=("mlx-lm KVCache" full "snapkv 2048" knorm tova kitty age_tiered turboquant skvq)
for s in default MLX_USE_CUDA_GRAPHS=0; do
  env $([ $s = default ] || echo $s) timeout 200 python3 benchmarks/decode.py --preset llama3-8b \
    --contexts 4096 --steps 32 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --budget-s 170 \
    --methods "${M[@]}" --out $OUT/decode3_${s//=/_}.json > $OUT/decode3_${s//=/_}.log 2>&1
  echo "== $s"; grep "^| 4096" $OUT/decode3_${s//=/_}.log | cut -d"|" -f3,11,12,13,15
done
