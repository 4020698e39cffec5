#!/bin/bash
# Session 68 (issue 30): palu's fused read without its pad and slice copies and age_tiered's
# CUDA read (every tier decoded + one fused attention), each against the code before in the
# same machine: 02005dd's lowrank/latent.py and methods/age_tiered/tiers.py (carried in
# .device/before, copied over the shim's). After the c1 and c2 calls, carry
# [".device/c3", ".device/before"]. METHODS, STOP_S and LIMIT_S shorten it to what a call has left.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
new=/tmp/new && mkdir -p $new && cp shim/veloxquant_mlx/lowrank/latent.py shim/veloxquant_mlx/methods/age_tiered/tiers.py $new/
for spec in "before:${METHODS:-palu age_tiered}" "after:${METHODS:-palu age_tiered}"; do
  IFS=: read variant methods <<< "$spec"
  if [ $variant = before ]; then src=.device/before; else src=$new; fi
  cp $src/latent.py shim/veloxquant_mlx/lowrank/latent.py
  cp $src/tiers.py shim/veloxquant_mlx/methods/age_tiered/tiers.py
  [ $SECONDS -gt ${STOP_S:-400} ] && break
  timeout $((${LIMIT_S:-560} - SECONDS)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 16 --rounds 2 --prefill-repeats 1 --budget-s 200 \
    --methods "mlx-lm KVCache" $methods --out $OUT/decode_4k_$variant.json > $OUT/decode_4k_$variant.log 2>&1
  echo "$variant"; grep "^| 4096" $OUT/decode_4k_$variant.log | cut -c1-300
  grep -A3 Traceback $OUT/decode_4k_$variant.log | tail -4
done
true
