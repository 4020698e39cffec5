#!/bin/bash
# Fits' eigenproblems over several CPU streams (lowrank/cpu_streams.py), session 72: warm
# prefill at 4k of the methods whose prompt fits call eigh, with VQ_FIT_STREAMS=1 (one CPU
# stream, OpenBLAS at its default thread count: the old way) and unset (half the cores, at
# most 8, OpenBLAS at one thread a call), each run its own process beside its own KVCache.
# After the c1 and c2 calls, carry [".device/c3"]; about 560 s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
methods=${METHODS:-"palu svdq spectral amc curdkv gear kvtc xkv"}
nproc
for streams in 1 default; do
  if [ $streams = default ]; then unset VQ_FIT_STREAMS; else export VQ_FIT_STREAMS=$streams; fi
  timeout $(( ${HALF_S:-275} )) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --methods "mlx-lm KVCache" $methods --steps 2 --rounds 1 --prefill-repeats 2 --budget-s ${BUDGET_S:-180} \
    --out $OUT/fit_streams_$streams.json > $OUT/fit_streams_$streams.log 2>&1
  echo "VQ_FIT_STREAMS=$streams rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/fit_streams_$streams.log | cut -d'|' -f3,6-10 | head -n 12
  grep -B2 -A4 Traceback $OUT/fit_streams_$streams.log | tail -n 8
done
true
