#!/bin/bash
# Session 74: every method at its defaults on the 8B shape at 4k in one process (issue 31's
# prefill table, first and warm, and issue 30's overlapped decode beside it), ratios to
# mlx-lm's KVCache in the same run. After the c1 and c2 calls, carry [".device/c3"]; ends
# within CALL_S (default 560) s: the methods not prefilled by then are rows marked skipped.
# METHODS="..." runs those instead of all (e.g. the skipped rows of an earlier call).
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-560}
methods=${METHODS:-all}
tag=${TAG:-a}
left=$(( deadline - SECONDS - 10 ))
timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods "mlx-lm KVCache" $methods \
  --steps 4 --rounds 2 --warmup-rounds 1 --prefill-repeats 1 --budget-s $(( left * 55 / 100 )) \
  --out $OUT/every_method_4k_$tag.json > $OUT/every_method_4k_$tag.log 2>&1
echo "rc=$? after ${SECONDS}s"
grep -E "^\| " $OUT/every_method_4k_$tag.log | cut -d'|' -f2,3,6-12 | head -n 60
grep -c skipped $OUT/every_method_4k_$tag.log
grep -B2 -A4 Traceback $OUT/every_method_4k_$tag.log | tail -n 12
true
