#!/usr/bin/env bash
# Issue 7's GPU figures in one device call (budgeted under 5 minutes on an H200); logs and JSON go to $OUT:
#   device run: command="bash scripts/gpu_bench.sh", timeout_s=420
# DEVICE=cpu NUM_PROMPTS=4 OUTPUT_LEN=4-8 bash scripts/gpu_bench.sh checks the script itself on a CPU.
# The device's python3 holds torch and transformers; nothing else pagedmoe's bench needs is missing there.
set -euo pipefail
out=${OUT:-runs/gpu-bench}
device=${DEVICE:-cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
peak=(--peak-matmul-size 8192 --peak-read-mib 4096)
[ "$device" = cpu ] && peak=(--peak-matmul-size 1024 --peak-read-mib 256)
workload=(--num-prompts "${NUM_PROMPTS:-64}" --input-len 32-256 --output-len "${OUTPUT_LEN:-16-256}")

$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" | tee "$out/env.txt"
[ -d runs/bench-models/qwen3-moe-100m-active ] || $py scripts/make_bench_models.py runs/bench-models

bench() {  # NAME ARGS...: one bench command, its output kept as NAME.log and NAME.json
    local name=$1; shift
    echo "== $name: pagedmoe bench $*" | tee "$out/$name.log"
    $py -m pagedmoe bench "$@" --device "$device" --output-json "$out/$name.json" 2>&1 \
        | grep -v 'it/s]' | tee -a "$out/$name.log"
}
bench dense-bf16 throughput --model runs/bench-models/qwen3-100m --dtype bfloat16 "${workload[@]}" "${peak[@]}" \
    --baseline hf-static --baseline hf-cb
bench dense-fp32 throughput --model runs/bench-models/qwen3-100m --dtype float32 "${workload[@]}" "${peak[@]}" \
    --baseline hf-static
bench moe-bf16 throughput --model runs/bench-models/qwen3-moe-100m-active --dtype bfloat16 "${workload[@]}" \
    "${peak[@]}" --baseline hf-static
echo "== dense-bf16-latency" | tee "$out/dense-bf16-latency.log"
$py -m pagedmoe bench latency --model runs/bench-models/qwen3-100m --dtype bfloat16 --device "$device" \
    --batch-size 32 --input-len 128 --output-len 64 2>&1 | grep -v 'it/s]' | tee -a "$out/dense-bf16-latency.log"
