#!/usr/bin/env bash
# Speed and memory on one GPU or TPU host: trains configs/llama_1b.py (seq 2048, bfloat16) and
# configs/llama3_8b.py (seq 8192, bfloat16) for a few dozen steps each, with FSDP over every
# device of the host, and appends a dated block to benchmarks/RESULTS.md: the device and versions,
# then per model tokens/s, MFU, step time, peak device memory, the compiled step's memory and
# where its profile is.
#
#   benchmarks/accelerator.sh                       # both models, 40 steps each
#   benchmarks/accelerator.sh --models=llama_1b --steps=60
#   benchmarks/accelerator.sh --tiny                # configs/tiny.py, 6 steps: checks the recipe
#                                                   # on any machine (a CPU too)
#   benchmarks/accelerator.sh --tests               # the GPU tests, tests/test_gpu.py
#   benchmarks/accelerator.sh --models=llama_1b --peer   # and the PyTorch peer; ratio: last
#
# Flags:
#   --models=A,B          which of llama_1b, llama3_8b to run (default: both)
#   --steps=N             steps per model, a multiple of 10 and at least 30 (default 40)
#   --per_device_batch=N  sequences per device for llama_1b (default 4; llama3_8b uses 1)
#   --workdir=DIR         where each model's run goes, DIR/<model> (default runs/accelerator);
#                         each model's folder is emptied first
#   --results=FILE        the file the block is appended to (default benchmarks/RESULTS.md; with
#                         --tiny, DIR/RESULTS.md)
#   --set=KEY=VALUE       a config override for every model (repeatable), e.g.
#                         --set=model.attention=xla; the results table names it
#   --tiny                configs/tiny.py instead of the models above, 6 steps
#   --peer                after llama_1b (or --tiny), the PyTorch peer with the same flags
#                         (benchmarks/peer_torch.py: Hugging Face's Llama, torch.compile,
#                         bfloat16 autocast, fused AdamW, its remat mapped to checkpointing);
#                         its row goes in the table and the script ends with both peaks and
#                         `ratio: X` = jaxscale's tokens/s / the peer's. On a CPU the peer runs
#                         eager.
#   --tests               only run the tests marked `gpu` (tests/test_gpu.py: cuDNN attention
#                         against XLA's, the train step's losses on the GPU against the CPU's)
#                         with JAX_PLATFORMS=cuda,cpu, and exit with pytest's status; no model is
#                         trained and RESULTS.md is untouched. Exits 2 where JAX sees no GPU.
#   --help                print this help
#
# Throughput is the last logging window's (10 steps); the profile traces 3 steps of the window
# before it, so tracing does not slow the figures reported. On hosts with fewer than 4 devices the
# 8B model keeps bfloat16 Adam moments, and on one device also offloads them to host memory (it
# cannot fit otherwise); the block says so. A model that fails (out of memory, say) gets a
# "failed" row with its log's path, and the script goes on. On GPUs the allocator may take 90%
# of the memory (XLA_PYTHON_CLIENT_MEM_FRACTION, 75% by default) unless the environment says
# otherwise. $PYTHON (default python3) runs the trainer.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
}

die() {
  echo "error: $*" >&2
  exit 2
}

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="llama_1b,llama3_8b" STEPS=40 PER_DEVICE_BATCH=4 WORKDIR="runs/accelerator" RESULTS=""
TINY=0 TESTS=0 PEER=0
SETS=()
PYTHON="${PYTHON:-python3}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models=*) MODELS="${1#*=}" ;;
    --steps=*) STEPS="${1#*=}" ;;
    --per_device_batch=*) PER_DEVICE_BATCH="${1#*=}" ;;
    --workdir=*) WORKDIR="${1#*=}" ;;
    --results=*) RESULTS="${1#*=}" ;;
    --set=*) SETS+=("--config.${1#*=}") ;;
    --tiny) TINY=1 ;;
    --tests) TESTS=1 ;;
    --peer) PEER=1 ;;
    --help | -h) usage ;;
    *) die "unknown flag $1 (see $0 --help)" ;;
  esac
  shift
