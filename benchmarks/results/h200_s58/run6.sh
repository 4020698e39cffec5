# Issue 34, subword model, stage 1 of 2 (from scratch, the new --mixture ruler stream of
# training/mixture.py; benchmarks/notes/subword_baseline.md section 6). The device's own
# torch; no MLX needed. Carry ["training/data"] (built here by training/build_corpus.py).
# Go / no-go for stage 2: the log's teacher-forced evals at 512 and 1,024 (ruler:qa above
# about 0.3, ruler:vt above 0 by the end of the 1,024 phase).
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python3 training/train.py --corpus training/data/train.txt --out $OUT/stage1 \
  --tokenizer veloxquant/assets/reference_subword/tokenizer.json --mixture ruler \
  --time-budget 480 --phases 256:0.3:512,512:0.35:256,1024:0.35:128 \
  --config '{"num_hidden_layers": 6}' --workers 14 --eval-every 60 --ckpt-every 120 \
  --log-every 250 --final-ctx 512,1024 --final-eval-n 16 > $OUT/subword_stage1_log.txt 2>&1
echo "rc=$?"; grep -E "eval|phase|done|exported" $OUT/subword_stage1_log.txt | tail -30
