source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
python3 benchmarks/masked_sdpa.py --batch 9 --context 32768 2>&1 | tee $OUT/masked_sdpa_run4_b9_32k.log
python3 benchmarks/masked_sdpa.py --batch 64 --context 4096 2>&1 | tee $OUT/masked_sdpa_run4_b64_4k.log
