#!/usr/bin/env bash
# One-command GPU check (< 8 minutes on one H200): install what the machine lacks from wheels/ (see
# scripts/fetch_gpu_wheels.sh; no network needed), install minichat without touching that machine's
# torch, run the GPU-marked tests (compiled Triton vs the reference, FlashInfer if installed, greedy
# token-exact vs transformers with CUDA graphs on/off and overlap on/off), then `minichat bench
# --concurrency 32` on a Qwen2.5-0.5B-shaped random checkpoint with each backend, and print one table;
# then scripts/bench_offline.py on nano-vllm's offline workload (printed as it runs).
#
#   scripts/gpu_check.sh            # everything
#   GPU_CHECK_SKIP_TESTS=1 ...      # only the benchmark
#   GPU_CHECK_DRY_RUN=1 ...         # print the steps (works without a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-wheels}"
WORK="$(mktemp -d /tmp/minichat-gpu-check.XXXXXX)"
BENCH_ARGS=(--concurrency 32 --num-requests 96 --input-len 128 --output-len 128 --warmup 4)
export TRITON_INTERPRET=0 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
status=0

step() { echo; echo "== $*"; }
run() { echo "+ $*"; if [ -z "${GPU_CHECK_DRY_RUN:-}" ]; then "$@"; else true; fi; }

step "environment"
"$PY" - <<'PYEOF' || { [ -n "${GPU_CHECK_DRY_RUN:-}" ] || exit 1; }
import importlib.util, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
for name in ("triton", "transformers", "flashinfer"):
    spec = importlib.util.find_spec(name)
    print(f"{name}: {__import__(name).__version__ if spec else 'not installed'}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: this script checks the GPU path (set GPU_CHECK_DRY_RUN=1 to only print the steps)")
PYEOF

step "install missing dependencies from $WHEELS/ (no index, torch untouched)"
missing=()
for pair in zmq:pyzmq msgspec:msgspec textual:textual typer:typer tqdm:tqdm safetensors:safetensors \
            tokenizers:tokenizers httpx:httpx fastapi:fastapi uvicorn:uvicorn prometheus_client:prometheus-client \
            pytest:pytest pytest_timeout:pytest-timeout; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ -d "$WHEELS" ] || { echo "missing ${missing[*]} and no $WHEELS/ folder: run scripts/fetch_gpu_wheels.sh first"; exit 1; }
    run "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}" || exit 1
else
    echo "nothing missing"
fi
# --no-deps: the machine's torch/transformers stay as they are; the build backend comes from wheels/.
[ -d "$WHEELS" ] || { echo "no $WHEELS/ folder (setuptools for the build comes from it): run scripts/fetch_gpu_wheels.sh"; exit 1; }
run "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps -e . || exit 1
MINICHAT=("$PY" -m tui.cli)

if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    step "GPU-marked tests (compiled Triton, FlashInfer if installed, greedy with graphs/overlap on and off)"
    "$PY" -c "import flashinfer" 2>/dev/null || echo "FlashInfer: not installed here, its tests are skipped"
    run timeout 300 "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider || status=1
fi

GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [ "$GPUS" -ge 2 ]; then
    if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
        step "tensor parallelism over NCCL: TP=2 greedy vs transformers, pages freed on every rank"
        run timeout 300 "$PY" -m pytest tests/test_tensor_parallel.py -k gpus -q -rs -p no:cacheprovider || status=1
    fi
else
    echo "tensor parallelism: $GPUS GPU(s) here, so no TP=2 test or benchmark row (they need two)"
fi

step "benchmark: Qwen2.5-0.5B-shaped random checkpoint, bf16, ${BENCH_ARGS[*]}"
CKPT="$WORK/qwen2.5-0.5b-random"
run "$PY" scripts/make_random_checkpoint.py "$CKPT" --shape qwen2.5-0.5b --dtype bfloat16 || exit 1
configs=("torch --no-cuda-graph" "triton --no-cuda-graph" "triton --cuda-graph" "triton --cuda-graph --no-overlap")
if "$PY" -c "import flashinfer" 2>/dev/null; then
    configs+=("flashinfer --no-cuda-graph" "flashinfer --cuda-graph")
else
    echo "FlashInfer: not installed on this machine, so no FlashInfer rows (pip install 'minichat[gpu]' to add them)"
fi
[ "$GPUS" -lt 2 ] || configs+=("triton --no-cuda-graph --tp 2")  # graphs are off under TP anyway
for cfg in "${configs[@]}"; do
    read -r backend rest <<<"$cfg"
    tag="$(echo "$cfg" | tr -c 'a-z0-9\n' '_')"
    # shellcheck disable=SC2086 # $rest is a list of flags
    run timeout 120 "${MINICHAT[@]}" bench "${BENCH_ARGS[@]}" --model "$CKPT" --device cuda --dtype bfloat16 \
        --max-model-len 1024 --attention-backend "$backend" $rest --address "ipc://$WORK/$tag.sock" \
        --json "$WORK/$tag.json" || { echo "bench failed: $cfg"; status=1; }
    # A bench killed by its timeout leaves its engine running: stop it (a no-op when bench already did).
    [ -n "${GPU_CHECK_DRY_RUN:-}" ] || "${MINICHAT[@]}" stop --address "ipc://$WORK/$tag.sock" >/dev/null 2>&1
done

step "offline throughput on nano-vllm's workload (256 seqs, lengths U[100, 1024], ignore_eos): scripts/bench_offline.py"
run timeout 240 "$PY" scripts/bench_offline.py "$CKPT" --device cuda --dtype bfloat16 --json "$WORK/offline.json.out" \
    || { echo "offline bench failed"; status=1; }

step "results"
[ -n "${GPU_CHECK_DRY_RUN:-}" ] || "$PY" - "$WORK" <<'PYEOF'
import json, sys
from pathlib import Path
rows = []
for path in sorted(Path(sys.argv[1]).glob("*.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(path.read_text())
    cfg, ran, e = r["config"]["engine_config"], r["config"]["engine_execution"], r["engine"]
    rows.append((ran["attention_backend"], str(cfg.get("tensor_parallel_size", 1)), "on" if cfg.get("cuda_graph") else "off",
                 ran["overlap"], f"{e['output_throughput']:.0f}",
                 f"{e['ttft_ms']['median']:.1f}", f"{e['tpot_ms']['median']:.2f}", f"{e['itl_ms']['median']:.2f}",
                 f"{e['completed']}/{e['failed']}"))
head = ("backend", "tp", "cuda graph", "overlap", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", "ok/failed")
widths = [max(len(x) for x in col) for col in zip(head, *rows)]
for row in (head, *rows):
    print("  ".join(x.rjust(w) for x, w in zip(row, widths)))
PYEOF
echo
echo "work dir: $WORK"
exit $status
