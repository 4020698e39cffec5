source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
python3 benchmarks/masked_sdpa.py --batch 9 --context 32768 2>&1 | tee $OUT/masked_sdpa.log
for b in 29 8; do
  ncu --kernel-name regex:vq_kivi_decode_frag --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis \
    python3 benchmarks/check_kivi_rows.py --launch-only --batch $b > $OUT/ncu_rows_batch$b.log 2>&1
  grep -E "Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Warp Cycles|Waves Per SM|Grid Size|Issued Warp" $OUT/ncu_rows_batch$b.log | head -40
done
