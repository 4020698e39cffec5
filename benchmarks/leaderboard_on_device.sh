#!/bin/bash
# The full leaderboard on the device's GPU (issue 34): every method at every ratio and
# task, --jobs processes sharing the GPU (benchmarks/install_on_device.sh says which calls
# come before this one). Parts finished by an earlier call (carried back in the working
# tree) are reused, so a second call resumes. What it leaves comes back as one archive in $OUT.
# Usage: bash benchmarks/leaderboard_on_device.sh SECONDS JOBS EXAMPLES OUTDIR
# (METHODS=a,b: those methods only; EXTRA="--question-after": more bench arguments)
set -o pipefail
seconds=$1 jobs=$2 examples=$3 out=$4
source benchmarks/install_on_device.sh || exit 1
# slowest prefills first, so the last processes do not start the longest parts
methods=kvzip,h2o,keyformer,palu,gear,cachegen,xkv,amc,kvtc,qfilters,cam,anchorkv,skvq
methods+=,a2ats,nestedkv,spectral,age_tiered,adakv,minicache,svdq,kvquant,zipcache,vecinfer
methods+=,kitty,xquant,nsnquant,rocketkv,turboquant,morphkv,squeeze,curdkv,tova,pyramidkv
methods+=,snapkv,chunkkv,knorm,streaming_llm,kivi
methods=${METHODS:-$methods}
timeout "$seconds" python3 -c "import sys; from veloxquant_mlx.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --leaderboard --model reference-subword --methods "$methods" --context 4096 \
  --examples "$examples" --jobs "$jobs" --force --out "$out" ${EXTRA:-}
echo "leaderboard exit $?"
tar czf "$OUT/leaderboard.tgz" "$out"
ls -la "$OUT"
