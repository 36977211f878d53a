#!/usr/bin/env bash
# The GPU check (about 3-5 minutes on a machine with an NVIDIA GPU and a CUDA build of torch):
#   1. `shoal hw`: NVML, torch devices, matmul TFLOP/s;
#   2. a 2-node LoRA task on a tiny random Llama whose inner steps run on CUDA (requirements.device = "cuda");
#   3. the export loaded back onto the GPU with transformers (and peft), logits compared with the swarm's weights.
# Writes gpu_check/{hw.json,finetune.json} and prints a summary; exit 0 only if every step passed.
#   bash scripts/gpu_check.sh              # uses .venv (scripts/setup.sh; TORCH_SPEC picks a CUDA build)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   bash scripts/gpu_check.sh --dry-run    # on a machine without a GPU: the same steps with device "any" (CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${GPU_CHECK_OUT:-gpu_check}"
DEVICE=cuda
if [ "${1:-}" = "--dry-run" ]; then DEVICE=any; fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== torch" >&2
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device; install a CUDA build (see README, On a GPU) or use --dry-run" >&2
    exit 2
fi

echo "== shoal hw" >&2
timeout 120 "$PY" -m node.cli hw --json > "$OUT/hw.json"
"$PY" - "$OUT/hw.json" <<'PYEOF'
import json, sys
hw = json.load(open(sys.argv[1]))
print("gpus", [g.get("name") for g in hw.get("gpus", [])], "torch devices",
      [(d["device"], d["works"]) for d in hw["torch"]["devices"]])
PYEOF

echo "== 2-node LoRA task, inner steps on $DEVICE, export loaded back" >&2
timeout 300 "$PY" scripts/demo_finetune.py --nodes 2 --rounds 4 --inner-steps 20 --device "$DEVICE" \
    --json-out "$OUT/finetune.json" > /dev/null
"$PY" - "$OUT/finetune.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("eval_loss_first", "eval_loss_last", "hashes_agree", "export_loads", "export_device", "logits_match",
        "logits_max_abs_diff", "adapter_logits_match", "bytes_per_node_per_round", "swarm_seconds", "seconds")
for k in keys:
    print(f"{k:28} {r.get(k)}")
ok = r["hashes_agree"] and r["export_loads"] and r["logits_match"] and r["eval_loss_last"] < r["eval_loss_first"]
print("gpu_check:", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
PYEOF
