# Issue 34, subword model, stage 2 of 2: 4,096 tokens from stage 1's weights. Here first:
#   mkdir -p training/runs && cp -r <run6's files_at>/stage1 training/runs/stage1
# then carry ["training/data", "training/runs/stage1"]. Afterwards, here:
#   python training/check_parity.py <files_at>/stage2, then the card's baseline:
#   veloxquant bench --leaderboard --model <stage2 folder> --methods full --ratios 0.5 \
#     --context 4096 --examples 5
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python3 training/train.py --corpus training/data/train.txt --out $OUT/stage2 \
  --tokenizer veloxquant/assets/reference_subword/tokenizer.json --mixture ruler \
  --init training/runs/stage1 --time-budget 420 --phases 4096:1.0:32 --lr 4e-4 --warmup 20 \
  --config '{"num_hidden_layers": 6}' --workers 14 --eval-every 90 --ckpt-every 120 \
  --log-every 250 --final-ctx 4096 --final-eval-n 16 > $OUT/subword_stage2_log.txt 2>&1
echo "rc=$?"; grep -E "eval|phase|done|exported" $OUT/subword_stage2_log.txt | tail -30
