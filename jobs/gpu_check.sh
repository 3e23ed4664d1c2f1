#!/usr/bin/env bash
# The GPT job on a single-GPU machine: four stage actors share the one GPU (0.25 GPU each;
# NCCL cannot put two ranks on one GPU, so the links use gloo and carry CPU tensors).
# Run from the repo root: bash jobs/gpu_check.sh   (figures land in ${OUT:-runs/gpu})
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
python3 -m venv /tmp/rrfp-gpu-venv
. /tmp/rrfp-gpu-venv/bin/activate
python -m pip install --quiet "torch>=2.4" "ray[default]==2.60.0" "pydantic>=2.5" numpy tqdm matplotlib
python -m pip install --quiet --no-deps -e .
nvidia-smi --query-gpu=name,memory.total --format=csv
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
common=(--gpus-per-stage 0.25 --backend gloo --microbatches 16 --iterations 30 --val-every 10
        --n-layer 8 --n-embd 256 --n-head 8 --block-size 128 --seq-len 128 --micro-batch-size 16)
python jobs/train_gpt.py "${common[@]}" --stages 4 --scenario none --out "$out/none"
python jobs/train_gpt.py "${common[@]}" --stages 4 --scenario multimodal --t-f 5 --out "$out/multimodal"
# PP=2 x TP=2: the TP layers' all-reduces on CUDA tensors over gloo, the agreement over TCP
python jobs/train_gpt.py "${common[@]}" --stages 2 --tp 2 --scenario multimodal --t-f 5 --out "$out/tp"
python - "$out" <<'PY'
import json, sys
for name in ("none", "multimodal", "tp"):
    s = json.load(open(f"{sys.argv[1]}/{name}/summary.json"))
    print(name, {k: s.get(k) for k in ("loss_first", "loss_last", "iteration_ms_median", "tokens_per_s", "tp_coord_fraction")},
          "speedup vs 1f1b", round(s.get("speedup_vs_1f1b", float("nan")), 3))
PY
