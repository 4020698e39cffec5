#!/bin/bash
# Session 78 (issue 30): which of spectral's decode products launches the cuBLAS kernel with
# a thread-block cluster of 3 in y (session 77's run48), and which rewrite or size gets a
# flat one (cluster_products.py); then spectral beside mlx-lm's KVCache at 4k, one process an
# arm: MLX's CUDA graphs on (default), off (MLX_USE_CUDA_GRAPHS=0), and on with the decode
# read cut into spans of 2,048 and 512 tokens (eigen_store.READ_BLOCK_BYTES_GPU set before
# decode.py runs; 4 KiB a token at the 8B shape). If re-instantiating that kernel's graph at
# every commit is spectral's gap, graphs off closes most of it, and so does a span whose
# products are flat. After the c1 and c2 calls, carry [".device/c3"].
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
ncu --metrics gpu__time_duration.sum,launch__cluster_dim_y,launch__cluster_dim_z --csv \
  python3 benchmarks/cluster_products.py --tokens ${TOKENS:-4352} > $OUT/products.csv 2> $OUT/products.err
echo "ncu rc=$? after ${SECONDS}s"; tail -n 3 $OUT/products.err
python3 benchmarks/cluster_products.py --report $OUT/products.csv | tee $OUT/products.md
for arm in ${ARMS:-on 2 off 8}; do
  graphs=1; mib=256
  case $arm in off) graphs=0 ;; on) ;; *) mib=$arm ;; esac
  MLX_USE_CUDA_GRAPHS=$graphs timeout $([ $arm = on ] && echo 170 || echo ${PER_S:-110}) python3 -c "
import runpy, sys
import veloxquant_mlx.methods.spectral.eigen_store as e
e.READ_BLOCK_BYTES_GPU = $mib << 20
sys.argv = ['decode.py', '--preset', 'llama3-8b', '--contexts', '4096', '--methods', 'mlx-lm KVCache', '${METHOD:-spectral}',
            '--steps', '8', '--rounds', '2', '--warmup-rounds', '1', '--prefill-repeats', '1', '--out', '$OUT/spectral_$arm.json']
runpy.run_path('benchmarks/decode.py', run_name='__main__')" > $OUT/spectral_$arm.log 2>&1
  echo "arm $arm (graphs $graphs, spans of $mib MiB) rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/spectral_$arm.log | cut -d'|' -f2,3,6-12
done
true
