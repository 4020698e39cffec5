#!/bin/bash
# Session 79 (issue 30): graphs on against graphs off for the quantizers whose steps gained
# most from MLX_USE_CUDA_GRAPHS=0 in session 57 (cachegen 3.1x, palu 2.3x, svdq 2.1x), on
# this tree (windows kept across flushes since 3c35ecc, spectral's QJL sum since 85d17ba).
# Two processes of run42's harness (decode.py, the whole 8B shape at 4k, overlapped, each
# method beside mlx-lm's KVCache in its own process). After the c1 and c2 calls, carry
# [".device/c3"]. Each arm gets CALL_S / 2 seconds (default 560).
half=$(( ${CALL_S:-560} / 2 ))
export METHODS="${METHODS:-palu svdq cachegen gear}"
CALL_S=$half TAG=graphs_on bash benchmarks/results/h200_s74/run42.sh
MLX_USE_CUDA_GRAPHS=0 CALL_S=$half TAG=graphs_off bash benchmarks/results/h200_s74/run42.sh
true
