source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# the calibrated methods' prefill with a file (session 58: palu, svdq, spectral, skvq, kvquant) against their per-prompt fits
# (the CPU stream's eigh: palu 66 ms a layer at 4k against KVCache's 1.4, notes/fits.md), one
# layer of the 8B shape, float16; kvtc's file for comparison
timeout 400 python3 benchmarks/calibrated_prefill.py --dtype float16 --tokens 4096 32768 --repeats 5 \
  --methods kvtc palu svdq spectral skvq kvquant > $OUT/calibrated_prefill.log 2>&1; cat $OUT/calibrated_prefill.log
