#!/bin/bash
# Session 80 (issues 30, 31): curdkv's leverage on the device (no eigh round trip), xkv's
# queued fits, qfilters' checks read once a prompt, anchorkv's count not read and squeeze's
# evictions every 32 steps, as landed, at 4k beside KVCache in one process. After the c1 and
# c2 calls, carry [".device/c3"]. About 4 minutes.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
METHODS="curdkv xkv qfilters anchorkv squeeze" TAG=fits CALL_S=${A_S:-260} bash benchmarks/results/h200_s74/run42.sh
true
