#!/usr/bin/env bash
# The GPU run (issues 7 and 20), one device call budgeted under 8 minutes on an H200; logs and JSON go to $OUT:
#   device run: command="bash scripts/gpu_bench.sh", timeout_s=540
# 1. scripts/gpu_check.py: every Triton kernel against the PyTorch path (float32, bf16), CUDA graphs against
#    eager (greedy tokens), decode's memory bandwidth against the device's copy bandwidth -> check.json;
# 2. bf16 throughput of the dense and MoE bench models (with vLLM where the device's python has it) and the
#    dense model's latency -> one JSON per bench; 3. summary.json gathers them all.
# bash scripts/gpu_bench.sh --dry-run checks the script on a CPU: the kernel checks in Triton's interpreter and
# the report's schema, then the bench commands printed, not run (tests/test_gpu_check.py runs it).
set -euo pipefail
out=${OUT:-runs/gpu-bench}
py=${PYTHON:-python3}
models=${MODELS_DIR:-runs/bench-models}
dry_run=0
for arg in "$@"; do
    case $arg in
        --dry-run) dry_run=1 ;;
        *) echo "usage: bash scripts/gpu_bench.sh [--dry-run]" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # the command, or on a dry run its echo
    if [ "$dry_run" = 1 ]; then echo "would run: $*"; else "$@"; fi
}

$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" | tee "$out/env.txt"
if [ "$dry_run" = 1 ]; then
    $py scripts/gpu_check.py --dry-run --out "$out/check.json" > "$out/check.log"
else
    [ -d "$models/qwen3-moe-100m-active" ] || $py scripts/make_bench_models.py "$models"
    timeout 150 $py scripts/gpu_check.py --out "$out/check.json" --models-dir "$models" 2>&1 | tee "$out/check.log" \
        || echo "gpu_check.py failed or timed out (see check.log)"
fi

baselines=(--baseline hf-static)
if $py -c "import vllm" 2>/dev/null; then baselines+=(--baseline vllm --vllm-python "$py"); fi
workload=(--num-prompts "${NUM_PROMPTS:-64}" --input-len 32-256 --output-len "${OUTPUT_LEN:-16-256}")
bench() {  # NAME ARGS...: one bench command, its output kept as NAME.log and NAME.json
    local name=$1; shift
    echo "== $name: pagedmoe bench $*" | tee "$out/$name.log"
    run timeout 80 $py -m pagedmoe bench "$@" --device cuda --output-json "$out/$name.json" 2>&1 \
        | grep -v 'it/s]' | tee -a "$out/$name.log" || echo "$name failed or timed out" | tee -a "$out/$name.log"
}
bench dense-bf16 throughput --model "$models/qwen3-100m" --dtype bfloat16 "${workload[@]}" "${baselines[@]}" \
    --peak-matmul-size 8192 --peak-read-mib 4096
bench moe-bf16 throughput --model "$models/qwen3-moe-100m-active" --dtype bfloat16 "${workload[@]}" \
    "${baselines[@]}"
bench dense-bf16-latency latency --model "$models/qwen3-100m" --dtype bfloat16 --batch-size 32 --input-len 128 \
    --output-len 64

$py - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
summary = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))
           if not p.endswith("summary.json")}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print("summary.json:", ", ".join(summary))
EOF
