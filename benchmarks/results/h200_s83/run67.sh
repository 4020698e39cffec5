#!/bin/bash
# Session 83: the fused prompt-mass kernels reading the keys through their strides (a store's
# keys, a view of its larger buffer, no longer copied at each launch): their check on CUDA, then
# h2o's whole-model peak at 32k with the keys read in place against copied (VQ_FUSED_COPY=1, a
# switch of this run only: fused_copy_switch.patch, applied here to the device's copy), each
# arm its own process beside mlx-lm's KVCache, and one layer's
# (prefill_peak.py); and prompt_mass.py's scoring against SDPA at 4k and 32k. After the c1 and c2
# calls, carry [".device/c3"]. About 6 minutes.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
patch -p1 -N -s < benchmarks/results/h200_s83/fused_copy_switch.patch || git apply benchmarks/results/h200_s83/fused_copy_switch.patch
grep -c VQ_FUSED_COPY veloxquant/evict/fused_mass_kernel.py
timeout 100 python3 benchmarks/results/h200_s83/strided_check.py 2>&1 | tee $OUT/strided_check.txt | head -20
echo "check done after ${SECONDS}s"
# one layer's scoring against SDPA over the same chunk (2,048 queries): do the kernels' own time
# account for h2o's 1.54x / 2.69x and keyformer's 2.31x / 5.96x warm prefill (session 82)?
for ctx in 4096 32768; do
  timeout 60 python3 benchmarks/prompt_mass.py --context $ctx --only "attention_mass (current)" \
    "keyformer gumbel_mass, fused" 2>&1 | tail -6
done
for ctx in 32768; do
  for copy in 0 1; do
    echo "one layer, VQ_FUSED_COPY=$copy"
    VQ_FUSED_COPY=$copy VQ_MEMORY_LIMIT_GB=60 timeout 60 python3 benchmarks/prefill_peak.py --heads 32 8 --context $ctx \
      --dtype float16 --caches "mlx-lm KVCache" "h2o 1024" 2>&1 | tail -3
  done
done
export VQ_MEMORY_LIMIT_GB=70
for copy in 0 1; do
  VQ_FUSED_COPY=$copy timeout ${B_S:-110} python3 benchmarks/decode.py --preset llama3-8b --contexts 32768 \
    --methods "mlx-lm KVCache" h2o --steps 2 --rounds 1 --warmup-rounds 1 --prefill-repeats 1 \
    --out $OUT/h2o_32k_copy$copy.json > $OUT/h2o_32k_copy$copy.log 2>&1
  echo "VQ_FUSED_COPY=$copy rc=$? after ${SECONDS}s"; grep -E "^\| " $OUT/h2o_32k_copy$copy.log | cut -d'|' -f2,3,6-12
done
true
