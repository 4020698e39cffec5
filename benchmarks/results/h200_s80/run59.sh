#!/bin/bash
# Session 80 (issue 30): the latent-rows kernel (lowrank/latent_rows_kernel.py) on CUDA: its
# self-check for palu's and svdq's layouts, then palu and svdq at 4k beside KVCache with the
# kernel (VQ_LATENT_ROWS_KERNEL=1; off by default until this measures it) and without it,
# each arm its own process. After the c1 and c2 calls, carry [".device/c3"]. About 8 minutes
# (a fresh machine compiles the first prefills).
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 benchmarks/results/h200_s80/latent_rows_check.py 2>&1 | tee $OUT/latent_rows_check.txt
VQ_LATENT_ROWS_KERNEL=1 METHODS="palu svdq" TAG=rows CALL_S=${A_S:-230} bash benchmarks/results/h200_s74/run42.sh
python3 -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['environment']['variant'] = 'VQ_LATENT_ROWS_KERNEL=1'; json.dump(d, open(p, 'w'), indent=1)" \
  $OUT/every_method_4k_rows.json  # not the tree's default: standing.py leaves it out
METHODS="palu svdq" TAG=rows_off CALL_S=${B_S:-230} bash benchmarks/results/h200_s74/run42.sh
true
