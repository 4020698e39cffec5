#!/bin/bash
# Session 52, run 4 (a fresh machine): fit_parts.py with GEAR's whole encode evaluated (run 3
# timed its codes alone) and the CPU stream's eigh at 1, 8 and 16 Grams a call.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k_run4.log 2>&1
tail -n 20 $OUT/*.log