done

if [[ $TESTS == 1 ]]; then
  cd "$REPO"
  # tests/conftest.py forces the CPU only where JAX_PLATFORMS is unset: name both backends, the
  # GPU first (JAX's default, where the tests compute) and the CPU the train test compares with.
  # Where JAX sees no GPU (no CUDA plugin, a broken driver) every test would skip and pass.
  JAX_PLATFORMS="cuda,cpu" "$PYTHON" -c 'import jax, sys
sys.exit(not any(d.platform == "gpu" for d in jax.devices()))' 2>/dev/null || \
    die "--tests needs a GPU, and JAX sees none (JAX_PLATFORMS=cuda,cpu: $("$PYTHON" -c \
'import jax; print(sorted({d.platform for d in jax.devices()}))' 2>&1 | tail -n 1)); install \
jax[cuda] or run on a GPU machine"
  status=0
  JAX_PLATFORMS="cuda,cpu" "$PYTHON" -m pytest -q -m gpu tests/test_gpu.py || status=$?
  exit "$status"
fi

[[ "$PER_DEVICE_BATCH" =~ ^[1-9][0-9]*$ ]] || \
  die "--per_device_batch=$PER_DEVICE_BATCH must be a whole number >= 1"
LOG_EVERY=10
if [[ $TINY == 1 ]]; then
  MODELS="tiny" STEPS=6 LOG_EVERY=3
  RESULTS="${RESULTS:-$WORKDIR/RESULTS.md}"
else
  if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || ((STEPS < 30 || STEPS % 10)); then
    die "--steps=$STEPS must be a multiple of 10, at least 30"
  fi
  RESULTS="${RESULTS:-$REPO/benchmarks/RESULTS.md}"
  IFS=, read -r -a wanted <<< "$MODELS"
  for model in "${wanted[@]}"; do
    [[ "$model" == llama_1b || "$model" == llama3_8b ]] || \
      die "--models: unknown model '$model'; use llama_1b and/or llama3_8b"
  done
fi
# Traced: 3 steps (fewer for --tiny) at the start of the next-to-last logging window.
PROFILE_START=$((STEPS - 2 * LOG_EVERY + 1))
PROFILE_STEPS=$((LOG_EVERY - 1 < 3 ? LOG_EVERY - 1 : 3))

cd "$REPO"
mkdir -p "$WORKDIR" "$(dirname "$RESULTS")"
# One line: device count|device kind|platform|jax|jaxlib|memory per device (GiB, 0 if unknown).
DEVICE_INFO="$("$PYTHON" - <<'EOF'
import jax, jaxlib
d = jax.devices()[0]
stats = d.memory_stats() or {}
print(f"{jax.device_count()}|{d.device_kind}|{d.platform}|{jax.__version__}|{jaxlib.__version__}"
      f"|{stats.get('bytes_limit', 0) / 2**30:.0f}")
EOF
)"
IFS='|' read -r DEVICES KIND PLATFORM JAX_VERSION JAXLIB_VERSION MEMORY_GIB <<< "$DEVICE_INFO"
DRIVER=""
if command -v nvidia-smi > /dev/null 2>&1; then
  DRIVER=", NVIDIA driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
fi
COMMIT="$(git -C "$REPO" describe --always --dirty 2> /dev/null || echo unknown)"

