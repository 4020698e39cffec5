#!/bin/bash
# Session 69 (issue 31): kvtc's prompt fit over the components that can get bits (the k = 256
# leading of 1,024 by subspace iteration, the DP over them) against the exact fit
# (VQ_KVTC_EXACT=1: fit_codec's exact path, the DP as landed). After the c1 and c2 calls,
# carry [".device/c3"]. Warm prefill of 4,096 tokens, 8B shape, each in its own process
# beside its own KVCache; about 250 s.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
printf 'import os\nif os.environ.get("VQ_KVTC_EXACT") == "1":\n    import veloxquant_mlx.methods.kvtc.transform as _t\n    _fit = _t.fit_codec\n    _t.fit_codec = lambda x, budget, choices, beta, exact=False: _fit(x, budget, choices, beta, True)\n' >> shim/sitecustomize.py
for exact in 1 0; do
  [ $SECONDS -gt 400 ] && break
  VQ_KVTC_EXACT=$exact timeout $((590 - SECONDS)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 8 --rounds 1 --prefill-repeats 2 --budget-s 120 \
    --methods "mlx-lm KVCache" kvtc --out $OUT/prefill_4k_kvtc_exact$exact.json > $OUT/prefill_4k_kvtc_exact$exact.log 2>&1
  echo "VQ_KVTC_EXACT=$exact"; grep "^| 4096" $OUT/prefill_4k_kvtc_exact$exact.log | cut -c1-300
  grep -A3 Traceback $OUT/prefill_4k_kvtc_exact$exact.log | tail -4
done
true
