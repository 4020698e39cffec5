#!/bin/bash
# Session 53, run 2 (warm machine): fit_parts.py with OpenBLAS at 1 and 2 threads: whether
# the CPU stream's small QRs and eighs pay OpenBLAS's thread start-up on this 16-core host.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
OPENBLAS_NUM_THREADS=1 python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k_blas1.log 2>&1
OPENBLAS_NUM_THREADS=2 python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k_blas2.log 2>&1
tail -n 20 $OUT/*.log
