#!/bin/bash
# Session 52, run 3 (a fresh machine): where gear's and palu's prompt-chunk fits go on the
# GPU (the CPU stream's eigh against the device's parts), and one 8B layer's prefill.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/fit_parts.py --tokens 2048 > $OUT/fit_parts_2k.log 2>&1
python3 benchmarks/fit_parts.py --tokens 8192 > $OUT/fit_parts_8k.log 2>&1
python3 benchmarks/prefill_layer.py --context 4096 --chunk 2048 --methods gear palu kivi \
  --out $OUT/prefill_layer_4k.json > $OUT/prefill_layer_4k.log 2>&1
tail -n 40 $OUT/*.log
