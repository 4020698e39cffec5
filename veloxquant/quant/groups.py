"""Group sizes of codecs that take any divisor of head_dim (not only mx.quantize's 32/64/128).

``QuantizedCache`` refuses a group that does not divide head_dim and names the divisors
``mx.quantize`` takes; a codec of its own arithmetic (codebooks, token groups by hand)
takes every divisor, so its cache refuses with this check first and names them all.
"""

from __future__ import annotations


def check_divides(field: str, group: int, d_k: int, d_v: int) -> None:
    if d_k % group or d_v % group:
        allowed = [g for g in range(1, min(d_k, d_v) + 1) if d_k % g == 0 and d_v % g == 0]
        raise ValueError(f"{field}={group} must divide head_dim={d_k} (values: {d_v}); "
                         f"allowed here: {allowed}")
