"""Channel-separable token-wise quantization: a per-channel scale, then per-token groups.

Keys and values have outlier channels; a per-token group (along head_dim) that holds
one spends its levels on it. Dividing every channel by a scale ``c_j`` first
(ZipCache's ``c_j = sqrt(max_t |x_tj|)``, kept per layer and KV head) flattens the
outliers, so that the rows ``x / c`` quantize well token by token (``token_rows.TokenGroups``);
the reconstruction is ``c * x_hat``, and decode reads the packed rows with the scale
folded into the query and the output (``token_rows.TokenRows(layout, c)``). A token is
quantized alone, so tokens of any subset (a precision class) can be stored in any
order, and appended one by one.
"""

from __future__ import annotations

import mlx.core as mx

SCALE_FLOOR = 1e-3  # a channel's max |x| is floored at this fraction of the head's largest


def channel_scale(x: mx.array) -> mx.array:
    """``sqrt(max_t |x_tj|)`` per (batch, head, channel) of ``x`` (B, H, n, D), float32.

    A channel that is (nearly) zero over the block would get a scale near 0 and blow up
    later rows: its max is floored at ``SCALE_FLOOR`` times the head's largest (1 for an
    all-zero head)."""
    peak = mx.abs(x.astype(mx.float32)).max(axis=2)  # (B, H, D)
    top = peak.max(axis=-1, keepdims=True)
    floor = mx.where(top > 0, top * SCALE_FLOOR, 1.0)
    return mx.sqrt(mx.maximum(peak, floor))
