#!/bin/bash
# Session 78 (issue 30): run51 found spectral 5.5x faster with MLX's CUDA graphs off (0.28x
# KVCache against 0.05x), and none of the rebuild's products launching a cluster kernel alone.
# Here: the QJL correction's product (n x 4 by 4 x 4) and token_mix's cut product under ncu;
# then spectral with the QJL sketch applied as a sum of broadcast products (the tree) against
# the product (eigen_store.QJL_SUMMED_COLUMNS = 0, as before), graphs on, each beside its own
# KVCache; then, in the time left, the cluster scan of other quantizers (decode_kernels.py).
# After the c1 and c2 calls, carry [".device/c3"]; ends within CALL_S (default 540) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-540}
ncu --metrics gpu__time_duration.sum,launch__cluster_dim_y,launch__cluster_dim_z --csv \
  python3 benchmarks/cluster_products.py --tokens 4352 > $OUT/products.csv 2> $OUT/products.err
echo "ncu rc=$? after ${SECONDS}s"; tail -n 3 $OUT/products.err
python3 benchmarks/cluster_products.py --report $OUT/products.csv > $OUT/products.md
grep -E "QJL|token axis|clusters" $OUT/products.md; grep -vE "\| (0|1), (0|1) \|" $OUT/products.md | head -n 12
for cols in ${ARMS:-8 0}; do
  left=$(( deadline - SECONDS - 10 )); [ $left -lt 60 ] && { echo "arm $cols: no time left"; continue; }
  [ $left -gt 260 ] && left=260
  timeout $left python3 -c "
import runpy, sys
import veloxquant_mlx.methods.spectral.eigen_store as e
e.QJL_SUMMED_COLUMNS = $cols
sys.argv = ['decode.py', '--preset', 'llama3-8b', '--contexts', '4096', '--methods', 'mlx-lm KVCache', 'spectral',
            '--steps', '8', '--rounds', '2', '--warmup-rounds', '1', '--prefill-repeats', '1', '--out', '$OUT/spectral_qjl$cols.json']
runpy.run_path('benchmarks/decode.py', run_name='__main__')" > $OUT/spectral_qjl$cols.log 2>&1
  echo "arm QJL_SUMMED_COLUMNS=$cols rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/spectral_qjl$cols.log | cut -d'|' -f2,3,6-12
done
for m in ${SCAN:-cachegen gear zipcache}; do
  left=$(( deadline - SECONDS - 15 )); [ $left -lt 50 ] && { echo "$m: no time left"; continue; }
  [ $left -gt 90 ] && left=90
  python3 benchmarks/decode_kernels.py --out-dir $OUT/kernels --timeout $left --layers 2 --warm 36 --steps 4 \
    --methods "$m" >> $OUT/kernels.log 2>&1
  echo "$m rc=$? after ${SECONDS}s"
done
[ -d $OUT/kernels ] && python3 benchmarks/decode_kernels.py --report $OUT/kernels --top 6 | tee $OUT/kernels.md
true
