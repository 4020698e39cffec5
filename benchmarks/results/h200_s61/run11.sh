source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# issue 30 (session 61), part 1: do session 60's GPU read paths compute right on CUDA? The
# decode-read tests against float64 attention, on the GPU (pytest carried as wheels in c3)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 200 python3 -m pytest -q -p no:cacheprovider --no-header \
  tests/test_*_decode_read.py > $OUT/decode_read_cuda.log 2>&1; echo "pytest rc=$?"
tail -15 $OUT/decode_read_cuda.log | cut -c1-300
# part 2: which CUDA graphs each method's decode steps commit, and how many are new at each
# step (a new structure is instantiated: notes/cuda_graphs.md); one process a method
mkdir -p $OUT/graphs
for m in "mlx-lm KVCache" kivi-4bit cachegen palu svdq gear zipcache kitty skvq; do
  f=$(echo "$m" | tr ' ' '_'); rm -rf /tmp/g && mkdir -p /tmp/g
  MLX_SAVE_CUDA_GRAPHS_DOT_FILE=/tmp/g/cg timeout 60 python3 benchmarks/cuda_graph_structures.py \
    --preset llama3-8b --layers 4 --context 4096 --steps 40 --keep 3 --method "$m" \
    --out $OUT/graphs/$f.json > $OUT/graphs/$f.log 2>&1; echo "$m rc=$?"; tail -1 $OUT/graphs/$f.log
done
tar czf $OUT/graphs.tgz -C $OUT graphs && rm -rf $OUT/graphs
