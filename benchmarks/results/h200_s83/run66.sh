#!/bin/bash
# Session 83: results/h200_s82's queue in two calls (after the c1 and c2 calls, carry
# [".device/c3"]). PART=a (about 9 minutes): submit_cost.py's host-made arrays against
# device-made ones and views of a device-made table; then h2o and keyformer with their
# per-step arrays (the count of rows, keyformer's row hashes and temperature) made on the host
# at every step and layer (VQ_STEP_ARRAYS=host, the tree's way), as views of device-made
# tables (view: more graph nodes), or one host-made array a step shared by the layers (shared:
# no more nodes), alternating (step_arrays.patch, applied here to the device's copy: not in the
# tree). PART=b (about 8 minutes): palu, svdq, cachegen and gear at 4k against session 79's
# figures; the eviction methods at 32k (issue 30's 1.0x bar at their defaults and 1.3x at a
# 2,048 budget).
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${PART:-a}" = a ]; then
  patch -p1 -N -s < benchmarks/results/h200_s83/step_arrays.patch ||
    git apply benchmarks/results/h200_s83/step_arrays.patch
  grep -c VQ_STEP_ARRAYS veloxquant/methods/keyformer.py
  timeout ${SUBMIT_S:-60} python3 benchmarks/submit_cost.py --out $OUT/submit_cost.json > $OUT/submit_cost.log 2>&1
  echo "submit_cost rc=$? after ${SECONDS}s"; grep -E "^\| " $OUT/submit_cost.log
  i=0
  for arm in host shared view host shared view; do
    i=$((i + 1))
    VQ_STEP_ARRAYS=$arm METHODS="h2o keyformer" TAG=${arm}_$i CALL_S=${ARM_S:-80} \
      bash benchmarks/results/h200_s74/run42.sh
  done
else
  METHODS="palu svdq cachegen gear" TAG=s79_again CALL_S=${PALU_S:-150} bash benchmarks/results/h200_s74/run42.sh
  export VQ_MEMORY_LIMIT_GB=70
  timeout ${EVICT_S:-330} python3 benchmarks/decode.py --preset llama3-8b --contexts 32768 \
    --methods "mlx-lm KVCache" snapkv knorm tova h2o pyramidkv kvzip "snapkv 2048" "h2o 2048" \
    --steps 4 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --budget-s $(( ${EVICT_S:-330} * 6 / 10 )) \
    --out $OUT/evict_32k.json > $OUT/evict_32k.log 2>&1
  echo "evict rc=$? after ${SECONDS}s"; grep -E "^\| " $OUT/evict_32k.log | cut -d'|' -f2,3,6-12
fi
true
