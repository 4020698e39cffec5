#!/bin/bash
# Session 77 (issue 30): the graphs a decode step commits once the first cycle is past
# (run46 counted from step 2: turboquant's window growths at steps 2-21 and its first flush
# at 26 fell in the counted steps; on the CPU its 72 steps recur with period 32 after that,
# results/h200_s76/step_structures_defaults.txt). 64 warm steps (decode.py's), then 32
# counted. One process a method, 4 layers of the 8B shape at 4k. After the c1 and c2 calls,
# carry [".device/c3"]; ends within CALL_S (default 560) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-560}
mkdir -p $OUT/graphs
for m in ${METHODS:-mlx-lm_KVCache turboquant palu svdq kivi-4bit}; do
  m=${m//_/ }
  left=$(( deadline - SECONDS - 10 )); [ $left -lt 30 ] && { echo "$m: no time left"; continue; }
  [ $left -gt ${PER_S:-120} ] && left=${PER_S:-120}
  f=$(echo "$m" | tr ' ' '_'); rm -rf /tmp/g && mkdir -p /tmp/g
  MLX_SAVE_CUDA_GRAPHS_DOT_FILE=/tmp/g/cg timeout $left python3 benchmarks/cuda_graph_structures.py \
    --preset llama3-8b --layers 4 --context 4096 --warm 64 --steps 32 --keep 0 --method "$m" \
    --out $OUT/graphs/$f.json > $OUT/graphs/$f.log 2>&1; echo "$m rc=$? after ${SECONDS}s"
  tail -1 $OUT/graphs/$f.log
done
tar czf $OUT/graphs.tgz -C $OUT graphs && rm -rf $OUT/graphs
true
