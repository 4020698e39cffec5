#!/bin/bash
# The full leaderboard on the device's GPU (issue 34): every method at every ratio and
# task, --jobs processes sharing the GPU. MLX's CUDA wheel travels in three pieces of 30 MB
# (the working tree and a call's carry share 64 MiB): calls 1 and 2 carry .device/c1 and
# .device/c2 and copy them to /tmp/p; this one carries .device/c3. Parts finished by an earlier call (carried back in the working tree)
# are reused, so a second call resumes. What it leaves comes back as one archive in $OUT.
# Usage: bash benchmarks/leaderboard_on_device.sh SECONDS JOBS EXAMPLES OUTDIR
set -o pipefail
seconds=$1 jobs=$2 examples=$3 out=$4
if [ ! -d /tmp/site/mlx ]; then
  wheel=/tmp/$(cat /tmp/p/cuda-wheel-name)
  cat /tmp/p/whole.part.00 /tmp/p/whole.part.01 .device/c3/whole.part.02 > "$wheel" &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/p/mlx-*.whl \
      "$wheel" /tmp/p/mlx_lm-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/shim PYTHONUNBUFFERED=1
rm -rf shim && mkdir -p shim && cp -r veloxquant shim/veloxquant_mlx &&
  cp -r generated shim/veloxquant_mlx/_generated
# --jobs processes share one GPU: each keeps at most 2 GB of freed buffers and 12 GB in
# all (14 processes without limits ran out of GPU memory and then hit illegal accesses)
cat > shim/sitecustomize.py <<'PY'
try:
    import mlx.core as mx
    mx.set_cache_limit(2 << 30)
    mx.set_memory_limit(12 << 30)
except ImportError:
    pass
PY
python3 -c "import veloxquant_mlx, mlx.core as mx; print(mx.default_device(), mx.__version__)"
# slowest prefills first, so the last processes do not start the longest parts
methods=kvzip,h2o,keyformer,palu,gear,cachegen,xkv,amc,kvtc,qfilters,cam,anchorkv,skvq
methods+=,a2ats,nestedkv,spectral,age_tiered,adakv,minicache,svdq,kvquant,zipcache,vecinfer
methods+=,kitty,xquant,nsnquant,rocketkv,turboquant,morphkv,squeeze,curdkv,tova,pyramidkv
methods+=,snapkv,chunkkv,knorm,streaming_llm,kivi
methods=${METHODS:-$methods}
timeout "$seconds" python3 -c "import sys; from veloxquant_mlx.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --leaderboard --model reference-subword --methods "$methods" --context 4096 \
  --examples "$examples" --jobs "$jobs" --force --out "$out"
echo "leaderboard exit $?"
tar czf "$OUT/leaderboard.tgz" "$out"
ls -la "$OUT"
