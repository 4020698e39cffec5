# Issue 34 (session 64): the subword model from scratch on the --mixture ruler stream with
# cwe's order-free targets (benchmarks/notes/subword_baseline.md section 9). The device's own
# torch; no MLX. Carry ["training/data"] (training/build_corpus.py) for stage 1; for stage 2
# also ["training/runs/stage1"] (stage 1's folder from $OUT, copied here).
#   STAGE=1 TRAIN_S=480 bash benchmarks/results/h200_s64/run18.sh   # 256, 512, 1,024 tokens
#   STAGE=2 TRAIN_S=420 bash benchmarks/results/h200_s64/run18.sh   # 4,096, from stage 1
# The phases and settings are results/h200_s58's run6.sh and run7.sh; TRAIN_S shortens them
# when less device time is left, PHASES (stage 1) moves time between them.
STAGE=${STAGE:-1}
nvidia-smi --query-gpu=name --format=csv,noheader
common=(--corpus training/data/train.txt --tokenizer veloxquant/assets/reference_subword/tokenizer.json
        --mixture ruler --config '{"num_hidden_layers": 6}' --workers 14 --ckpt-every 120 --log-every 250)
if [ "$STAGE" = 1 ]; then
  timeout $((${TRAIN_S:-480} + 90)) python3 training/train.py "${common[@]}" --out $OUT/stage1 \
    --time-budget ${TRAIN_S:-480} --phases ${PHASES:-256:0.3:512,512:0.35:256,1024:0.35:128} \
    --eval-every 60 --final-ctx 512,1024 --final-eval-n 16 > $OUT/stage1_log.txt 2>&1
  echo "rc=$?"; grep -E "eval|phase|done|exported" $OUT/stage1_log.txt | tail -14 | cut -c1-260
  mkdir -p training/runs && rm -rf training/runs/stage1 && cp -r $OUT/stage1 training/runs/stage1
else
  timeout $((${TRAIN_S:-420} + 90)) python3 training/train.py "${common[@]}" --out $OUT/stage2 \
    --init training/runs/stage1 --time-budget ${TRAIN_S:-420} --phases 4096:1.0:32 --lr 4e-4 --warmup 20 \
    --eval-every 90 --final-ctx 4096 --final-eval-n 16 > $OUT/stage2_log.txt 2>&1
  echo "rc=$?"; grep -E "eval|phase|done|exported" $OUT/stage2_log.txt | tail -10 | cut -c1-260
fi
