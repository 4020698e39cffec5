#!/bin/bash
# Session 73: the compiled group quantizer (quant/affine.group_quantize: one shapeless
# compiled pass a width and group, 7 kernels a call where the operations one by one made 20)
# on warm prefill at 4k, VQ_COMPILED_QUANTIZER=0 against the default, each a process beside
# its own KVCache. After the c1 and c2 calls, carry [".device/c3"]; ends within CALL_S (400) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-400}
for v in 0 1; do
  left=$(( (deadline - SECONDS) / (v == 0 ? 2 : 1) ))
  [ $left -lt 80 ] && break
  VQ_COMPILED_QUANTIZER=$v timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --methods "mlx-lm KVCache" kivi age_tiered zipcache skvq --steps 2 --rounds 1 --prefill-repeats 2 \
    --budget-s $(( left - 40 )) --out $OUT/quantizer_$v.json > $OUT/quantizer_$v.log 2>&1
  echo "VQ_COMPILED_QUANTIZER=$v rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/quantizer_$v.log | cut -d'|' -f3,6-10 | head -n 7
  grep -B2 -A4 Traceback $OUT/quantizer_$v.log | tail -n 6
done
true
