#!/bin/bash
# Issue 31's prefill table at 4k (session 72): every method at its defaults in one process
# beside one KVCache, warm prefill (--prefill-repeats 1) and the first call apart, peaks,
# then a short decode so the table is decode.py's. After the c1 and c2 calls, carry
# [".device/c3"]; at most 590 s. The last full table was session 67's.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
timeout 585 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods all \
  --steps 2 --rounds 1 --prefill-repeats 1 --budget-s ${BUDGET_S:-420} \
  --out $OUT/prefill_4k_all.json > $OUT/prefill_4k_all.log 2>&1
echo "decode rc=$? after ${SECONDS}s"; grep -E "^\| " $OUT/prefill_4k_all.log | cut -c1-260 | tail -n 60
grep -B2 -A4 Traceback $OUT/prefill_4k_all.log | tail -n 12
true
