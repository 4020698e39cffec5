source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# kvquant stacked against per sequence; a2ats again over 12 timed steps (run 1: stacked 0.53x
# per sequence over 4); vecinfer stacked at 16 sequences (run 1: out of memory at 63)
timeout 380 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 10 --max-seqs 64 --steps 12 \
  --prefill-repeats 1 --methods full a2ats "a2ats, per sequence" kvquant "kvquant, per sequence" \
  --out $OUT/serve_capacity-llama3-8b-8k-run2.md > $OUT/serve_8k_run2.log 2>&1
grep "^{" $OUT/serve_8k_run2.log | cut -c1-220; tail -3 $OUT/serve_8k_run2.log
timeout 190 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 10 --max-seqs 16 --steps 4 \
  --prefill-repeats 1 --methods full vecinfer "vecinfer, per sequence" \
  --out $OUT/serve_capacity-llama3-8b-8k-vecinfer16.md > $OUT/serve_8k_vecinfer16.log 2>&1
grep "^{" $OUT/serve_8k_vecinfer16.log | cut -c1-220; grep -A3 Traceback $OUT/serve_8k_vecinfer16.log | tail -3
