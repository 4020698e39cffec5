#!/bin/bash
# Session 79 (issue 30): session 78's run54 for several censuses in one call: each product of
# a census (decode_products.py on the CPU) alone under ncu, to find any product cuBLAS launches
# with a thread-block cluster taller than 1 in y or z. After the c1 and c2 calls, carry
# [".device/c3"]. CENSUSES: census paths without ".json"; each gets CALL_S / n seconds.
# window_lengths.json: the float32 products of a window read at every length from 1 to 64
# rows and of a history from 4,096 to 4,159: does cuBLAS change its kernels (a graph's node
# kinds, hence MLX's key) as a read grows by a row a step?
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
set -- ${CENSUSES:-benchmarks/results/h200_s79/window_lengths benchmarks/results/h200_s78/census_4k benchmarks/results/h200_s78/census_prefill_2k benchmarks/results/h200_s78/census_1k}
per=$(( ${CALL_S:-540} / $# ))
for c in "$@"; do
  timeout $per ncu --metrics gpu__time_duration.sum,launch__cluster_dim_y,launch__cluster_dim_z --csv \
    python3 benchmarks/cluster_products.py --shapes $c.json --all \
    > $OUT/$(basename $c)_products.csv 2> $OUT/$(basename $c)_products.err
  echo "$c: ncu rc=$? after ${SECONDS}s; products: $(grep -c '^# ' $OUT/$(basename $c)_products.csv)"
  tail -n 2 $OUT/$(basename $c)_products.err
  python3 benchmarks/cluster_products.py --report $OUT/$(basename $c)_products.csv > $OUT/$(basename $c)_products.md
  grep -E "\| [0-9]+, [0-9]+ \|" $OUT/$(basename $c)_products.md | grep -vE "\| (0|1), (0|1) \|" \
    || echo "$c: no kernel with a cluster taller than 1 in y or z"
done
true
