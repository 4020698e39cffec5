#!/bin/bash
# Session 73, after the c1 and c2 calls, carry [".device/c3"] (with pytest's wheels);
# ends by itself within CALL_S (default 580) s:
# (1) the GPU's subspace iteration for kvtc's fits (lowrank/factors.device_leading): its tests
#     and kvtc's and the fits' on the GPU (MLX's real TF32 products), then
#     benchmarks/device_fit.py (a layer's two fits: CPU streams against the GPU, errors first);
# (2) whole-model warm prefill at 4k of kvtc, VQ_DEVICE_FIT=0 (the CPU streams' iteration,
#     session 72's way) against the default, each a process beside its own KVCache;
# (3) with the time left: run35's h2o rows (the mass kernels off and on) at 4k.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/pytest-*.whl .device/c3/pluggy-*.whl \
  .device/c3/iniconfig-*.whl .device/c3/pygments-*.whl .device/c3/packaging-*.whl 2>/dev/null
deadline=${CALL_S:-580}
MLX_DEFAULT_DEVICE=gpu timeout 150 python3 -m pytest -q -p no:cacheprovider --no-header -rfE tests/test_device_fit.py tests/test_kvtc.py \
  tests/test_lowrank_fit.py > $OUT/fit_tests_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/fit_tests_cuda.log | cut -c1-300 | head -8
timeout 90 python3 benchmarks/device_fit.py --repeats 7 > $OUT/device_fit.log 2>&1
echo "device_fit rc=$? after ${SECONDS}s"; grep -E "^\||^device" $OUT/device_fit.log
export VQ_MEMORY_LIMIT_GB=100
prefill() {  # name limit env... -- methods...
  local name=$1 limit=$2; shift 2
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout $limit python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods "$@" \
    --steps 2 --rounds 1 --prefill-repeats 2 --budget-s $(( limit - 40 )) \
    --out $OUT/prefill_$name.json > $OUT/prefill_$name.log 2>&1
  echo "$name rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/prefill_$name.log | cut -d'|' -f3,6-10 | head -n 5
  grep -B2 -A4 Traceback $OUT/prefill_$name.log | tail -n 6
}
left=$(( (deadline - SECONDS) / 2 )); [ $left -gt 130 ] && left=130
prefill kvtc_streams $left VQ_DEVICE_FIT=0 -- "mlx-lm KVCache" kvtc
left=$(( deadline - SECONDS )); [ $left -gt 130 ] && left=130
prefill kvtc_device $left VQ_DEVICE_FIT=1 -- "mlx-lm KVCache" kvtc
for v in before after; do
  left=$(( (deadline - SECONDS) / (v == before ? 2 : 1) ))
  [ $left -lt 80 ] && break
  if [ $v = before ]; then prefill h2o_$v $left VQ_MASS_KERNEL=0 -- "mlx-lm KVCache" h2o "h2o 2048 + kivi-2bit"
  else prefill h2o_$v $left VQ_MASS_KERNEL=1 -- "mlx-lm KVCache" h2o "h2o 2048 + kivi-2bit"; fi
done
true
