#!/usr/bin/env bash
# Train jaxscale on a Cloud TPU VM slice (or several: multi-slice), through queued resources.
#
#   deploy/tpu/tpu.sh up --name=run1 --zone=us-east5-a --accelerator_type=v5p-16 [--slices=2] \
#       [--spot] [--dry_run] -- --config=configs/tiny.py --workdir=runs/run1 \
#       --config.checkpoint.dir=gs://BUCKET/run1
#
# Commands:
#   create   ask for the slice(s) as a queued resource and wait until it is ACTIVE
#   install  copy this checkout to every worker and install it with jax[tpu] (Python 3.11 venv)
#   run      start `python -m jaxscale.train ARGS` on every worker of every slice (under
#            jaxscale.supervise, which restarts it after a maintenance event), then stream logs
#   logs     stream the logs of every worker (prefixed by host name)
#   status   show the queued resource's state
#   delete   delete the queued resource and its slices
#   up       create, install, run
#
# Flags:
#   --name=NAME               the queued resource's and slice's name (required)
#   --zone=ZONE               the zone of the TPUs, e.g. us-east5-a (required)
#   --project=PROJECT         the Google Cloud project (default: gcloud's configured one)
#   --accelerator_type=TYPE   the slice type, e.g. v5p-16 (required by create, up)
#   --runtime_version=IMAGE   the TPU software image (default: chosen from the accelerator type)
#   --slices=N                slices joined over the data-centre network (default 1)
#   --source=DIR              the checkout that install copies to the workers (default: this one)
#   --spot                    ask for spot slices, which can be reclaimed at any time
#   --dry_run                 print every gcloud command instead of running it
#   --help                    print this help
#
# Multi-slice: --slices=N gives N slices joined over the data-centre network; set the config's
# mesh.dcn.* factors to multiply to N (e.g. --config.mesh.dcn.data=N). The TPU runtime tells every
# worker its slice; jaxscale.runtime.distributed then finds all processes without further flags.
# Spot slices (--spot) can be reclaimed at any time: a preempted run saves a checkpoint to the
# checkpoint.dir bucket, and `delete` then `up` with the same flags resumes it (docs/launch.md).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
}

die() {
  echo "error: $*" >&2
  exit 2
}

NAME="" ZONE="" PROJECT="" ACCELERATOR_TYPE="" RUNTIME_VERSION="" SLICES=1 SPOT=0 DRY_RUN=0
SOURCE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
REMOTE_DIR="jaxscale"  # under each worker's home
LOG_FILE="jaxscale-train.log"
TRAIN_ARGS=()

COMMAND="${1:-}"
case "$COMMAND" in
  --help | -h | help) usage ;;
  "") die "no command; use create, install, run, logs, status, delete or up (see $0 --help)" ;;
  create | install | run | logs | status | delete | up) ;;
  *) die "unknown command '$COMMAND'; use create, install, run, logs, status, delete or up" \
    "(see $0 --help)" ;;
esac
shift
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name=*) NAME="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --accelerator_type=*) ACCELERATOR_TYPE="${1#*=}" ;;
    --runtime_version=*) RUNTIME_VERSION="${1#*=}" ;;
    --slices=*) SLICES="${1#*=}" ;;
    --source=*) SOURCE_DIR="${1#*=}" ;;
    --spot) SPOT=1 ;;
    --dry_run) DRY_RUN=1 ;;
    --help | -h) usage ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) die "unknown flag $1 (see $0 --help)" ;;
  esac
  shift
done

[[ -n "$NAME" ]] || die "--name=NAME is required (the queued resource and slice name)"
[[ -n "$ZONE" ]] || die "--zone=ZONE is required, e.g. --zone=us-east5-a"
[[ "$SLICES" =~ ^[1-9][0-9]*$ ]] || die "--slices=$SLICES must be a whole number >= 1"

# The software image each TPU generation boots; --runtime_version overrides.
default_runtime_version() {
  case "$1" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "no default --runtime_version for --accelerator_type=$1; pass one" ;;
  esac
}

# Every gcloud call goes through here, so that --dry_run shows exactly what would run.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

GCLOUD_FLAGS=(--zone="$ZONE")
[[ -z "$PROJECT" ]] || GCLOUD_FLAGS+=(--project="$PROJECT")

# Slice names: one slice is NAME; several are NAME-0 .. NAME-(N-1) (the queued resource's prefix).
slice_names() {
  if [[ "$SLICES" == 1 ]]; then
    echo "$NAME"
  else
    for ((i = 0; i < SLICES; i++)); do echo "$NAME-$i"; done
  fi
}

# Runs a shell command on every worker of every slice, all at once; fails if any of them fails.
on_all_workers() {
  local pids=() slice
  for slice in $(slice_names); do
    if [[ "$DRY_RUN" == 1 ]]; then
      run gcloud compute tpus tpu-vm ssh "$slice" "${GCLOUD_FLAGS[@]}" --worker=all --command="$1"
    else
      run gcloud compute tpus tpu-vm ssh "$slice" "${GCLOUD_FLAGS[@]}" --worker=all \
        --command="$1" &
      pids+=($!)
    fi
  done
  local pid status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  return "$status"
}

