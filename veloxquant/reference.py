"""Where the embedded reference model lives (loadable offline with
``mlx_lm.load(str(REFERENCE_MODEL))``)."""

from pathlib import Path

REFERENCE_MODEL = Path(__file__).resolve().parent / "assets" / "reference_model"
