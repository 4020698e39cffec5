import pathlib
REPO = pathlib.Path(__file__).resolve().parents[2]
import veloxquant_mlx
from veloxquant_mlx.bench import ruler
from tokenizers import Tokenizer
t = Tokenizer.from_file(str(REPO / "veloxquant/assets/reference_subword/tokenizer.json"))
count = lambda s: len(t.encode(s).ids)  # the leaderboard's count (tokenizer.encode, <bos> included)
for ctx in (256, 512, 1024, 2048, 4096, 8192):
    for task in ("cwe", "qa", "vt"):
        try:
            e = ruler.make_ruler_example(task, ctx, 0, 0, count)
        except ValueError as ex:
            print(ctx, task, ex); continue
        p = e.prompt
        extra = ""
        if task == "cwe":
            items = p.split("\n\n")[1].split(" ")
            words = [w for w in items if not w.endswith(".")]
            from collections import Counter
            c = Counter(words)
            extra = f"items {len(words)} distinct {len(c)} common-freq {e.meta['freq_common']} rare-freq {e.meta['freq_rare']} top counts {sorted(c.values(), reverse=True)[:12]}"
            tw = [count(w)-1 for w in e.answers]
            extra += f" answer word tokens {tw}"
        if task == "qa":
            extra = str(e.meta)
        if task == "vt":
            extra = f"needle tokens {sum(count(s)-1 for s in ['VAR ABCDE = 12345. ']*2 + ['VAR ABCDE = VAR FGHIJ. ']*8)}"
        print(ctx, task, "n_tokens", e.n_tokens, extra)
