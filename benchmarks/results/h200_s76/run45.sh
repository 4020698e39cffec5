#!/bin/bash
# Session 76: where h2o's peak at 4k comes from (1.88x KVCache's in session 75's run42 call;
# h2o 2048 + kivi-2bit 1.89x, h2o 2048 0.91). long_prefill.py names the phase of each
# method's peak (a chunk, the last token, the decode steps), for the prompt-mass kernels off
# (VQ_MASS_KERNEL=0: MLX's ops, 2^23 logits a block) and on (the default, 2^25), the whole
# 32-layer model. Then session 75's run44 (decode.py's peak, the same A/B) if time is left.
# After the c1 and c2 calls, carry [".device/c3"]; ends within CALL_S (default 540) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-540}
for v in 0 1; do
  left=$(( (deadline - SECONDS - 10) / (v == 0 ? 3 : 2) ))
  [ $left -lt 60 ] && break
  VQ_MASS_KERNEL=$v timeout $left python3 benchmarks/long_prefill.py --preset llama3-8b --contexts 4096 \
    --methods "mlx-lm KVCache" h2o "h2o 2048" "h2o 2048 + kivi-2bit" full --method-timeout-s 120 \
    --out $OUT/h2o_phases_mass$v.json > $OUT/h2o_phases_mass$v.log 2>&1
  echo "long_prefill VQ_MASS_KERNEL=$v rc=$? after ${SECONDS}s"
  grep -E "^\| 4096" $OUT/h2o_phases_mass$v.log
done
left=$(( deadline - SECONDS - 10 ))
[ $left -ge 120 ] && CALL_S=$left bash benchmarks/results/h200_s75/run44.sh
true
