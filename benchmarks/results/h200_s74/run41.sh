#!/bin/bash
# Session 74: prompt chunks' encoders and histories compiled for each shape (kernels/compiled.py:
# kvquant, cachegen, adakv, turboquant, vecinfer, nsnquant, gear, zipcache, amc, kvtc) at 4k, 8B shape,
# VQ_COMPILED_PROMPT=0 against the default, one process each beside KVCache; the first
# prefill (compilation) is reported apart. After the c1 and c2 calls, carry [".device/c3"];
# ends within CALL_S (default 440) s. METHODS overrides the methods.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-440}
methods=${METHODS:-kvquant cachegen adakv turboquant vecinfer nsnquant gear zipcache amc kvtc}
for v in 0 1; do
  left=$(( (deadline - SECONDS) / (v == 0 ? 2 : 1) ))
  [ $left -lt 80 ] && break
  VQ_COMPILED_PROMPT=$v timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --methods "mlx-lm KVCache" $methods --steps 2 --rounds 1 --prefill-repeats 2 \
    --budget-s $(( left - 40 )) --out $OUT/compiled_prompt_$v.json > $OUT/compiled_prompt_$v.log 2>&1
  echo "VQ_COMPILED_PROMPT=$v rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/compiled_prompt_$v.log | cut -d'|' -f3,6-10 | head -n 9
  grep -B2 -A4 Traceback $OUT/compiled_prompt_$v.log | tail -n 6
done
true
