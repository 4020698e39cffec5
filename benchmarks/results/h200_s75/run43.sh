#!/bin/bash
# Session 75: issue 30's batch-8 targets at 32k (eviction at a 2,048-token budget >= 1.8x,
# kivi 4-bit >= 1.4x of KVCache's tokens a second), each method in its own process beside
# its own KVCache (`decode.py --batch 8 --isolate`: 8 prompts of 32k, 34 GB of fp16 KV a
# KVCache). After the c1 and c2 calls, carry [".device/c3"]; ends within CALL_S (default
# 560) s, the methods not started by then marked skipped. METHODS overrides the methods,
# separated by ";" (their names hold spaces: METHODS="snapkv 2048;kivi-2bit").
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=120
deadline=${CALL_S:-560}
left=$(( deadline - SECONDS - 10 ))
if [ -n "$METHODS" ]; then IFS=';' read -ra methods <<< "$METHODS"; else
  methods=("snapkv 2048" "streaming_llm 4+2044" "kivi-4bit" "kivi-2bit" "h2o 2048" "tova 2048 + kivi-4bit"); fi
timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 32768 --batch 8 --isolate \
  --methods "mlx-lm KVCache" "${methods[@]}" --steps 8 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 \
  --budget-s $(( left * 70 / 100 )) --out $OUT/batch8_32k.json > $OUT/batch8_32k.log 2>&1
echo "rc=$? after ${SECONDS}s"
grep -E "^\| " $OUT/batch8_32k.log | cut -d'|' -f3,5,7,10-14 | head -n 20
grep -B2 -A4 Traceback $OUT/batch8_32k.log | tail -n 12
true
