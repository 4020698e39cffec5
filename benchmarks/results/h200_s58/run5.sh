# the leaderboard's missing vecinfer rows and spectral's rows with its kv_bits search
# (notes/leaderboard_subword.md), the same prompts, seed and full-cache bytes as
# results/leaderboard_subword_4k_all; then, here:
#   python benchmarks/leaderboard_replace_rows.py benchmarks/results/leaderboard_subword_4k_all \
#     lb_s58/parts/vecinfer lb_s58/parts/spectral
METHODS=vecinfer,spectral bash benchmarks/leaderboard_on_device.sh 540 2 5 lb_s58
