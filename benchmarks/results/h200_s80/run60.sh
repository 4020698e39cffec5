#!/bin/bash
# Session 80 (issue 31): curdkv's leverage on the device (no eigh round trip) and xkv's queued
# fits, as landed, at 4k beside KVCache in one process. After the c1 and c2 calls, carry
# [".device/c3"]. About 3 minutes.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
METHODS="curdkv xkv qfilters" TAG=fits CALL_S=${A_S:-200} bash benchmarks/results/h200_s74/run42.sh
true
