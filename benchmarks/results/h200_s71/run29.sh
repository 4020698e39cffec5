#!/bin/bash
# Session 71: composed storage's read on CUDA (QuantizedSlots._attend_rows: the slots' rows
# decoded in the model's dtype, the ring's tokens from the ring, one fused attention) against
# the float32 read (h2o: its weights from one more product), in one process (benchmarks/read_ab.py --switch composed-rows). First the
# store's tests on the GPU. After the c1 and c2 calls, carry [".device/c3"]; about 500 s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 120 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_quantized_slots_decode_read.py > $OUT/quantized_slots_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/quantized_slots_cuda.log | cut -c1-300 | head -12
composed=("snapkv 2048 + kivi-4bit" "tova 2048 + kivi-4bit" "h2o 2048 + kivi-2bit")
timeout $(( 330 - SECONDS )) python3 benchmarks/read_ab.py --switch composed-rows --preset llama3-8b --context 4096 \
  --methods "${composed[@]}" --steps 16 --rounds 6 > $OUT/composed_4k.log 2>&1
echo "4k rc=$? after ${SECONDS}s"; tail -7 $OUT/composed_4k.log
timeout $(( 585 - SECONDS )) python3 benchmarks/read_ab.py --switch composed-rows --preset llama3-8b --context 32768 \
  --methods "${composed[@]}" --steps 16 --rounds 4 > $OUT/composed_32k.log 2>&1
echo "32k rc=$? after ${SECONDS}s"; tail -6 $OUT/composed_32k.log
true
