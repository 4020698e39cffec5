#!/bin/bash
# Session 52, run 2 (same warm machine as run 1): submit_cost.py again, its small custom
# kernel's CUDA source fixed (run 1 stopped there: `uint` is Metal's).
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/submit_cost.py --out $OUT/submit_cost.json > $OUT/submit_cost.log 2>&1
tail -n 20 $OUT/submit_cost.log
