"""A custom kernel's name, made from its text.

MLX's CUDA back-end keeps a compiled custom kernel under its name and template arguments
only: in memory for the process, and on disk across processes (``MLX_PTX_CACHE_DIR``, by
default under the temp directory). A kernel whose source changed under an unchanged name
would run the code compiled from the old source: after an upgrade of this package, or
between two sources of one name in a process, a stale kernel, possibly with another argument
list. Every kernel of the package is named with a digest of its source and header."""

from __future__ import annotations

import functools
import hashlib


@functools.lru_cache(maxsize=None)
def source_tagged(name: str, *texts: str) -> str:
    """``name`` followed by the first 12 hex digits of the SHA-1 of ``texts`` (source, header)."""
    digest = hashlib.sha1("\0".join(texts).encode()).hexdigest()[:12]
    return f"{name}_{digest}"
