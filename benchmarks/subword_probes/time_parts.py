"""CPU cost of one training example from train.ruler_parts (subword tokenizer), per task and size."""
import pathlib
REPO = pathlib.Path(__file__).resolve().parents[2]
import sys, time, random
from unittest import mock
for m in ("torch", "torch.nn", "torch.nn.functional", "torch.utils", "torch.utils.data"):
    sys.modules[m] = mock.MagicMock()
sys.path.insert(0, str(REPO / "training"))
import train as T
tok = T.Tok(str(REPO / "veloxquant/assets/reference_subword/tokenizer.json"))
corpus = T.tasks.load_default_filler() * 32
rng = random.Random(0)
for size in (257, 513, 1025):
    for task in ("qa", "cwe", "vt", "niah_multikey"):
        if task == "vt" and size < 400: continue
        t0 = time.perf_counter(); n = 30
        for _ in range(n): T.ruler_parts(task, rng, size, corpus, tok)
        print(f"size {size} {task:14s} {1000*(time.perf_counter()-t0)/n:6.1f} ms/example")
    t0 = time.perf_counter()
    for _ in range(30): T.copy_sequence(rng, size - 1, tok)
    print(f"size {size} copy_sequence  {1000*(time.perf_counter()-t0)/30:6.1f} ms")
