#!/usr/bin/env bash
# One run per router variant, same data and steps (500 x 16 x 128 tokens), run sequentially.
# Produces runs/compare/summary.{md,json} and docs/moe_training_load_cv.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -f runs/tokenizer/tokenizer.json ] || scripts/train_tokenizer.sh
nice -n 10 $PY -m pagedmoe.train compare --root runs/compare --tokenizer-dir runs/tokenizer \
  --routers none noisy_topk switch top2 sigmoid_bias \
  --max-steps 500 --eval-interval 100 --checkpoint-interval 200 --warmup-steps 50 --lr 3e-3 --threads 1 \
  --plot docs/moe_training_load_cv.png
# Replicate with another seed for the two Qwen3-MoE candidates, to size run-to-run noise in val loss.
nice -n 10 $PY -m pagedmoe.train compare --root runs/compare_seed1 --seed 1 --routers none top2 \
  --tokenizer-dir runs/tokenizer \
  --max-steps 500 --eval-interval 100 --checkpoint-interval 200 --warmup-steps 50 --lr 3e-3 --threads 1
