"""Where the embedded reference models live (each loadable offline with
``mlx_lm.load(str(folder))``): ``REFERENCE_MODEL``, byte-level (the bench's default), and
``REFERENCE_SUBWORD_MODEL``, with subword tokens (the leaderboard's)."""

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent / "assets"
REFERENCE_MODEL = _ASSETS / "reference_model"
REFERENCE_SUBWORD_MODEL = _ASSETS / "reference_subword"
#: the names ``--model`` takes for them
EMBEDDED_MODELS = {"reference": REFERENCE_MODEL, "reference-subword": REFERENCE_SUBWORD_MODEL}
