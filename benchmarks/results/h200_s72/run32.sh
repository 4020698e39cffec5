#!/bin/bash
# Session 72, after the c1 and c2 calls, carry [".device/c3"]. Ends by itself within
# BUDGET_S + 170 s when BUDGET_S is set (a call given less than 600 s), else 585 s:
# (1) the prompt-mass kernels (evict/mass_kernel.py, emulated only so far) on the GPU: their
#     tests, then benchmarks/prompt_mass.py against MLX's ops at 4k;
# (2) fits over several CPU streams (lowrank/cpu_streams.py): warm prefill at 4k of palu,
#     svdq, gear and kvtc with VQ_FIT_STREAMS=1 (the old way) and the default, each run a
#     process beside its own KVCache (run34.sh does more methods).
# The all-method prefill table moved to the next session (README).
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
deadline=$(( ${BUDGET_S:+$BUDGET_S + 170} ))
[ "$deadline" -gt 0 ] 2>/dev/null || deadline=585
MLX_DEFAULT_DEVICE=gpu timeout 100 python3 -m pytest -q -p no:cacheprovider --no-header -rfE tests/test_mass_kernel.py \
  > $OUT/mass_kernel_tests_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/mass_kernel_tests_cuda.log | cut -c1-300 | head -6
timeout 60 python3 benchmarks/prompt_mass.py --context 4096 --chunk 2048 --repeats 5 --only "MLX ops" "mass kernels" \
  > $OUT/prompt_mass_4k.log 2>&1
echo "prompt_mass rc=$? after ${SECONDS}s"; grep "^|" $OUT/prompt_mass_4k.log
export VQ_MEMORY_LIMIT_GB=100
for streams in 1 default; do
  if [ $streams = default ]; then unset VQ_FIT_STREAMS; else export VQ_FIT_STREAMS=$streams; fi
  half=$(( (deadline - SECONDS) / (streams == 1 ? 2 : 1) - 5 ))
  [ $streams = default ] && half=$(( deadline - SECONDS - 5 ))
  timeout $half python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --methods "mlx-lm KVCache" palu svdq gear kvtc --steps 2 --rounds 1 --prefill-repeats 2 --budget-s $(( half - 60 )) \
    --out $OUT/fit_streams_$streams.json > $OUT/fit_streams_$streams.log 2>&1
  echo "VQ_FIT_STREAMS=$streams rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/fit_streams_$streams.log | cut -d'|' -f3,6-10 | head -n 8
  grep -B2 -A4 Traceback $OUT/fit_streams_$streams.log | tail -n 8
done
true
