#!/usr/bin/env bash
# The dense draft model (future speculative decoding): Qwen3 dense, same tokenizer, a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -f runs/tokenizer/tokenizer.json ] || scripts/train_tokenizer.sh
TRAIN=(-m pagedmoe.train train --arch dense --out-dir runs/draft --tokenizer-dir runs/tokenizer
  --hidden-size 128 --num-layers 2 --dense-intermediate-size 512
  --seq-len 256 --batch-size 8 --lr 3e-3 --warmup-steps 100 --max-steps 1200 --max-minutes 6
  --eval-interval 200 --checkpoint-interval 200 --threads 1)
nice -n 10 $PY "${TRAIN[@]}"
$PY -m pagedmoe.train export runs/draft models/pagedmoe-draft-dense \
  --card-title pagedmoe-draft-dense --command "python ${TRAIN[*]}"
