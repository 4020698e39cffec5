#!/bin/bash
# Session 76 (issue 30): which CUDA graphs the device-bound quantizers' decode steps commit
# and how many no earlier step had (a new structure is instantiated, a millisecond-scale
# cost: notes/cuda_graphs.md). Session 61's run11 part 2, never run. One process a method,
# 4 layers of the 8B shape at 4k, 40 decode steps each, each step evaluated alone. After the
# c1 and c2 calls, carry [".device/c3"]; ends within CALL_S (default 400) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-400}
mkdir -p $OUT/graphs
for m in ${METHODS:-mlx-lm_KVCache palu svdq gear cachegen kivi-4bit kvtc turboquant}; do
  m=${m//_/ }
  left=$(( deadline - SECONDS - 10 )); [ $left -lt 30 ] && { echo "$m: no time left"; continue; }
  [ $left -gt 90 ] && left=90
  f=$(echo "$m" | tr ' ' '_'); rm -rf /tmp/g && mkdir -p /tmp/g
  MLX_SAVE_CUDA_GRAPHS_DOT_FILE=/tmp/g/cg timeout $left python3 benchmarks/cuda_graph_structures.py \
    --preset llama3-8b --layers 4 --context 4096 --steps 40 --keep 3 --method "$m" \
    --out $OUT/graphs/$f.json > $OUT/graphs/$f.log 2>&1; echo "$m rc=$? after ${SECONDS}s"
  tail -1 $OUT/graphs/$f.log; grep "^step" $OUT/graphs/$f.log | tail -n 3 | tr '\n' ';'; echo
done
tar czf $OUT/graphs.tgz -C $OUT graphs && rm -rf $OUT/graphs
true
