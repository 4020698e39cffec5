#!/bin/bash
# Session 52, run 5: the CPU stream's eigh split over several CPU streams (a thread each),
# with OpenBLAS's own threads as they are and at one a process.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k_run5.log 2>&1
OPENBLAS_NUM_THREADS=1 python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k_run5_blas1.log 2>&1
OPENBLAS_NUM_THREADS=4 python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k_run5_blas4.log 2>&1
python3 -c "import numpy; numpy.show_config()" 2>&1 | grep -i -A3 "blas\|lapack" | head -20 > $OUT/blas.log
tail -n 30 $OUT/*.log
