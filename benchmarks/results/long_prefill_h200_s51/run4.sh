#!/bin/bash
# Session 51, call 4 (H200): the landed code (history blocks for spectral, each prompt chunk's
# attention over a decoded history paced one layer behind): 4 layers of the 8B shape at 128k
# (spectral also at 32k), four processes sharing the GPU (seconds contended), limit 24 GB each.
source benchmarks/install_on_device.sh >/dev/null 2>&1
LP="python3 benchmarks/long_prefill.py --preset llama3-8b --layers 4 --method-timeout-s 150"
export VQ_MEMORY_LIMIT_GB=24
($LP --contexts 32768 131072 --methods spectral kitty --out $OUT/g1.json > $OUT/g1.log 2>&1) &
($LP --contexts 131072 --methods palu adakv amc zipcache --out $OUT/g2.json > $OUT/g2.log 2>&1) &
($LP --contexts 131072 --methods kvtc cachegen gear turboquant --out $OUT/g3.json > $OUT/g3.log 2>&1) &
($LP --contexts 131072 --methods skvq nestedkv anchorkv a2ats age_tiered --out $OUT/g4.json > $OUT/g4.log 2>&1) &
wait
grep -h -A12 "^| context" $OUT/g*.log
