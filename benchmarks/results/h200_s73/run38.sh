#!/bin/bash
# Session 73: the slot-rows kernel's A/B again (session 72's 6 rounds gave 0.89, 1.01 and 1.05:
# no consistent gain), 12 rounds of 16 overlapped steps at 4k, one process. Carry
# [".device/c3"] on a machine where the c1 and c2 calls ran; about 220 s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
timeout ${CALL_S:-290} python3 benchmarks/read_ab.py --switch slot-rows-kernel --preset llama3-8b --context 4096 \
  --methods "snapkv 2048 + kivi-4bit" "tova 2048 + kivi-4bit" "h2o 2048 + kivi-2bit" --rounds 12 \
  > $OUT/slot_rows_ab.log 2>&1
echo "kernel A/B rc=$? after ${SECONDS}s"; grep -E "^\|" $OUT/slot_rows_ab.log
