#!/bin/bash
# Session 72's last 240 s of device time: run35.sh's 4k A/B cut to h2o and kvtc, each
# variant a process beside its own KVCache (before: VQ_MASS_KERNEL=0 VQ_FIT_STREAMS=1).
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
for v in before after; do
  if [ $v = before ]; then export VQ_MASS_KERNEL=0 VQ_FIT_STREAMS=1; else unset VQ_MASS_KERNEL VQ_FIT_STREAMS; fi
  timeout ${PER_S:-95} python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods "mlx-lm KVCache" h2o kvtc \
    --steps 2 --rounds 1 --prefill-repeats 1 --budget-s $(( ${PER_S:-95} - 40 )) \
    --out $OUT/prefill_4096_$v.json > $OUT/prefill_4096_$v.log 2>&1
  echo "$v rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/prefill_4096_$v.log | cut -d'|' -f3,6-10 | head -n 5
  tail -n 4 $OUT/prefill_4096_$v.log | cut -c1-200
done
true