# JAX devices (chips) in one slice: v4 and v5p types count TensorCores, two per chip.
devices_per_slice() {
  local count="${ACCELERATOR_TYPE##*-}"
  [[ "$count" =~ ^[0-9]+$ ]] || die "cannot read the size of --accelerator_type=$ACCELERATOR_TYPE"
  case "$ACCELERATOR_TYPE" in
    v4-* | v5p-*) echo $((count / 2)) ;;
    *) echo "$count" ;;
  esac
}

# Fails (exit 2) before anything is created if the config's mesh does not fit the slices.
check_config() {
  [[ -n "$ACCELERATOR_TYPE" ]] || die "--accelerator_type is required, e.g. v5p-16"
  [[ ${#TRAIN_ARGS[@]} -gt 0 ]] || die "pass the training flags after --, e.g. -- --config=configs/tiny.py --workdir=runs/$NAME --config.checkpoint.dir=gs://BUCKET/$NAME"
  python3 -m jaxscale.launch.fit --devices=$(($(devices_per_slice) * SLICES)) \
    --granules="$SLICES" -- "${TRAIN_ARGS[@]}"
}

cmd_create() {
  [[ -n "$ACCELERATOR_TYPE" ]] || die "--accelerator_type is required, e.g. v5p-16"
  local runtime="${RUNTIME_VERSION:-$(default_runtime_version "$ACCELERATOR_TYPE")}"
  local args=(gcloud compute tpus queued-resources create "$NAME" "${GCLOUD_FLAGS[@]}"
    --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$runtime")
  if [[ "$SLICES" == 1 ]]; then
    args+=(--node-id="$NAME")
  else
    args+=(--node-count="$SLICES" --node-prefix="$NAME")
  fi
  [[ "$SPOT" == 0 ]] || args+=(--spot)
  run "${args[@]}"
  wait_until_active
}

wait_until_active() {
  local describe=(gcloud compute tpus queued-resources describe "$NAME" "${GCLOUD_FLAGS[@]}"
    --format="value(state.state)")
  if [[ "$DRY_RUN" == 1 ]]; then
    run "${describe[@]}"
    return
  fi
  local state
  while true; do
    state="$("${describe[@]}")"
    echo "queued resource $NAME: $state" >&2
    case "$state" in
      ACTIVE) return ;;
      FAILED | SUSPENDED) die "queued resource $NAME is $state; see: gcloud compute tpus queued-resources describe $NAME --zone=$ZONE" ;;
    esac
    sleep 30
  done
}

cmd_install() {
  local archive="/tmp/jaxscale-$NAME.tar.gz" slice
  run tar -czf "$archive" -C "$SOURCE_DIR" --exclude=.git --exclude=runs --exclude='*.egg-info' .
  for slice in $(slice_names); do
    run gcloud compute tpus tpu-vm scp "$archive" "$slice:jaxscale.tar.gz" "${GCLOUD_FLAGS[@]}" \
      --worker=all
  done
  # TPU VM images ship Python 3.10; uv fetches a 3.11 for jaxscale's venv.
  on_all_workers "set -e; rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && \
tar -xzf ~/jaxscale.tar.gz -C ~/$REMOTE_DIR && python3 -m pip install --user --quiet uv && \
~/.local/bin/uv venv --quiet --python 3.11 ~/$REMOTE_DIR/.venv && \
~/.local/bin/uv pip install --quiet --python ~/$REMOTE_DIR/.venv/bin/python -e ~/$REMOTE_DIR 'jax[tpu]' gcsfs"
}

cmd_run() {
  [[ -z "$ACCELERATOR_TYPE" ]] || check_config
  start_training
  cmd_logs
}

start_training() {
  [[ ${#TRAIN_ARGS[@]} -gt 0 ]] || die "pass the training flags after --, e.g. -- --config=configs/tiny.py --workdir=runs/$NAME --config.checkpoint.dir=gs://BUCKET/$NAME"
  local quoted
  quoted="$(printf '%q ' "${TRAIN_ARGS[@]}")"
  # nohup: the run outlives this terminal; `logs` reattaches to it. supervise restarts the run on
  # its worker after a maintenance event (exit 42), a transient failure (75) or a crash; the
  # workers then meet again. The host name is the worker's slot: its local checkpoints' folder
  # (docs/checkpointing.md), the same whatever id JAX gives it.
  on_all_workers "cd ~/$REMOTE_DIR && JAXSCALE_HOST_SLOT=\$(hostname) nohup \
.venv/bin/python -m jaxscale.supervise -- \
.venv/bin/python -m jaxscale.train $quoted > ~/$LOG_FILE 2>&1 < /dev/null & \
echo started on \$(hostname)"
}

cmd_logs() {
  on_all_workers "tail -n +1 -F ~/$LOG_FILE | sed -u \"s/^/[\$(hostname)] /\""
}

cmd_status() {
  run gcloud compute tpus queued-resources describe "$NAME" "${GCLOUD_FLAGS[@]}"
}

cmd_delete() {
  # --force also deletes the slices the queued resource created.
  run gcloud compute tpus queued-resources delete "$NAME" "${GCLOUD_FLAGS[@]}" --force --quiet
}

case "$COMMAND" in
  create) cmd_create ;;
  install) cmd_install ;;
  run) cmd_run ;;
  logs) cmd_logs ;;
  status) cmd_status ;;
  delete) cmd_delete ;;
  up) check_config; cmd_create; cmd_install; start_training; cmd_logs ;;
esac
