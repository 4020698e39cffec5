#!/bin/bash
# Session 78 (issue 30): every product the quantizers' steady decode steps build at 4k
# (decode_products.py's census on the CPU, the CUDA path stubbed: census_4k.json) run alone
# under ncu, to find any other that cuBLAS launches with a thread-block cluster taller than 1
# in y or z (spectral's QJL product did: run53). After the c1 and c2 calls, carry [".device/c3"].
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
ncu --metrics gpu__time_duration.sum,launch__cluster_dim_y,launch__cluster_dim_z --csv \
  python3 benchmarks/cluster_products.py --shapes benchmarks/results/h200_s78/${CENSUS:-census_4k}.json --all \
  > $OUT/census_products.csv 2> $OUT/census_products.err
echo "ncu rc=$? after ${SECONDS}s"; tail -n 3 $OUT/census_products.err
python3 benchmarks/cluster_products.py --report $OUT/census_products.csv > $OUT/census_products.md
echo "products: $(grep -c '^# ' $OUT/census_products.csv)"
grep -E "\| [0-9]+, [0-9]+ \|" $OUT/census_products.md | grep -vE "\| (0|1), (0|1) \|" || echo "no kernel with a cluster taller than 1 in y or z"
grep -E "sm90|nvjet" $OUT/census_products.md | head -n 20
true
