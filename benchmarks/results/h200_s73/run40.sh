#!/bin/bash
# Session 73's last device call, a cut run37.sh (after the c1 and c2 calls, carry [".device/c3"]),
# ends within CALL_S (default 470) s: benchmarks/device_fit.py first (a layer's two kvtc fits,
# CPU streams against the GPU, the errors first), then warm prefill of kvtc at 4k,
# VQ_DEVICE_FIT=0 against the default, then the fits' tests on the GPU as time allows.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/pytest-*.whl .device/c3/pluggy-*.whl \
  .device/c3/iniconfig-*.whl .device/c3/pygments-*.whl .device/c3/packaging-*.whl 2>/dev/null
deadline=${CALL_S:-470}
timeout 90 python3 benchmarks/device_fit.py --repeats 5 > $OUT/device_fit.log 2>&1
echo "device_fit rc=$? after ${SECONDS}s"; grep -E "^\||^device" $OUT/device_fit.log; tail -n 3 $OUT/device_fit.log | grep -i error
export VQ_MEMORY_LIMIT_GB=100
for v in 0 1; do
  left=$(( (deadline - SECONDS - 60) / (v == 0 ? 2 : 1) )); [ $left -gt 130 ] && left=130
  [ $left -lt 70 ] && break
  VQ_DEVICE_FIT=$v timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --methods "mlx-lm KVCache" kvtc --steps 2 --rounds 1 --prefill-repeats 2 --budget-s $(( left - 30 )) \
    --out $OUT/prefill_kvtc_$v.json > $OUT/prefill_kvtc_$v.log 2>&1
  echo "VQ_DEVICE_FIT=$v rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/prefill_kvtc_$v.log | cut -d'|' -f3,6-10 | head -n 4
  grep -B2 -A4 Traceback $OUT/prefill_kvtc_$v.log | tail -n 6
done
left=$(( deadline - SECONDS - 5 ))
[ $left -gt 30 ] && MLX_DEFAULT_DEVICE=gpu timeout $left python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_device_fit.py tests/test_kvtc.py > $OUT/fit_tests_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/fit_tests_cuda.log | cut -c1-300 | head -8
true
