#!/bin/bash
# Session 82: the first half of h200_s81/run63.sh (the fused prompt-mass kernels' checks and
# one layer's chunk at 4k and 32k), split so that neither call nears the 600 s limit.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
python3 benchmarks/results/h200_s81/fused_mass_check.py 2>&1 | tee $OUT/fused_mass_check.txt
python3 benchmarks/results/h200_s80/latent_rows_check.py 2>&1 | grep float32
for ctx in 4096 32768; do
  timeout 150 python3 benchmarks/prompt_mass.py --context $ctx --only fused "2^23 (the" "MLX ops (" "keyformer gumbel_mass" 2>&1 | tee $OUT/prompt_mass_$ctx.md
done
echo "done after ${SECONDS}s"
