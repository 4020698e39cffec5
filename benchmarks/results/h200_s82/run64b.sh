#!/bin/bash
# Session 82: the second half of h200_s81/run63.sh: h2o and keyformer, whole model, at 4k with
# the fused kernels (VQ_FUSED_MASS=1), at 32k with them, at 4k without (each its own process
# beside mlx-lm's KVCache). The variant is written into each switched-on JSON.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
tag_variant() { python3 -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['environment']['variant'] = 'VQ_FUSED_MASS=1'; json.dump(d, open(p, 'w'), indent=1)" "$1"; }
VQ_FUSED_MASS=1 METHODS="h2o keyformer" TAG=fused CALL_S=${A_S:-120} bash benchmarks/results/h200_s74/run42.sh
tag_variant $OUT/every_method_4k_fused.json
METHODS="h2o keyformer" TAG=written CALL_S=${C_S:-100} bash benchmarks/results/h200_s74/run42.sh
export VQ_MEMORY_LIMIT_GB=100
VQ_FUSED_MASS=1 timeout ${B_S:-200} python3 benchmarks/decode.py --preset llama3-8b --contexts 32768 \
  --methods "mlx-lm KVCache" h2o keyformer --steps 2 --rounds 1 --warmup-rounds 1 --prefill-repeats 1 \
  --out $OUT/h2o_32k_fused.json > $OUT/h2o_32k_fused.log 2>&1
echo "rc=$? after ${SECONDS}s"; grep -E "^\| " $OUT/h2o_32k_fused.log | cut -d'|' -f2,3,6-12
tag_variant $OUT/h2o_32k_fused.json
true
