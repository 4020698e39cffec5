#!/bin/bash
# Session 77 (issue 30): which of spectral's decode products cuBLAS runs with a thread-block
# cluster taller than 1 in y or z (run48: one such tf32 kernel a layer and step, grid
# (39, 3, 1), cluster y 3), and whether a rewrite avoids it. After the c1 and c2 calls, carry
# [".device/c3"].
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
ncu --metrics gpu__time_duration.sum,launch__cluster_dim_y,launch__cluster_dim_z --csv \
  python3 benchmarks/cluster_products.py --tokens ${TOKENS:-4352} > $OUT/products.csv 2> $OUT/products.err
echo "rc=$? after ${SECONDS}s"; tail -n 3 $OUT/products.err
python3 benchmarks/cluster_products.py --report $OUT/products.csv | tee $OUT/products.md
true
