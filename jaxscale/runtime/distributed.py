"""Joining the processes of a multi-host run: which cluster we are in, and `jax.distributed` init.

`detect` reads the environment only (tests call it with fake ones) and picks one mode:

- explicit: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, all three;
- tpu: GKE TPU pods (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, MEGASCALE_* for multi-slice), or TPU
  chips on a Cloud TPU VM, where JAX asks the metadata server;
- gke: JobSet pods rendered by `jaxscale.launch.gke` (JOBSET_NAME ...): the coordinator is the first
  pod's stable DNS name, the process id the job index and the pod's completion index;
- slurm: an srun step (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_PROCID, ...);
- single: none of these.

`initialize` then meets every peer at a small TCP rendezvous on the coordinator's own port
(runtime/rendezvous.py), before `jax.distributed.initialize` binds that port: JAX's start-up, when
a peer never arrives, aborts every process after its timeout without saying who is missing.
With JAXSCALE_MIN_PROCESSES (an elastic host range, every launcher: the count is the range's
maximum) the run starts with those that came by the deadline, at least that many, numbered 0..n-1.

Once running, JAX's processes share fate: when one dies (or the coordinator goes away, or a peer
restarts), JAX's distributed runtime aborts every other one from C++ (SIGABRT, which no Python
code can catch) within the heartbeat timeout. `guard` says what that is, a transient failure: a
multi-process `jaxscale.train` runs the trainer as its child, and exits 75 (start every process
again; they resume from the last checkpoint) when JAX aborted the child so.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from jaxscale.cli import fail_with
from jaxscale.config import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_INIT_TIMEOUT_S
from jaxscale.errors import RESTART_EXIT_CODE, JaxscaleError, TransientError
from jaxscale.runtime.rendezvous import RunStarted, Spare, rendezvous
from jaxscale.runtime.tpu_host import is_tpu_vm

# Fixed ports where no scheduler hands one out; every process must compute the same one.
GKE_COORDINATOR_PORT = 8476
TPU_COORDINATOR_PORT = 8482  # the port JAX itself uses on TPU pods

EXPLICIT_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
GKE_VARS = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "REPLICATED_JOB_REPLICAS", "JOB_INDEX",
            "PROCESSES_IN_JOB", "JOB_COMPLETION_INDEX")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """How this process joins the run; `None` fields are left for JAX to find (Cloud TPU VMs)."""
    mode: str
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    # Devices this process drives; None means all it sees (one process per host).
    local_device_ids: tuple[int, ...] | None = None

    def describe(self) -> str:
        if self.mode == "single":
            return "single process"
        if self.num_processes is None:
            return f"{self.mode}: processes and coordinator discovered by JAX"
        return (f"{self.mode}: {self.num_processes} processes, coordinator "
                f"{self.coordinator_address}")

    def announce(self) -> None:
        """Prints how the run joined, next to the trainer's own start-up lines."""
        print(f"jaxscale: distributed mode {self.describe()}", flush=True)


def detect(environ: Mapping[str, str], *, on_cloud_tpu_vm: bool = False) -> ClusterSpec:
    """The cluster this process runs in, from its environment.

    `on_cloud_tpu_vm` says TPU chips are attached (a hardware fact, not in the environment).
    Raises JaxscaleError when the environment is incomplete or contradicts itself.
    """
    schedulers = {}
    if "TPU_WORKER_HOSTNAMES" in environ or on_cloud_tpu_vm:
        schedulers["tpu"] = _tpu(environ)
    if "JOBSET_NAME" in environ:
        schedulers["gke"] = _gke(environ)
    if "SLURM_JOB_ID" in environ and "SLURM_STEP_NODELIST" in environ:
        schedulers["slurm"] = _slurm(environ)
    if "slurm" in schedulers and len(schedulers) > 1:
        other = sorted(set(schedulers) - {"slurm"})[0]
        raise JaxscaleError(
            f"the environment looks like both a Slurm step (SLURM_JOB_ID) and {other} "
            f"({_marker(other)}); unset the variables of the one this job does not run under")
    detected = schedulers.get("tpu") or schedulers.get("gke") or schedulers.get("slurm")
    if "tpu" in schedulers and "gke" in schedulers and detected.coordinator_address:
        # A GKE TPU pod is also a JobSet pod: the TPU runtime's worker list orders the processes,
        # and JobSet's stable name for pod 0 of job 0 (worker 0 of slice 0) is the coordinator.
        host = schedulers["gke"].coordinator_address.rsplit(":", 1)[0]
        port = detected.coordinator_address.rsplit(":", 1)[1]
        detected = dataclasses.replace(detected, coordinator_address=f"{host}:{port}")

    if any(v in environ for v in EXPLICIT_VARS):
        explicit = _explicit(environ)
        if detected is not None:
            _check_agreement(explicit, detected)
        return explicit
    return detected or ClusterSpec("single", None, 1, 0)


