#!/bin/bash
# Session 79: two A/Bs in one call, each arm a process of run42's harness (decode.py, the
# whole 8B shape at 4k, beside mlx-lm's KVCache in its own process). After the c1 and c2 calls,
# carry [".device/c3"]. Everything under $OUT goes into one archive (the run tool brings back
# at most 8 files).
# 1. palu (rank 209 at its defaults on this random-weight model: width 256) with its fused
#    latent attention at width 256, which MLX 0.32's CUDA SDPA does not fuse (sdpa_vector takes
#    64, 96 and 128; cuDNN at most 128: palu's step under ncu, run52, has no SDPA kernel), against
#    FUSED_WIDTHS without 256 (the float32 read over the packed latents).
# 2. cam, kvtc and xkv prefill products that cuBLAS runs as TF32 kernels with thread-block
#    clusters (census_prefill_2k under ncu); MLX_ENABLE_TF32=0 makes float32 products plain
#    float32 (no TF32 kernels): their prefill with and without.
A=${A_S:-90}; B=${B_S:-150}
METHODS="palu" TAG=palu_w256 CALL_S=$A bash benchmarks/results/h200_s74/run42.sh
sed -i 's/^FUSED_WIDTHS = (64, 96, 128, 256)/FUSED_WIDTHS = (64, 96, 128)/' veloxquant/lowrank/latent.py
grep -n "^FUSED_WIDTHS" veloxquant/lowrank/latent.py
METHODS="palu" TAG=palu_w128 CALL_S=$A bash benchmarks/results/h200_s74/run42.sh
git checkout -q veloxquant/lowrank/latent.py 2>/dev/null || sed -i 's/^FUSED_WIDTHS = (64, 96, 128)/FUSED_WIDTHS = (64, 96, 128, 256)/' veloxquant/lowrank/latent.py
METHODS="${PREFILL_METHODS:-cam xkv kvtc}" TAG=tf32 CALL_S=$B bash benchmarks/results/h200_s74/run42.sh
MLX_ENABLE_TF32=0 METHODS="${PREFILL_METHODS:-cam xkv kvtc}" TAG=no_tf32 CALL_S=$B bash benchmarks/results/h200_s74/run42.sh
cd $OUT && tar czf /tmp/run57.tgz * && rm -rf ./* && mv /tmp/run57.tgz .
true