# run_model NAME: trains it into $WORKDIR/NAME; prints its results-table row.
run_model() {
  local name="$1" config per_device seq_len
  local -a extra=()
  case "$name" in
    tiny) config=configs/tiny.py per_device=2 seq_len=128 ;;
    llama_1b) config=configs/llama_1b.py per_device=$PER_DEVICE_BATCH seq_len=2048 ;;
    llama3_8b)
      config=configs/llama3_8b.py per_device=1 seq_len=8192
      if ((DEVICES < 4)); then extra+=(--config.optim.moment_dtype=bfloat16); fi
      if ((DEVICES == 1)); then extra+=(--config.optim.offload_state=True); fi
      ;;
  esac
  local dir="$WORKDIR/$name"
  rm -rf "$dir"
  mkdir -p "$dir"
  local batch=$((per_device * DEVICES))
  local status=0
  "$PYTHON" -m jaxscale.train --config="$config" --workdir="$dir" \
    --config.train.steps="$STEPS" --config.train.log_every="$LOG_EVERY" \
    --config.train.eval_every=0 --config.train.batch_size="$batch" \
    --config.train.seq_len="$seq_len" --config.precision.compute_dtype=bfloat16 \
    --config.mesh.data=1 --config.mesh.fsdp=-1 --config.checkpoint.enabled=False \
    --config.data.sources="(dict(format='synthetic'),)" \
    --config.profile.start_step="$PROFILE_START" --config.profile.steps="$PROFILE_STEPS" \
    "${extra[@]}" "${SETS[@]}" > "$dir/train.log" 2>&1 || status=$?
  extra+=("${SETS[@]}")  # named in the table too; given last above, so they win
  "$PYTHON" - "$name" "$dir" "$status" "$batch" "$seq_len" "${extra[*]}" <<'EOF'
import glob, json, os, sys
name, folder, status, batch, seq_len, extra = sys.argv[1:]
lines = []
if os.path.exists(os.path.join(folder, "metrics.jsonl")):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
train = [line for line in lines if "tokens_per_sec" in line]
model = name + (f" ({extra.replace('--config.', '')})" if extra else "")
if status != "0" or not train:
    print(f"| {model} | {batch} x {seq_len} | failed (exit {status}): see "
          f"{os.path.join(folder, 'train.log')} |")
    sys.exit()
last, first = train[-1], lines[0]
get = lambda line, key, form, unit="": format(line[key], form) + unit if key in line else "n/a"
traces = glob.glob(os.path.join(folder, "profile", "process_0", "plugins", "profile", "*"))
print(" | ".join([
    f"| {model}", f"{batch} x {seq_len}", f"{last['step_time'] * 1000:.0f} ms",
    f"{last['tokens_per_sec']:,.0f}", f"{last['tokens_per_sec_per_device']:,.0f}",
    get(last, "mfu", ".1%"), get(last, "memory_peak_gib", ".1f", " GiB"),
    get(first, "step_memory_gib", ".1f", " GiB"), f"{first['time_to_first_step']:.0f} s",
    (traces[0] if traces else "none") + " |"]))
EOF
}

# run_peer NAME: the PyTorch peer of NAME's run, with the same flags, its output in
# $WORKDIR/NAME/peer.log; prints its table row.
run_peer() {
  local name="$1" per_device=$PER_DEVICE_BATCH seq_len=2048 device=cuda compile=1 status=0
  local dir="$WORKDIR/$1"
  if [[ $name == tiny ]]; then per_device=2 seq_len=128; fi
  if [[ $PLATFORM != gpu ]]; then device=cpu compile=0; fi
  local batch=$((per_device * DEVICES))
  "$PYTHON" benchmarks/peer_torch.py --config="configs/$name.py" --device="$device" \
    --compile="$compile" --config.train.steps="$STEPS" --config.train.log_every="$LOG_EVERY" \
    --config.train.batch_size="$batch" --config.train.seq_len="$seq_len" \
    --config.precision.compute_dtype=bfloat16 "${SETS[@]}" > "$dir/peer.log" 2>&1 || status=$?
  "$PYTHON" - "$name" "$dir" "$status" "$batch" "$seq_len" "$DEVICES" <<'PY'
import json, os, sys
name, folder, status, batch, seq_len, devices = sys.argv[1:]
lines = [l for l in open(os.path.join(folder, "peer.log")) if l.startswith("peer: ")]
if status != "0" or not lines:
    print(f"| {name}, the PyTorch peer | {batch} x {seq_len} | failed (exit {status}): see "
          f"{os.path.join(folder, 'peer.log')} |")
    sys.exit()
peer = json.loads(lines[-1][len("peer: "):])
mfu = f"{peer['mfu']:.1%}" if peer["mfu"] else "n/a"
memory = f"{peer['memory_peak_gib']:.1f} GiB" if peer["memory_peak_gib"] else "n/a"
print(" | ".join([f"| {name}, the PyTorch peer", f"{batch} x {seq_len}",
                  f"{peer['step_time'] * 1000:.0f} ms", f"{peer['tokens_per_sec']:,.0f}",
                  f"{peer['tokens_per_sec'] / int(devices):,.0f}", mfu, memory, "-",
                  f"{peer['time_to_first_step']:.0f} s", "none |"]))
PY
}