def _marker(mode: str) -> str:
    return {"tpu": "TPU_WORKER_HOSTNAMES or TPU chips", "gke": "JOBSET_NAME"}[mode]


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise JaxscaleError(f"{name}={environ[name]!r} must be an integer") from None


MIN_PROCESSES_VAR = "JAXSCALE_MIN_PROCESSES"
# An elastic range's maximum: the count the config's batch layout is for (jaxscale/training/
# elastic.py fits it to fewer). Set by the launcher; the process count when unset.
MAX_PROCESSES_VAR = "JAXSCALE_MAX_PROCESSES"
# A process's place that outlives its id: an elastic restart renumbers the survivors 0..n-1, and
# each must find the local checkpoints it saved under its old id (checkpoint/manager.py). Set by
# the launcher to the slot's first id; the process id when unset (ids that never change).
HOST_SLOT_VAR = "JAXSCALE_HOST_SLOT"
# The devices each process drives, known to the launcher before JAX starts: with it, an elastic
# start leaves no host all idle (its processes beyond the largest count that runs are spares).
DEVICES_PER_PROCESS_VAR = "JAXSCALE_DEVICES_PER_PROCESS"


def host_slot(environ: Mapping[str, str], process_id: int) -> str:
    """This process's slot (HOST_SLOT_VAR, else `process_id`): a name for a folder."""
    slot = environ.get(HOST_SLOT_VAR, str(process_id))
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", slot) or slot in (".", ".."):
        raise JaxscaleError(f"{HOST_SLOT_VAR}={slot!r} is not a folder name; set it to letters, "
                            "digits, '_', '-' or '.' (the host's name, or its first process id)")
    return slot


def max_processes(environ: Mapping[str, str], process_count: int) -> int:
    """The count the run is written for (MAX_PROCESSES_VAR, an elastic range's maximum), else
    `process_count`; a run with fewer is narrow, and a later start may take hosts back."""
    if MAX_PROCESSES_VAR not in environ:
        return process_count
    maximum = _int(environ, MAX_PROCESSES_VAR)
    if maximum < process_count:
        raise JaxscaleError(f"{MAX_PROCESSES_VAR}={maximum} is below the {process_count} "
                            "processes running; set it to the range's maximum (at least "
                            f"{process_count}), or unset it")
    return maximum


def min_processes(environ: Mapping[str, str], spec: ClusterSpec) -> int:
    """The fewest processes the run starts with (an elastic range's minimum); all by default."""
    if MIN_PROCESSES_VAR not in environ:
        return spec.num_processes
    minimum = _int(environ, MIN_PROCESSES_VAR)
    if not 1 <= minimum <= spec.num_processes:
        raise JaxscaleError(f"{MIN_PROCESSES_VAR}={minimum} is outside 1..{spec.num_processes} "
                            f"for {spec.num_processes} processes; pass a minimum within the count")
    return minimum


def _require(environ: Mapping[str, str], names: tuple[str, ...], what: str, fix: str) -> None:
    missing = [n for n in names if n not in environ]
    if missing:
        raise JaxscaleError(f"{what}, but {', '.join(missing)} "
                            f"{'is' if len(missing) == 1 else 'are'} not set; {fix}")


def _checked(spec: ClusterSpec, id_name: str) -> ClusterSpec:
    if spec.num_processes < 1:
        raise JaxscaleError(f"{spec.mode}: the process count {spec.num_processes} must be >= 1")
    if not 0 <= spec.process_id < spec.num_processes:
        raise JaxscaleError(f"{spec.mode}: {id_name} gives process id {spec.process_id}, outside "
                            f"0..{spec.num_processes - 1} for {spec.num_processes} processes")
    return spec


