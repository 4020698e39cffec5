#!/bin/bash
# Session 53, run 5 (a fresh machine): vq.nearest's block size on the GPU (vecinfer's
# prefill codes a million key sub-vectors a layer against 4,096 centroids; at the CPU's
# 128 rows a block that is 8,192 blocks of three launches), lazy and evaluated block by
# block; then one 8B layer's prefill of the methods that call it, and vecinfer's whole
# 8B shape at 4k (session 46: 10.69 s warm, 97.4x mlx-lm's KVCache).
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/nearest_blocks.py --tokens 4096 --blocks 19 22 24 26 > $OUT/nearest_blocks_4k.log 2>&1
python3 benchmarks/prefill_layer.py --context 4096 --chunk 2048 --methods vecinfer a2ats nsnquant \
  --out $OUT/prefill_layer_vq_4k.json > $OUT/prefill_layer_vq_4k.log 2>&1
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
  --methods "mlx-lm KVCache" vecinfer --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 1 --budget-s 200 --out $OUT/decode_vecinfer.json > $OUT/decode_vecinfer.log 2>&1
cat $OUT/nearest_blocks_4k.log
tail -n 8 $OUT/prefill_layer_vq_4k.log
grep -A4 "^| context" $OUT/decode_vecinfer.log
