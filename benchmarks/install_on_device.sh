#!/bin/bash
# Install MLX's CUDA build and mlx-lm into /tmp/site on the device, once per warm machine,
# and put the working tree on the path as veloxquant_mlx (shim/). The CUDA wheel travels in
# three pieces of 30 MB (the working tree and a call's carry share 64 MiB): calls 1 and 2
# carry .device/c1 and .device/c2 and copy them to /tmp/p; the call that sources this
# carries .device/c3. Each process keeps at most 2 GB of freed buffers and 12 GB in all,
# so several share one GPU (14 processes without limits ran out of GPU memory and then hit
# illegal accesses). veloxquant_mlx is imported first in every process, so that MLX's CPU
# back-end (the CPU stream's linear algebra in fits) uses the system OpenBLAS.
# Usage: source benchmarks/install_on_device.sh
# The run tool brings back at most 8 files of $OUT (session 79 lost a JSON and two ncu CSVs to
# that): a script that sources this and leaves more gets them as one archive when it exits
# (out_<its pid>.tgz; earlier archives are kept beside it, not packed again).
archive_out() {
  [ -d "${OUT:-}" ] || return 0
  [ "$(find "$OUT" -type f | wc -l)" -le 8 ] && return 0
  local name="out_$$.tgz"
  (cd "$OUT" && tar czf "/tmp/$name" --exclude='./out_*.tgz' . &&
    find . -type f ! -name 'out_*.tgz' -delete && find . -mindepth 1 -type d -empty -delete &&
    mv "/tmp/$name" .)
}
trap archive_out EXIT
if [ ! -d /tmp/site/mlx ]; then
  wheel=/tmp/$(cat /tmp/p/cuda-wheel-name)
  cat /tmp/p/whole.part.00 /tmp/p/whole.part.01 .device/c3/whole.part.02 > "$wheel" &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/p/mlx-*.whl \
      "$wheel" /tmp/p/mlx_lm-*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD/shim PYTHONUNBUFFERED=1
rm -rf shim && mkdir -p shim && cp -r veloxquant shim/veloxquant_mlx &&
  cp -r generated shim/veloxquant_mlx/_generated
cat > shim/sitecustomize.py <<'PY'
try:
    # veloxquant_mlx first: it loads the system OpenBLAS before MLX binds its CPU back-end to
    # the reference BLAS (veloxquant/_blas.py); importing mlx here first left every CPU-stream
    # eigh/svd/qr of the device's runs on the reference BLAS (a SlowBLASWarning said so)
    import veloxquant_mlx  # noqa: F401
except ImportError:
    pass
try:
    import mlx.core as mx
    mx.set_cache_limit(2 << 30)
    mx.set_memory_limit(int(__import__("os").environ.get("VQ_MEMORY_LIMIT_GB", "12")) << 30)
except ImportError:
    pass
PY
python3 -c "import veloxquant_mlx, mlx.core as mx; print(mx.default_device(), mx.__version__)"
