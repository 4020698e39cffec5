#!/bin/bash
# Session 67, for the next device (issue 30): after the c1 and c2 calls, carry [".device/c3"].
# 1. ncu: the kernels of palu's steady decode step at 4k beside KVCache's (2 layers of the 8B
#    shape): where its 27 ms a token go (results/h200_s67: 0.21x, KVCache's device 5.05 ms);
# 2. the stores not yet given a CUDA read, their own read (0) against the probe's dense read
#    (1, benchmarks/dense_read.py), to choose the next reads: SPECS as in run17.sh;
# 3. kitty at lo 1 / hi 8 bits on CUDA (5321f4c's fix of the 10-axis gather), one test file.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
timeout 200 python3 benchmarks/decode_kernels.py --out-dir /tmp/kernels --timeout 180 --layers 2 --context 4096 \
  --warm 36 --steps 4 --methods "mlx-lm KVCache" palu > $OUT/decode_kernels_palu_4k.log 2>&1
python3 benchmarks/decode_kernels.py --report /tmp/kernels --top 12 >> $OUT/decode_kernels_palu_4k.log 2>&1
tail -n 16 $OUT/decode_kernels_palu_4k.log
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 120 python3 -m pytest -q -p no:cacheprovider --no-header \
  tests/test_kitty_decode_read.py -k "1-8" > $OUT/kitty_1_8_cuda.log 2>&1; tail -3 $OUT/kitty_1_8_cuda.log
[ $SECONDS -lt 300 ] && SPECS=${SPECS:-"0:age_tiered anchorkv a2ats:130,1:age_tiered anchorkv a2ats:130"} \
  timeout $((590 - SECONDS)) bash benchmarks/results/h200_s63/run17.sh