def _explicit(environ: Mapping[str, str]) -> ClusterSpec:
    set_vars = [v for v in EXPLICIT_VARS if v in environ]
    _require(environ, EXPLICIT_VARS, f"{', '.join(set_vars)} set",
             "set all three (coordinator host:port, process count, this process's id) or none")
    address = environ["JAX_COORDINATOR_ADDRESS"]
    if not re.fullmatch(r".+:\d+", address):
        raise JaxscaleError(f"JAX_COORDINATOR_ADDRESS={address!r} must be host:port")
    spec = ClusterSpec("explicit", address, _int(environ, "JAX_NUM_PROCESSES"),
                       _int(environ, "JAX_PROCESS_ID"))
    return _checked(spec, "JAX_PROCESS_ID")


def _check_agreement(explicit: ClusterSpec, detected: ClusterSpec) -> None:
    """Explicit variables may override a scheduler's answer only where they agree with it."""
    for field, var in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
        want, have = getattr(detected, field), getattr(explicit, field)
        if want is not None and want != have:
            raise JaxscaleError(
                f"{var}={have} contradicts the {detected.mode} environment, which gives "
                f"{field.replace('_', ' ')} {want}; unset the JAX_* variables or make them agree")


def _tpu(environ: Mapping[str, str]) -> ClusterSpec:
    if "TPU_WORKER_HOSTNAMES" not in environ:  # a Cloud TPU VM: the metadata server knows
        return ClusterSpec("tpu", None, None, None)
    _require(environ, ("TPU_WORKER_ID",), "TPU_WORKER_HOSTNAMES is set",
             "GKE sets both on TPU pods; set TPU_WORKER_ID to this host's index in the list")
    workers = environ["TPU_WORKER_HOSTNAMES"].split(",")
    slices = _int(environ, "MEGASCALE_NUM_SLICES") if "MEGASCALE_NUM_SLICES" in environ else 1
    slice_id = _int(environ, "MEGASCALE_SLICE_ID") if "MEGASCALE_SLICE_ID" in environ else 0
    worker_id = _int(environ, "TPU_WORKER_ID")
    if not 0 <= worker_id < len(workers):
        raise JaxscaleError(f"TPU_WORKER_ID={worker_id} is outside the {len(workers)} hosts of "
                            "TPU_WORKER_HOSTNAMES")
    # Across slices process 0 is worker 0 of slice 0, which MEGASCALE_COORDINATOR_ADDRESS names;
    # TPU_WORKER_HOSTNAMES lists only this slice's hosts.
    if (slices > 1 and "MEGASCALE_COORDINATOR_ADDRESS" not in environ
            and "JOBSET_NAME" not in environ):
        raise JaxscaleError(f"MEGASCALE_NUM_SLICES={slices} but MEGASCALE_COORDINATOR_ADDRESS is "
                            "not set; set it to the host of worker 0 of slice 0")
    host = environ.get("MEGASCALE_COORDINATOR_ADDRESS", workers[0]).split(":")[0]
    port = environ.get("JAX_COORDINATOR_PORT", TPU_COORDINATOR_PORT)
    spec = ClusterSpec("tpu", f"{host}:{port}", len(workers) * slices,
                       slice_id * len(workers) + worker_id)
    return _checked(spec, "MEGASCALE_SLICE_ID/TPU_WORKER_ID")


def _gke(environ: Mapping[str, str]) -> ClusterSpec:
    _require(environ, GKE_VARS, "JOBSET_NAME is set (a JobSet pod)",
             "render the JobSet with `python -m jaxscale.launch.gke`, which sets them")
    jobset, rjob = environ["JOBSET_NAME"], environ["REPLICATED_JOB_NAME"]
    per_job = _int(environ, "PROCESSES_IN_JOB")
    # JobSet gives pod <jobset>-<replicated job>-<job index>-<pod index> a DNS name under the
    # subdomain <jobset>; pod 0 of job 0 exists in every run and keeps its name across restarts.
    port = environ.get("JAX_COORDINATOR_PORT", GKE_COORDINATOR_PORT)
    spec = ClusterSpec(
        "gke", f"{jobset}-{rjob}-0-0.{jobset}:{port}",
        per_job * _int(environ, "REPLICATED_JOB_REPLICAS"),
        _int(environ, "JOB_INDEX") * per_job + _int(environ, "JOB_COMPLETION_INDEX"))
    return _checked(spec, "JOB_INDEX/JOB_COMPLETION_INDEX")


