#!/bin/bash
# Session 53, run 3 (a fresh machine): leading_basis part by part (is the CPU stream's time
# the QRs, the Gram's move to the host, or the round trip?) and two device-side variants;
# then the whole 8B shape's warm prefill for gear at 4k and 32k against mlx-lm's KVCache
# (session 51's decode_paced run: gear 18.6x at 4k, 14.5x at 32k).
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/leading_basis_parts.py --tokens 2048 > $OUT/leading_basis_parts_2k.log 2>&1
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 \
  --methods "mlx-lm KVCache" gear --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 1 --budget-s 330 --out $OUT/decode_gear.json > $OUT/decode_gear.log 2>&1
cat $OUT/leading_basis_parts_2k.log
grep -A6 "^| context" $OUT/decode_gear.log
