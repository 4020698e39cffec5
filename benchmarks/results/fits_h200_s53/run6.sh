#!/bin/bash
# Session 53, run 6 (a fresh machine): vq.nearest as landed (2^24 distances a block on a
# GPU, blocks paced one behind): vecinfer's whole 8B shape at 4k (run 5, lazy 2^24 blocks:
# 1.553 s warm but a 30 GB peak, 4.49x fp16's) and one layer's prefill.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
  --methods "mlx-lm KVCache" vecinfer --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 1 --budget-s 200 --out $OUT/decode_vecinfer_paced.json > $OUT/decode_vecinfer_paced.log 2>&1
python3 benchmarks/prefill_layer.py --context 4096 --chunk 2048 --methods vecinfer \
  --out $OUT/prefill_layer_vecinfer_paced.json > $OUT/prefill_layer_vecinfer_paced.log 2>&1
grep -A4 "^| context" $OUT/decode_vecinfer_paced.log
tail -n 5 $OUT/prefill_layer_vecinfer_paced.log
