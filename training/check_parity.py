"""Check that MLX (mlx-lm ``llama``) reproduces the PyTorch model's logits.

The training script writes parity.safetensors next to the exported weights: a
fixed prompt (1024 tokens) and the float32 logits that the PyTorch model
computes from the exported float16 weights. This script loads the folder with
``mlx_lm.load`` on the CPU, runs the same input, and compares::

    python training/check_parity.py runs/ref            # after training
    python training/check_parity.py veloxquant/assets/reference_model --parity runs/ref/parity.safetensors

Exit status 1 when the max abs difference exceeds --tol (float16 compute) or
--tol/5 (float32 compute) times the largest |logit|, or the argmax agreement
is under 99%. (The reference logits come from the GPU in float32 with TF32
matmuls, about 1e-3 relative error: float32 MLX cannot match them exactly.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument(
        "--parity", default=None, help="default: MODEL_DIR/parity.safetensors"
    )
    ap.add_argument("--tol", type=float, default=0.01)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    ref = mx.load(args.parity or str(Path(args.model_dir) / "parity.safetensors"))
    ids = np.array(ref["input_ids"]).astype(np.int32)
    want = np.array(ref["logits"]).astype(np.float32)
    model, tok = load(args.model_dir)
    got = {}
    for dt in ("float16", "float32"):
        if dt == "float32":
            model.set_dtype(mx.float32)
        # the file may hold the last positions' logits only
        got[dt] = np.array(model(mx.array(ids)).astype(mx.float32))[:, -want.shape[1]:]
    scale = float(np.abs(want).max())
    ok = True
    for dt, g in got.items():
        diff = np.abs(g - want)
        agree = float((g.argmax(-1) == want.argmax(-1)).mean())
        print(
            f"MLX {dt} vs PyTorch float32: max|diff| {diff.max():.4f} mean|diff| {diff.mean():.5f} "
            f"(max|logit| {scale:.2f}, logit std {want.std():.3f}); argmax agreement {agree:.4f}"
        )
        tol = args.tol if dt == "float16" else args.tol / 5
        ok &= diff.max() <= tol * scale and agree >= 0.99
    # mlx-lm's tokenizer encodes as the training script did: <bos> + its ids
    from tokenizers import Tokenizer

    text = "The special magic number for pale-falcon is: 6240632."
    trained = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
    assert tok.encode(text) == trained.encode(text).ids, "mlx-lm encodes differently"
    assert trained.encode(text).ids[0] == trained.token_to_id("<bos>"), "no <bos> in front"
    if trained.get_vocab_size() <= 264:  # the byte model: one token per byte
        assert tok.encode(text) == [256] + list(text.encode()), "not <bos> + bytes"
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
