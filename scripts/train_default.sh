#!/usr/bin/env bash
# The bundled default model: Qwen3-MoE export, 8 experts top-2, <= 20 minutes on one CPU thread.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -f runs/tokenizer/tokenizer.json ] || scripts/train_tokenizer.sh
TRAIN=(-m pagedmoe.train train --out-dir runs/default --tokenizer-dir runs/tokenizer --router top2
  --num-experts 8 --top-k 2 --hidden-size 128 --num-layers 4 --moe-intermediate-size 256
  --seq-len 256 --batch-size 8 --lr 3e-3 --warmup-steps 100 --max-steps 1500 --max-minutes 20
  --eval-interval 200 --checkpoint-interval 200 --threads 1)
nice -n 10 $PY "${TRAIN[@]}"
$PY -m pagedmoe.train export runs/default models/pagedmoe-moe-default --dtype bfloat16 \
  --card-title pagedmoe-moe-default --command "python ${TRAIN[*]}"
