#!/usr/bin/env bash
# Byte-level BPE (vocab 2048) on the training 90% of tiny shakespeare -> runs/tokenizer
# Extra flags go to the CLI and win: scripts/train_tokenizer.sh --corpus PATH (relative to the repo root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m pagedmoe.train tokenizer --corpus ../shared/data/tinyshakespeare.txt --out-dir runs/tokenizer --vocab-size 2048 "$@"
