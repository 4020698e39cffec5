#!/bin/bash
# Session 82: the fused prompt-mass kernels' self-check (float16, bfloat16, keyformer's noise),
# then h2o and keyformer whole-model at 4k with them and without, and at 32k with them: the
# decision part of h200_s81/run63.sh in one call (the device time left could not hold both
# halves, run64a.sh and run64b.sh). About 8 minutes.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 benchmarks/results/h200_s81/fused_mass_check.py 2>&1 | tee $OUT/fused_mass_check.txt | head -20
echo "check done after ${SECONDS}s"
A_S=${A_S:-110} B_S=${B_S:-170} C_S=${C_S:-90} bash benchmarks/results/h200_s82/run64b.sh
