#!/bin/bash
# Session 52, device call 3 of run 1: what a custom kernel costs the host (source size),
# the KIVI dispatcher's launches against the fused attention, and where a kivi decode
# step's build goes on CUDA (cProfile, real kernels), 32 layers of the 8B shape at 4k.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/submit_cost.py --out $OUT/submit_cost.json > $OUT/submit_cost.log 2>&1
python3 benchmarks/host_time.py --no-stub --dtype float16 --layers 32 --context 4096 --steps 20 \
  --methods "mlx-lm KVCache" full kivi-4bit kivi-2bit streaming_llm snapkv > $OUT/host_time.log 2>&1
python3 benchmarks/host_time.py --no-stub --dtype float16 --layers 32 --context 4096 --steps 20 \
  --profile kivi-4bit --top 40 > $OUT/profile_kivi.log 2>&1
python3 benchmarks/host_time.py --no-stub --dtype float16 --layers 32 --context 4096 --steps 20 \
  --profile "mlx-lm KVCache" --top 25 > $OUT/profile_kvcache.log 2>&1
tail -n 30 $OUT/*.log
