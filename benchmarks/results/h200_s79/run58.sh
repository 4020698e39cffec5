#!/bin/bash
# For the next session (issue 31): xkv's groups' fits queued together at the prompt's end
# (xkv_queued_fits.patch, not landed: slower on a 2-core CPU) against the tree, on the
# device's 16-core host. Applies the patch to the device's copy of the tree between the arms.
# After the c1 and c2 calls, carry [".device/c3"]. About 4 minutes.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
METHODS="xkv" TAG=xkv_tree CALL_S=${A_S:-100} bash benchmarks/results/h200_s74/run42.sh
git apply benchmarks/results/h200_s79/xkv_queued_fits.patch 2>/dev/null ||
  patch -p1 < benchmarks/results/h200_s79/xkv_queued_fits.patch || { echo "patch failed"; exit 1; }
rm -rf shim && mkdir -p shim && cp -r veloxquant shim/veloxquant_mlx && cp -r generated shim/veloxquant_mlx/_generated
timeout ${B_S:-150} python3 benchmarks/xkv_prompt_end.py --layers 32 --streams 1 8 --repeats 1 \
  > $OUT/xkv_prompt_end.md 2>&1; cat $OUT/xkv_prompt_end.md
METHODS="xkv" TAG=xkv_queued CALL_S=${A_S:-100} bash benchmarks/results/h200_s74/run42.sh
python3 -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['environment']['variant'] = 'xkv_queued_fits.patch'; json.dump(d, open(p, 'w'), indent=1)" \
  $OUT/every_method_4k_xkv_queued.json  # an arm the tree does not ship: standing.py leaves it out
true
