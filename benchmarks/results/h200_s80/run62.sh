#!/bin/bash
# Session 80 (issue 30), what 356 s of device time left allowed: the latent-rows kernel's
# check on CUDA, then one run's rows by MLX's ops and by the kernel at palu's and svdq's
# layouts (benchmarks/latent_rows.py) at 4k and 32k. After the c1 and c2 calls, carry
# [".device/c3"]. About a minute.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 benchmarks/results/h200_s80/latent_rows_check.py 2>&1 | tee $OUT/latent_rows_check.txt
python3 benchmarks/latent_rows.py 2>&1 | tee $OUT/latent_rows_4k.md
python3 benchmarks/latent_rows.py --tokens 32768 2>&1 | tee $OUT/latent_rows_32k.md
true