def _slurm(environ: Mapping[str, str]) -> ClusterSpec:
    _require(environ, ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
             "this is a Slurm step (SLURM_STEP_NODELIST)", "start the processes with srun")
    # Every process derives the same port from the job id.
    port = environ.get("JAX_COORDINATOR_PORT", 61440 + _int(environ, "SLURM_JOB_ID") % 4095)
    nodes = _int(environ, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in environ else 1
    tasks = _int(environ, "SLURM_NTASKS")
    # More tasks than nodes means one process per accelerator: each drives the device of its
    # node-local rank. One task per node drives them all.
    local = (_int(environ, "SLURM_LOCALID"),) if tasks > nodes else None
    spec = ClusterSpec("slurm", f"{first_slurm_host(environ['SLURM_STEP_NODELIST'])}:{port}",
                       tasks, _int(environ, "SLURM_PROCID"), local)
    return _checked(spec, "SLURM_PROCID")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[003-007,9],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)
    if not match:
        raise JaxscaleError(f"cannot read the Slurm node list {nodelist!r}")
    return match.group(1) + (match.group(2) or "")


# --- initialisation ------------------------------------------------------------------------------

_joined: ClusterSpec | None = None


def detect_here() -> ClusterSpec:
    """The cluster this process runs in: `detect` on its environment and its hardware."""
    return detect(os.environ, on_cloud_tpu_vm=is_tpu_vm())


def initialize(timeout_s: float | None = None,
               heartbeat_timeout_s: float | None = None,
               checkpoint_dir: str | None = None,
               runs_on: Callable[[int, int, int], bool] | None = None) -> ClusterSpec:
    """Joins this process to the run's other processes and returns how; call it before any JAX
    device use. Idempotent; process 0 of a multi-process run prints the mode.

    `timeout_s` bounds the wait for every peer to arrive (default 300 s); `heartbeat_timeout_s` is
    how long a silent peer is tolerated before every process stops (default 100 s); JAX counts
    both in whole seconds. Raises TransientError naming the processes that did not arrive or the
    coordinator that could not be reached, JaxscaleError when the environment is wrong.

    In an elastic range, a process that arrives after the others started without it writes its
    arrival marker in `checkpoint_dir` (runtime/arrivals.py) and tries again until the timeout:
    the run saves, restarts and admits it at its next rendezvous. `runs_on(processes, devices per
    process, full processes)` (checks.runs_on, given DEVICES_PER_PROCESS_VAR): whether the
    run runs on that count; the rendezvous starts the largest that does, and a process left out
    waits as a late one does.
    """
    global _joined, _full_count, _in_range, _runs_on
    if _joined is not None:
        return _joined
    spec = detect_here()
    if spec.mode == "single":  # nothing to join, nothing worth a line of output
        _joined = spec
        return spec
    import jax

    # Cross-process collectives between CPU devices need gloo; it must be chosen before the CPU
    # backend starts, and changes nothing for accelerators.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    deadline = time.monotonic() + (timeout_s or DEFAULT_INIT_TIMEOUT_S)
    if spec.coordinator_address is not None:
        # An elastic range starts with those that came (ids 0..n-1), at least the minimum.
        _full_count = max_processes(os.environ, spec.num_processes)
        _in_range = min_processes(os.environ, spec) < _full_count
        if _in_range and runs_on is not None and DEVICES_PER_PROCESS_VAR in os.environ:
            per, full = _int(os.environ, DEVICES_PER_PROCESS_VAR), _full_count
            _runs_on = functools.cache(lambda count: runs_on(count, per, full))
        process_id, num_processes = _admitted(spec, deadline, checkpoint_dir)
        spec = dataclasses.replace(spec, process_id=process_id, num_processes=num_processes)
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        # Our detection is the single source of truth; JAX's would e.g. give a one-process-per-node
        # Slurm job a single GPU per node. Only a Cloud TPU VM is left to JAX (metadata server).
        cluster_detection_method=None if spec.coordinator_address is None else "deactivate",
        initialization_timeout=max(1, math.ceil(deadline - time.monotonic())),
        heartbeat_timeout_seconds=math.ceil(heartbeat_timeout_s or DEFAULT_HEARTBEAT_TIMEOUT_S))
    _joined = spec
    # Not jax.process_index(): that would start the backend before the trainer configures it. On a
    # Cloud TPU VM the id is JAX's to find, so every worker announces.
    if spec.process_id in (0, None):
        spec.announce()
    return spec


# Seconds between a late process's tries at the rendezvous: a restart's rendezvous waits for
# every process of the range until its deadline, so a try every few seconds is soon enough.
LATE_RETRY_S = 2.0
_full_count: int | None = None  # the processes of a full start (an elastic range's maximum)
_in_range = False  # whether the run has a host range: a minimum below its full count


def _every_count(count: int) -> bool:
    return True


