#!/bin/bash
# Session 53, run 1: GEAR's fits through leading_basis (a 128 x 128 Gram on the device,
# subspace iteration at 7 + 8 columns on the CPU stream) instead of gram_basis's d x d eigh.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k.log 2>&1
python3 benchmarks/prefill_layer.py --context 4096 --chunk 2048 --methods gear palu kivi \
  --out $OUT/prefill_layer_4k.json > $OUT/prefill_layer_4k.log 2>&1
tail -n 30 $OUT/*.log
