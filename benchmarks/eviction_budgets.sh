#!/bin/bash
# Retrieval of every eviction method at two budgets on the reference model at 4k context
# (the quick workload: needle, multi-key needle, key-value lookup), over several seeds.
# Usage: bash benchmarks/eviction_budgets.sh OUT_DIR [BUDGETS] [SEEDS]
#   e.g. bash benchmarks/eviction_budgets.sh /tmp/eb "256 1024" "0 1"
set -u
out=${1:?out dir}; budgets=${2:-"256 1024"}; seeds=${3:-"0 1"}
methods=snapkv,streaming_llm,knorm,tova,h2o,pyramidkv,squeeze,chunkkv,keyformer,qfilters,curdkv,morphkv,nestedkv,cam,rocketkv,kvzip
for b in $budgets; do
  sets=()
  for f in snap pyramid squeeze chunkkv keyformer qfilters curdkv knorm tova h2o morphkv nestedkv cam kvzip; do
    sets+=(--set "${f}_budget=$b")
  done
  sets+=(--set "stream_window_size=$((b - 4))" --set "rocketkv_compression_ratio=$((4096 / b)).0")
  for s in $seeds; do
    echo "== budget $b seed $s"
    python3 -m veloxquant_mlx.cli bench --quick --context 4096 --seed "$s" --methods "$methods" \
      "${sets[@]}" --out "$out/b$b-s$s" 2>&1 | tail -3
  done
done