_runs_on: Callable[[int], bool] = _every_count  # whether the run runs on `count` processes


def elastic() -> bool:
    """Whether this run has a host range (it may run on fewer processes than its full count)."""
    return _in_range


def narrower() -> bool:
    """Whether this run started with fewer processes than its full count (an elastic run that
    has lost some, and would take them back)."""
    return _joined is not None and _full_count is not None and _joined.num_processes < _full_count


def widens(arrived: int) -> bool:
    """Whether `arrived` more processes would let the run restart wider than it runs: a count
    above this one, up to the full count, runs (not every count does: spares)."""
    now = _joined.num_processes
    return any(_runs_on(count) for count in range(now + 1, min(now + arrived, _full_count) + 1))


def _admitted(spec: ClusterSpec, deadline: float, checkpoint_dir: str | None) -> tuple[int, int]:
    """`rendezvous`, tried again by a process that arrived late in an elastic range after it has
    announced itself (module docstring of runtime/arrivals.py)."""
    from jaxscale.runtime import arrivals  # its storage libraries only where a process is late

    minimum = min_processes(os.environ, spec)
    # The fewest that come is a count that runs: below it, wait on as below the range's minimum.
    runnable = [count for count in range(minimum, spec.num_processes + 1) if _runs_on(count)]
    if not runnable:
        raise JaxscaleError(
            f"on no count of processes from {minimum} to {spec.num_processes} does the run leave "
            "every host a device to run on; pass a train.batch_size that the range's minimum "
            "runs (python -m jaxscale.launch.fit names one), or change the minimum")
    told = False  # a spare says so once, whether its marker is new or not
    while True:
        try:
            return rendezvous(spec, deadline, runnable[0], _runs_on)
        except RunStarted as late:
            if checkpoint_dir is None or minimum == spec.num_processes:
                raise TransientError(f"{late}; stop every process and start them all again, or "
                                     "give the run a range (JAXSCALE_MIN_PROCESSES)") from None
            marker = arrivals.announce(checkpoint_dir, host_slot(os.environ, spec.process_id))
            if marker or (isinstance(late, Spare) and not told):
                where = f"announced at {marker}" if marker else "its arrival marker is there"
                print(f"jaxscale: elastic: {late}; {where}, waiting to be taken back", flush=True)
                told = True
            if time.monotonic() + LATE_RETRY_S >= deadline:
                raise TransientError(f"{late}, and was not taken back before the timeout; start "
                                     "it again (exit 75)") from None
            time.sleep(LATE_RETRY_S)


# --- the guard: a lost peer is a transient failure -----------------------------------------------

# What JAX's distributed runtime client logs just before it aborts the process (SIGABRT) when the
# coordination service reports a fatal error: a peer stopped sending heartbeats, the coordinator
# went away, a peer restarted. The same words in jax 0.10.2 and in JAX's sources of 2026 (its
# docs/fault_tolerance.rst quotes them). JAX leaves Python no way to act instead:
# `jax.distributed.initialize` takes no callback, and a Python `missed_heartbeat_callback` handed
# to jaxlib's (private) client ends in `std::bad_cast` on jaxlib 0.10.2.
JAX_FATAL_LINE = b"Terminating process because the JAX distributed service detected fatal errors"
# In the guarded child's environment: it runs the work, not another guard.
GUARDED_ENV = "JAXSCALE_GUARDED"


def needs_guard(spec: ClusterSpec) -> bool:
    """Whether this process should run its work under `guard`: it joins other processes, and it is
    not the guarded child already."""
    return spec.mode != "single" and GUARDED_ENV not in os.environ


