"""cachegen on the reference model: why anchor/delta coding loses to plain coding there.

Prefills 1,024 tokens of the held-out text and reports, per codec variant, the resident
and saved (entropy-coded) bytes per token and the relative MSE of keys and values
against the full cache; the per-token delta step (the card's step 3) is patched in for
the comparison. Run: .venv/bin/python benchmarks/cachegen_delta.py (notes:
benchmarks/notes/cachegen_delta.md)."""
import veloxquant_mlx, sys
from veloxquant_mlx import REFERENCE_MODEL, KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import CacheGenOptions
import veloxquant_mlx.methods.cachegen.delta as D
import mlx.core as mx, mlx_lm
model, tok = mlx_lm.load(str(REFERENCE_MODEL)); model.set_dtype(mx.float32)
text = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()
ids = mx.array(tok.encode(text)[:1024])
full = make_prompt_cache(model, KVCacheConfig(method="full")); model(ids[None], cache=full)
def per_token_deltas(deltas, anchor_scales, bits, group):
    m = D.qmax(bits); b, h, ng, gt, d = deltas.shape
    g = deltas.reshape(b, h, ng, gt, d // group, group)
    s = mx.maximum(mx.abs(g).max(axis=5) / m, D._MIN_SCALE).astype(mx.float16)
    q = mx.clip(mx.round(g / s.astype(mx.float32)[..., None]), -m, m) + m
    return q.reshape(b, h, ng * gt, d).astype(mx.uint32), s.reshape(b, h, ng * gt, -1)
orig_rec = D.reconstruct
def rec(codec, codes, scales, anchor_codes=None, anchor_scales=None):
    if anchor_codes is None or scales.shape[2] == anchor_codes.shape[2]:
        return orig_rec(codec, codes, scales, anchor_codes, anchor_scales)
    codes = D.unpack_codes(codes, codec.bits); b, h, n, d = codes.shape
    x = D.dequantize_symmetric(codes, scales, codec.bits).reshape(b, h, n // codec.group, codec.group, d)
    anchor = D.dequantize_symmetric(D.unpack_codes(anchor_codes, D.ANCHOR_BITS), anchor_scales, D.ANCHOR_BITS)
    return (x + anchor[:, :, :, None]).reshape(b, h, n, d)
for gap in (1, 10, 32):
    ratio = []
    for lf in full:
        for x in (lf.keys.view(), lf.values.view()):
            d = x[..., gap:, :] - x[..., :-gap, :]
            ratio.append(float((d**2).mean() / (x**2).mean()))
    print(f"tokens {gap} apart: delta energy / plain energy, K {sum(ratio[0::2]) / 4:.2f} V {sum(ratio[1::2]) / 4:.2f}")
for name, delta, patch in (("no delta", False, False), ("delta, shared step (current)", True, False), ("delta, per-token step (card)", True, True)):
    if patch: D.quantize_deltas, D.reconstruct = per_token_deltas, rec
    c = make_prompt_cache(model, KVCacheConfig(method="cachegen", options=CacheGenOptions(cachegen_use_delta=delta)))
    model(ids[None], cache=c)
    errs = []
    for lc, lf in zip(c, full):
        kh, vh = lc.dequantized(mx.float32) if hasattr(lc, "dequantized") else (None, None)
        k, v = lf.keys.view(), lf.values.view()
        n = 1024 // 32 * 32
        errs.append((float(((kh[..., :n, :] - k[..., :n, :]) ** 2).mean() / (k[..., :n, :] ** 2).mean()), float(((vh[..., :n, :] - v[..., :n, :]) ** 2).mean() / (v[..., :n, :] ** 2).mean())))
    ek = sum(e[0] for e in errs) / len(errs); ev = sum(e[1] for e in errs) / len(errs)
    print(f"{name}: resident {sum(x.nbytes for x in c)/1024:.0f} B/tok, saved {sum(x.stored_nbytes for x in c)/1024:.0f} B/tok, rel MSE K {ek:.4f} V {ev:.4f}")
