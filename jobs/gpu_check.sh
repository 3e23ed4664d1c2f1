#!/usr/bin/env bash
# GPU checks, as one script: the GPU tests (-m gpu: the CUDA stream/event hand-off between a
# stage's threads), then the GPT job with CUDA compute: four stage actors share one GPU (0.25
# GPU each; NCCL cannot put two ranks on one GPU, so the links use gloo: every output crosses
# from the compute stream to the send thread by its event), bf16 where train_gpt has
# --precision, and NCCL links between stages on separate GPUs when the machine has two or more.
# Run from the repo root: bash jobs/gpu_check.sh   (figures land in ${OUT:-runs/gpu})
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu}"
python3 -m venv /tmp/rrfp-gpu-venv
. /tmp/rrfp-gpu-venv/bin/activate
python -m pip install --quiet "torch>=2.4" "ray[default]==2.60.0" "pydantic>=2.5" numpy tqdm matplotlib pytest pyyaml
python -m pip install --quiet --no-deps -e .
nvidia-smi --query-gpu=name,memory.total --format=csv
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider -m gpu tests/
gpus=$(nvidia-smi -L | wc -l)
common=(--gpus-per-stage 0.25 --backend gloo --microbatches 16 --iterations 30 --val-every 10
        --n-layer 8 --n-embd 256 --n-head 8 --block-size 128 --seq-len 128 --micro-batch-size 16)
python jobs/train_gpt.py "${common[@]}" --stages 4 --scenario none --out "$out/none"
python jobs/train_gpt.py "${common[@]}" --stages 4 --scenario multimodal --t-f 5 --out "$out/multimodal"
# PP=2 x TP=2: the TP layers' all-reduces on CUDA tensors over gloo, the agreement over TCP
python jobs/train_gpt.py "${common[@]}" --stages 2 --tp 2 --scenario multimodal --t-f 5 --out "$out/tp"
runs=(none multimodal tp)
if python jobs/train_gpt.py --help | grep -q -- "--precision"; then
    python jobs/train_gpt.py "${common[@]}" --stages 4 --scenario none --precision bf16 --out "$out/bf16"
    runs+=(bf16)
fi
if [ "$gpus" -ge 2 ]; then  # one GPU per stage actor, NCCL links between them
    python -m pip install --quiet "cupy-cuda12x>=13" nvidia-nccl-cu12
    python jobs/train_gpt.py --gpu --backend nccl --stages "$(( gpus < 4 ? gpus : 4 ))" --microbatches 16 --iterations 30 \
        --val-every 10 --n-layer 8 --n-embd 256 --n-head 8 --block-size 128 --seq-len 128 --micro-batch-size 16 \
        --scenario none --out "$out/nccl"
    runs+=(nccl)
fi
python - "$out" "${runs[@]}" <<'PY'
import json, sys
for name in sys.argv[2:]:
    s = json.load(open(f"{sys.argv[1]}/{name}/summary.json"))
    print(name, {k: s.get(k) for k in ("loss_first", "loss_last", "iteration_ms_median", "tokens_per_s", "tp_coord_fraction")},
          "speedup vs the fixed baseline", round(s.get("speedup_vs_baseline", float("nan")), 3))
PY
