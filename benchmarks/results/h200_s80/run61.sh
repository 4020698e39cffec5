#!/bin/bash
# Session 80: run59.sh and run60.sh in one call (what the device time left allowed): the
# latent-rows kernel's check, then palu, svdq, curdkv, xkv, qfilters and anchorkv at 4k beside
# KVCache in one process as the tree ships them, then palu and svdq without the kernel
# (VQ_LATENT_ROWS_KERNEL=0) in a second. After the c1 and c2 calls, carry [".device/c3"].
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 benchmarks/results/h200_s80/latent_rows_check.py 2>&1 | tee $OUT/latent_rows_check.txt
METHODS="palu svdq curdkv xkv qfilters anchorkv" TAG=s80 CALL_S=${A_S:-300} bash benchmarks/results/h200_s74/run42.sh
VQ_LATENT_ROWS_KERNEL=0 METHODS="palu svdq" TAG=rows_off CALL_S=${B_S:-200} bash benchmarks/results/h200_s74/run42.sh
true