def guard(command: list[str], spec: ClusterSpec) -> int:
    """Runs `command` (this process's own work) as a child and returns its exit status; a child
    killed by a signal kills this process with the same signal. Raises TransientError when JAX
    aborted the child because the run lost a process: JAX's abort report (its fatal line, the
    status, a C++ stack trace) becomes that one error.

    The child stays in this process group, so a Ctrl-C (a terminal's, or a launcher's killpg)
    reaches it directly; a SIGTERM sent to this process alone (Kubernetes signals a container's
    first process) is passed on. On Linux the kernel kills the child when this process dies: a
    `kill -9` of this process leaves no trainer running on its own.
    """
    die_with_parent = None
    if sys.platform == "linux":
        # prctl(PR_SET_PDEATHSIG, SIGKILL), run in the child between fork and exec. The library
        # is looked up here, before the fork: a dlopen in the child could wait forever on a lock
        # another thread held when the process forked.
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        die_with_parent = lambda: prctl(1, signal.SIGKILL)  # noqa: E731
    child = subprocess.Popen(command, env={**os.environ, GUARDED_ENV: "1"},
                             stderr=subprocess.PIPE, preexec_fn=die_with_parent)
    forwarded = []  # the SIGTERMs passed on

    def pass_on(signum, frame) -> None:
        forwarded.append(signum)
        child.send_signal(signum)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, pass_on),
                signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: None)}
    report: list[bytes] = []  # JAX's fatal line and everything after it
    try:
        for line in child.stderr:
            if report or JAX_FATAL_LINE in line:
                report.append(line)
            else:
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if report:
        who = "this process" if spec.process_id is None else f"process {spec.process_id}"
        raise TransientError(
            f"{who} stopped: JAX's distributed service reported {_status(report)}; the run lost "
            "a process or its coordinator: start every process again to resume from the last "
            "checkpoint")
    if status == -signal.SIGTERM and forwarded:
        # The SIGTERM came before the trainer could catch it (it was still importing): nothing
        # was saved since the last checkpoint, and a restart resumes from it, as after a save.
        print("preempted before training started: exiting to be restarted", file=sys.stderr,
              flush=True)
        return RESTART_EXIT_CODE
    if status < 0:
        if -status != signal.SIGKILL:  # SIGKILL's action cannot be set; it is the default
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


# How a cross-process collective on CPU (gloo) fails when a peer's process is gone: its socket
# closed or reset ("Gloo AllGather failed: [...pair.cc:547] Connection closed by peer
# [127.0.0.1]:5777", "Gloo all-reduce failed: [...pair.cc:538] Read error [127.0.0.1]:31624:
# Connection reset by peer": an all-reduce's name has a hyphen).
_GLOO_LOST_PEER = re.compile(r"Gloo [\w-]+ failed: (?:\[[^\]]*\] )?(.*)")


def lost_peer(error: Exception, process_id: int) -> TransientError | None:
    """The error process `process_id` stops with when `error` (a JaxRuntimeError) says a
    collective lost its peer (a process killed, its host gone): the peer's words, which name its
    address; None for any other error. Seen at once, in the next collective, where JAX's own
    verdict (the guard's) waits for the heartbeat timeout."""
    match = _GLOO_LOST_PEER.search(str(error))
    if match is None:
        return None
    return TransientError(
        f"process {process_id} lost a peer in a collective ({match.group(1).strip()}); the run "
        "lost a process or its host: start every process again to resume from the last "
        "checkpoint")


def exit_if_peer_lost(error: Exception) -> None:
    """Exits 75 at once (os._exit, its `error:` line said) when `error` says a collective lost its
    peer; returns otherwise. At once: a clean exit would wait for the lost peer, in JAX's shutdown
    or in an asynchronous save's barrier, until their timeouts. A peer that announced its failure
    before it went (runtime/agreement.py) is gone by its own choice: its failure is the line."""
    import jax

    from jaxscale.runtime import agreement

    if jax.process_count() > 1 and (lost := lost_peer(error, jax.process_index())) is not None:
        fail_with(agreement.announced_elsewhere() or lost, exit=os._exit)


@contextlib.contextmanager
def lost_peer_exits_at_once():
    """A lost peer seen in the block exits the process before anything the block's callers hold
    is closed. Entered inside the trainer's checkpoint managers: closing them waits for a save in
    flight, whose barrier needs the lost peer, and while this survivor waits there, the survivors
    blocked in a collective with it see no closed socket and wait too (4 processes: every
    survivor waited out the launcher's grace; with 2 there is no other survivor). JAX raises
    gloo's failure as a ValueError from some calls (multihost_utils.process_allgather), as a
    JaxRuntimeError (a RuntimeError) from others."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        exit_if_peer_lost(e)
        raise


def _status(report: list[bytes]) -> str:
    """The status in JAX's abort report, on one line: from "absl::Status:" to the blank line that
    comes before the stack trace."""
    text = b"".join(report).decode(errors="replace")
    status = text.split("absl::Status:", 1)[-1].split("\n\n", 1)[0]
    status = status.split("*** Check failure stack trace", 1)[0]
    # Drop the error payloads ("[type.googleapis.com/tensorflow.CoordinationServiceError='']").
    return " ".join(re.sub(r"\[type\.googleapis\.com/[^=\]]*='[^']*'\]", "", status).split())
