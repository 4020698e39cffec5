import pathlib
REPO = pathlib.Path(__file__).resolve().parents[2]
import veloxquant_mlx
from tokenizers import Tokenizer
t = Tokenizer.from_file(str(REPO / "veloxquant/assets/reference_subword/tokenizer.json"))
def show(s):
    e = t.encode(s, add_special_tokens=False)
    print(repr(s), len(e.ids), e.tokens)
for s in ["VAR QWERT = 12345.", "VAR ABCDE = VAR FGHIJ.", "they are: RWWWR GDRRR XKZPQ MNBVC", "VAR JUNIP = 45678.",
          "Abel keeps the ledger in Stonegate.", "Juniper Falls", " in Juniper Falls.", "1. forepart 2. word 123. hearkened 1234. testimonies",
          "The special magic number for amber-anchor is: 1234567.",
          "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned the value 12345, they are: "]:
    show(s)
