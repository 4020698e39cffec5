#!/bin/bash
# Session 81 (issue 31): the fused prompt-mass kernels (evict/fused_mass_kernel.py) on CUDA:
# their checks and keyformer's noise check (and the latent-rows kernel's float32 check under
# the widened rounding rule), one layer's prompt chunk scored fused against written logits
# (prompt_mass.py) at 4k and 32k, then h2o's and keyformer's whole-model prefill at 4k with
# them, at 32k with them, and at 4k without them (each its own process beside mlx-lm's
# KVCache; VQ_FUSED_MASS=1 turns them on). After the c1 and c2 calls, carry [".device/c3"].
# About 7 minutes. Written in session 81, not yet run: its device time ran out first.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 benchmarks/results/h200_s81/fused_mass_check.py 2>&1 | tee $OUT/fused_mass_check.txt
python3 benchmarks/results/h200_s80/latent_rows_check.py 2>&1 | grep float32
for ctx in 4096 32768; do
  python3 benchmarks/prompt_mass.py --context $ctx --only fused "2^23 (the" "MLX ops (" "keyformer gumbel_mass" 2>&1 | tee $OUT/prompt_mass_$ctx.md
done
VQ_FUSED_MASS=1 METHODS="h2o keyformer" TAG=fused CALL_S=${A_S:-110} bash benchmarks/results/h200_s74/run42.sh
python3 -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['environment']['variant'] = 'VQ_FUSED_MASS=1'; json.dump(d, open(p, 'w'), indent=1)" \
  $OUT/every_method_4k_fused.json  # not the tree's default until this measures it: standing.py leaves it out
export VQ_MEMORY_LIMIT_GB=100
VQ_FUSED_MASS=1 timeout ${B_S:-150} python3 benchmarks/decode.py --preset llama3-8b --contexts 32768 \
  --methods "mlx-lm KVCache" h2o keyformer --steps 2 --rounds 1 --warmup-rounds 1 --prefill-repeats 1 \
  --out $OUT/h2o_32k_fused.json > $OUT/h2o_32k_fused.log 2>&1
echo "rc=$?"; grep -E "^\| " $OUT/h2o_32k_fused.log | cut -d'|' -f2,3,6-12
python3 -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['environment']['variant'] = 'VQ_FUSED_MASS=1'; json.dump(d, open(p, 'w'), indent=1)" \
  $OUT/h2o_32k_fused.json
METHODS="h2o keyformer" TAG=written CALL_S=${C_S:-90} bash benchmarks/results/h200_s74/run42.sh
true
