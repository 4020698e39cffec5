"""VeloxQuant's warning classes (exported from ``veloxquant_mlx``).

Filter all of them with ``VeloxQuantWarning``. They are ``UserWarning``s, so Python shows
them by default. ``VeloxQuantDeprecationWarning`` (``veloxquant_mlx.cache``) stays a
``DeprecationWarning``.
"""


class VeloxQuantWarning(UserWarning):
    """Base class of VeloxQuant's warnings."""


class UnimplementedMethodWarning(VeloxQuantWarning):
    """A config names a method that has no implementation yet: it validates and
    serialises, but no cache can be built from it."""


class UnreadFieldWarning(VeloxQuantWarning):
    """A config field was given that the config's method does not read: it has no effect
    (``veloxquant generate --set`` refuses such a field)."""


class SlowBLASWarning(VeloxQuantWarning):
    """MLX's CPU back-end is left on the reference BLAS (matrix products ~30x slower)."""