ROWS=()
IFS=, read -r -a RUN <<< "$MODELS"
PEERED=""
for model in "${RUN[@]}"; do
  echo "running $model ($STEPS steps on $DEVICES x $KIND) ..." >&2
  ROWS+=("$(run_model "$model")")
  if [[ $PEER == 1 && -z $PEERED && ( $model == llama_1b || $model == tiny ) ]]; then
    echo "running the PyTorch peer of $model ..." >&2
    ROWS+=("$(run_peer "$model")")
    PEERED=$model
  fi
done

{
  echo
  echo "## Accelerator run, $(date -u +%Y-%m-%d) — \`benchmarks/accelerator.sh\`"
  echo
  echo "$DEVICES x $KIND ($PLATFORM, ${MEMORY_GIB} GiB each), jax $JAX_VERSION, jaxlib" \
    "$JAXLIB_VERSION$DRIVER, jaxscale $COMMIT; FSDP over all devices, bfloat16 compute," \
    "synthetic data, $STEPS steps; figures from the last $LOG_EVERY steps." \
    "XLA_FLAGS: \`${XLA_FLAGS:-(performance.xla_flags=auto adds the GPU set)}\`;" \
    "XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION."
  echo
  echo "| model | batch x seq | step time | tokens/s | tokens/s/device | MFU | peak memory |" \
    "compiled step | time to first step | profile |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
} >> "$RESULTS"
echo "appended to $RESULTS:" >&2
tail -n $((${#ROWS[@]} + 2)) "$RESULTS"
if [[ -n $PEERED ]]; then
  # Both sides' peaks, then the ratio of their last windows' tokens/s: jaxscale's / the peer's.
  "$PYTHON" - "$WORKDIR/$PEERED" <<'PY'
import json, os, sys
folder = sys.argv[1]
metrics, log = os.path.join(folder, "metrics.jsonl"), os.path.join(folder, "peer.log")
train = [json.loads(l) for l in open(metrics) if l.strip()] if os.path.exists(metrics) else []
train = [l for l in train if "tokens_per_sec" in l]
peer = [json.loads(l[len("peer: "):]) for l in open(log) if l.startswith("peer: ")]
if not train or not peer:
    print("ratio: n/a (a side failed; see the table)")
    sys.exit(1)
ours, peer = train[-1], peer[-1]
gib = lambda v: "n/a" if v is None else f"{v:.1f} GiB"
print(f"jaxscale: {ours['tokens_per_sec']:,.0f} tokens/s, peak "
      f"{gib(ours.get('memory_peak_gib'))}; the PyTorch peer: {peer['tokens_per_sec']:,.0f} "
      f"tokens/s, peak {gib(peer['memory_peak_gib'])}")
print(f"ratio: {ours['tokens_per_sec'] / peer['tokens_per_sec']:.4f}")
PY
fi
