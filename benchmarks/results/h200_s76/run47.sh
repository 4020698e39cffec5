#!/bin/bash
# Session 76: h2o's prefill peak and warm time against the prompt-mass kernels' block size.
# run45 found the peak set by the kernels: at 2^25 logits a block (the default) h2o's 4k
# prefill peaks at 12,677 MiB above the weights against 4,058 with MLX's ops at 2^23
# (VQ_MASS_KERNEL=0), in chunk 2. Here the kernels at 2^23, 2^24 and 2^25 a block, and MLX's
# ops, each in its own process beside its own KVCache (attention.KERNEL_SCORE_ELEMENTS set
# before decode.py runs). After the c1 and c2 calls, carry [".device/c3"]; ends within
# CALL_S (default 420) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=70
deadline=${CALL_S:-420}
n=0
for e in ${EXPONENTS:-23 24 25 ops}; do
  left=$(( deadline - SECONDS - 10 )); [ $left -lt 60 ] && { echo "2^$e: no time left"; continue; }
  [ $left -gt ${PER_S:-110} ] && left=${PER_S:-110}
  if [ $e = ops ]; then export VQ_MASS_KERNEL=0; x=23; else unset VQ_MASS_KERNEL; x=$e; fi
  timeout $left python3 -c "
import runpy, sys
import veloxquant_mlx.evict.attention as a
a.KERNEL_SCORE_ELEMENTS = 2**$x
sys.argv = ['decode.py', '--preset', 'llama3-8b', '--contexts', '${CONTEXT:-4096}', '--methods', 'mlx-lm KVCache', 'h2o 2048',
            '--steps', '2', '--rounds', '1', '--prefill-repeats', '3', '--out', '$OUT/h2o_block_${CONTEXT:-4096}_$e.json']
runpy.run_path('benchmarks/decode.py', run_name='__main__')" > $OUT/h2o_block_${CONTEXT:-4096}_$e.log 2>&1
  echo "blocks $e rc=$? after ${SECONDS}s"
  grep -E "^\| ${CONTEXT:-4096}" $OUT/h2o_block_${CONTEXT:-4096}_$e.log | cut -d'|' -f3,6,7,9,10
done
true
