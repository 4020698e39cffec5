source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=120
# the stores newly stacked this session (per-row tables), stacked against per sequence, and
# spectral (per sequence by choice) stacked: 8k prompts, 10 GB of KV, at most 64 sequences
timeout 570 python3 benchmarks/serve_capacity.py --prompt 8192 --kv-gb 10 --max-seqs 64 --steps 4 \
  --prefill-repeats 1 --methods "mlx-lm KVCache" full adakv "adakv, per sequence" a2ats \
  "a2ats, per sequence" palu "palu, per sequence" vecinfer "vecinfer, per sequence" \
  spectral "spectral, stacked" \
  --out $OUT/serve_capacity-llama3-8b-8k.md > $OUT/serve_8k.log 2>&1
grep "^{" $OUT/serve_8k.log | cut -c1-220; tail -5 $OUT/serve_8k.log
