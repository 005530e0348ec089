#!/usr/bin/env bash
# One-command GPU check (about 10 minutes at most on one H200; every step has a timeout, and they add up
# to ~600 s on top of a minute of setup): install what the machine lacks from wheels/ (see
# scripts/fetch_gpu_wheels.sh; no network needed), install minichat without touching that machine's
# torch, run the GPU-marked tests (compiled Triton vs the reference, FlashInfer if installed, greedy
# token-exact vs transformers with CUDA graphs on/off and overlap on/off), then on a Qwen2.5-0.5B-shaped
# random checkpoint:
#   - the served sweep: one engine (the CUDA defaults) and `minichat bench` against it at concurrency
#     1/8/32/128, 1,056 measured requests in all, printed as one table;
#   - `minichat bench --concurrency 32` for the configurations the sweep does not run (graphs off,
#     overlap off, FlashInfer if installed, TP=2 with two GPUs), printed as a second table;
#   - scripts/gpu_profile.py at batch 1/32/128: kernels per step, time per kernel family, host gaps;
#   - scripts/bench_offline.py on nano-vllm's offline workload.
#
# Timeouts (seconds), which bound the whole run on one GPU: tests 120; the sweep's engine 160 (60 to
# start, then the levels' 30 + 20 + 20 + 30, which it outlives); configurations 60 each (two, three with
# FlashInfer); profile 60; offline 75. In all 535 s (595 with FlashInfer; two GPUs add the TP test's
# 120 and a TP row's 60), plus about a minute of installing and checkpoint writing. On the first H200 run the GPU tests took 30 s and a bench with its
# own engine 30-40 s, most of it start-up, which is why the sweep shares one engine.
#
#   scripts/gpu_check.sh            # everything
#   GPU_CHECK_SKIP_TESTS=1 ...      # no tests, only the benchmarks and the profile
#   GPU_CHECK_DRY_RUN=1 ...         # print the steps, probing and running nothing (no GPU, torch or wheels/
#                                   # needed): the plan for one GPU without FlashInfer, or for
#                                   # GPU_CHECK_GPUS=N GPUs and, with GPU_CHECK_FLASHINFER=1, FlashInfer
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-wheels}"
DRY="${GPU_CHECK_DRY_RUN:-}"
WORK="$(mktemp -d /tmp/minichat-gpu-check.XXXXXX)"
ENGINE=(--device cuda --dtype bfloat16 --max-model-len 1024)
BENCH_ARGS=(--concurrency 32 --num-requests 96 --input-len 128 --output-len 128 --warmup 4)
# The served sweep: concurrency:requests:timeout. Prompts of 128 tokens, 64 output tokens (ignore_eos).
SWEEP=(1:64:30 8:160:20 32:320:20 128:512:30)
SWEEP_ARGS=(--input-len 128 --output-len 64 --warmup 4)
SWEEP_START=60  # seconds for the sweep's engine to answer: torch import, weights, graph capture, Triton compiles
SWEEP_LIFE=$SWEEP_START  # the engine's own timeout: its start plus every level's, so it outlives none of them
for level in "${SWEEP[@]}"; do SWEEP_LIFE=$((SWEEP_LIFE + ${level##*:})); done
export TRITON_INTERPRET=0 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1
status=0

step() { echo; echo "== $*"; }
run() { echo "+ $*"; if [ -z "$DRY" ]; then "$@"; else true; fi; }
has_flashinfer() { if [ -n "$DRY" ]; then [ -n "${GPU_CHECK_FLASHINFER:-}" ]; else "$PY" -c "import flashinfer" 2>/dev/null; fi; }

step "environment"
if [ -n "$DRY" ]; then
    echo "dry run: nothing below is probed or run, only printed"
else
    "$PY" - <<'PYEOF' || exit 1
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
fi

step "install missing dependencies from $WHEELS/ (no index, torch untouched)"
missing=()
for pair in zmq:pyzmq msgspec:msgspec textual:textual typer:typer tqdm:tqdm safetensors:safetensors \
            tokenizers:tokenizers httpx:httpx fastapi:fastapi uvicorn:uvicorn prometheus_client:prometheus-client \
            pytest:pytest pytest_timeout:pytest-timeout; do
    [ -n "$DRY" ] || "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if [ ! -d "$WHEELS" ]; then
    echo "no $WHEELS/ folder (the build backend and any missing package come from it): run scripts/fetch_gpu_wheels.sh"
    [ -n "$DRY" ] || exit 1
fi
if [ ${#missing[@]} -gt 0 ]; then
    run "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}" || exit 1
elif [ -n "$DRY" ]; then
    echo "(imports not probed: whichever runtime or test dependency is missing would be installed from $WHEELS/ here)"
else
    echo "nothing missing"
fi
# --no-deps: the machine's torch/transformers stay as they are; the build backend comes from wheels/.
run "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps -e . || exit 1
MINICHAT=("$PY" -m tui.cli)

if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    step "GPU-marked tests (compiled Triton, FlashInfer if installed, greedy with graphs/overlap on and off)"
    has_flashinfer || echo "FlashInfer: not installed here, its tests are skipped"
    run timeout 120 "$PY" -m pytest -m gpu tests/test_gpu.py -q -rs -p no:cacheprovider || status=1
fi

if [ -n "$DRY" ]; then
    GPUS="${GPU_CHECK_GPUS:-1}"
else
    GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
fi
if [ "$GPUS" -ge 2 ]; then
    if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
        step "tensor parallelism over NCCL: TP=2 greedy vs transformers, pages freed on every rank (2+ GPUs only)"
        run timeout 120 "$PY" -m pytest tests/test_tensor_parallel.py -k gpus -q -rs -p no:cacheprovider || status=1
    fi
else
    echo "tensor parallelism: $GPUS GPU(s) here, so no TP=2 test or benchmark row (they need two)"
fi

step "checkpoint: Qwen2.5-0.5B-shaped, random weights, bf16"
CKPT="$WORK/qwen2.5-0.5b-random"
run "$PY" scripts/make_random_checkpoint.py "$CKPT" --shape qwen2.5-0.5b --dtype bfloat16 || exit 1

step "served sweep: one engine (CUDA defaults), minichat bench at concurrency ${SWEEP[*]%%:*} (${SWEEP_ARGS[*]})"
SWEEP_ADDR="ipc://$WORK/sweep.sock"
mkdir -p "$WORK/sweep"
# The engine lives at most as long as the sweep's timeouts add up to, whatever happens to this script.
echo "+ timeout $SWEEP_LIFE ${MINICHAT[*]} serve --model $CKPT ${ENGINE[*]} --address $SWEEP_ADDR > $WORK/sweep/engine.log 2>&1 &"
echo "+ wait up to $SWEEP_START s until minichat status answers at $SWEEP_ADDR"
engine_ready=1
if [ -z "$DRY" ]; then
    timeout "$SWEEP_LIFE" "${MINICHAT[@]}" serve --model "$CKPT" "${ENGINE[@]}" --address "$SWEEP_ADDR" \
        >"$WORK/sweep/engine.log" 2>&1 &
    engine_pid=$!
    engine_ready=0
    deadline=$((SECONDS + SWEEP_START))
    while [ "$SECONDS" -lt "$deadline" ] && kill -0 "$engine_pid" 2>/dev/null; do
        if "${MINICHAT[@]}" status --address "$SWEEP_ADDR" --timeout 1 >/dev/null 2>&1; then engine_ready=1; break; fi
        sleep 1
    done
    if [ "$engine_ready" = 0 ]; then
        echo "the sweep's engine did not answer within $SWEEP_START s; the end of its log:"
        tail -20 "$WORK/sweep/engine.log"
        kill "$engine_pid" 2>/dev/null  # timeout passes the signal on to the engine
        status=1
    fi
fi
if [ "$engine_ready" = 1 ]; then
    seed=0
    for level in "${SWEEP[@]}"; do
        IFS=: read -r conc num limit <<<"$level"
        seed=$((seed + 1))  # new prompts at each level: none is served from the previous level's prefix cache
        run timeout "$limit" "${MINICHAT[@]}" bench --address "$SWEEP_ADDR" --concurrency "$conc" --num-requests "$num" \
            "${SWEEP_ARGS[@]}" --seed "$seed" --json "$WORK/sweep/c$conc.json" || { echo "bench failed: concurrency $conc"; status=1; }
    done
fi
run "${MINICHAT[@]}" stop --address "$SWEEP_ADDR"
[ -n "$DRY" ] || wait "$engine_pid" 2>/dev/null

step "benchmark per configuration: ${BENCH_ARGS[*]}"
configs=("triton --no-cuda-graph" "triton --cuda-graph --no-overlap")
if has_flashinfer; then
    configs+=("triton --cuda-graph")  # auto picks FlashInfer, so the sweep's c=32 line is FlashInfer with graphs
else
    echo "FlashInfer: not installed on this machine, so no FlashInfer rows (pip install 'minichat[gpu]' to add them)"
fi
[ "$GPUS" -lt 2 ] || configs+=("triton --no-cuda-graph --tp 2")  # graphs are off under TP anyway
for cfg in "${configs[@]}"; do
    read -r backend rest <<<"$cfg"
    tag="$(echo "$cfg" | tr -c 'a-z0-9\n' '_')"
    # shellcheck disable=SC2086 # $rest is a list of flags
    run timeout 60 "${MINICHAT[@]}" bench "${BENCH_ARGS[@]}" --model "$CKPT" "${ENGINE[@]}" \
        --attention-backend "$backend" $rest --address "ipc://$WORK/$tag.sock" \
        --json "$WORK/$tag.json" || { echo "bench failed: $cfg"; status=1; }
    # A bench killed by its timeout leaves its engine running: stop it (a no-op when bench already did).
    [ -n "$DRY" ] || "${MINICHAT[@]}" stop --address "ipc://$WORK/$tag.sock" >/dev/null 2>&1
done

step "step profile: scripts/gpu_profile.py at batch 1/32/128 (kernels per step, kernel families, host gaps)"
run timeout 60 "$PY" scripts/gpu_profile.py "$CKPT" --device cuda --dtype bfloat16 --batches 1,32,128 \
    --prompt-len 128 --steps 8 --json "$WORK/profile.json.out" --trace "$WORK/profile.trace.json.out" \
    || { echo "profile failed"; status=1; }

step "offline throughput on nano-vllm's workload (256 seqs, lengths U[100, 1024], ignore_eos): scripts/bench_offline.py"
run timeout 75 "$PY" scripts/bench_offline.py "$CKPT" --device cuda --dtype bfloat16 --json "$WORK/offline.json.out" \
    || { echo "offline bench failed"; status=1; }

step "results"
[ -n "$DRY" ] || "$PY" - "$WORK" <<'PYEOF'
import json, sys
from pathlib import Path

def table(head, rows):
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))

def latency(e):
    return [f"{e['ttft_ms']['median']:.1f}", f"{e['tpot_ms']['median']:.2f}", f"{e['itl_ms']['median']:.2f}",
            f"{e['completed']}/{e['failed']}"]

work = Path(sys.argv[1])
sweep = [json.loads(p.read_text()) for p in (work / "sweep").glob("c*.json")]
sweep.sort(key=lambda r: r["config"]["concurrency"])
if sweep:
    ran = sweep[0]["config"]["engine_execution"]
    print(f"served sweep, one engine: {ran['attention_backend']}, cuda graph {ran.get('cuda_graph', 'off')}, "
          f"overlap {ran['overlap']}; {sweep[0]['config']['input_len']} prompt / {sweep[0]['config']['output_len']} "
          f"output tokens")
    table(("concurrency", "requests", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", "ok/failed"),
          [(str(r["config"]["concurrency"]), str(r["config"]["num_requests"]),
            f"{r['engine']['output_throughput']:.0f}", *latency(r["engine"])) for r in sweep])
    print(f"{sum(r['config']['num_requests'] for r in sweep)} requests in the sweep, "
          f"{sum(r['engine']['completed'] for r in sweep)} completed")
else:
    print("served sweep: no results")
print()
rows = []
for path in sorted(work.glob("*.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(path.read_text())
    cfg, ran, e = r["config"]["engine_config"], r["config"]["engine_execution"], r["engine"]
    rows.append((ran["attention_backend"], str(cfg.get("tensor_parallel_size", 1)), "on" if cfg.get("cuda_graph") else "off",
                 ran["overlap"], f"{e['output_throughput']:.0f}", *latency(e)))
print("configurations, concurrency 32 (the sweep's c=32 line is the default one)")
table(("backend", "tp", "cuda graph", "overlap", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
       "ok/failed"), rows)
PYEOF
echo
if [ -n "$DRY" ]; then rm -rf "$WORK"; else echo "work dir: $WORK"; fi
exit $status
