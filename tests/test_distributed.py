"""Cluster detection from (fake) environments and a fake sysfs, the rendezvous that names missing
processes, and the guard that turns JAX's abort on a lost peer into exit status 75."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.launch.local import free_port
from jaxscale.runtime import distributed, rendezvous, tpu_host
from jaxscale.runtime.distributed import ClusterSpec, detect, first_slurm_host

SLURM = {  # process 2 of a 4-node, one-process-per-node srun step
    "SLURM_JOB_ID": "12345", "SLURM_STEP_NODELIST": "gpu[003-006]", "SLURM_STEP_NUM_NODES": "4",
    "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
}
GKE = {  # pod 3 of job 1 in a JobSet of 2 jobs x 4 pods, as jaxscale.launch.gke renders it
    "JOBSET_NAME": "run", "REPLICATED_JOB_NAME": "workers", "REPLICATED_JOB_REPLICAS": "2",
    "PROCESSES_IN_JOB": "4", "JOB_INDEX": "1", "JOB_COMPLETION_INDEX": "3",
}
GKE_TPU = {  # host 2 of slice 1 in a 2-slice x 4-host TPU JobSet; GKE adds the TPU_* variables
    **GKE, "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2",
    "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
    "MEGASCALE_COORDINATOR_ADDRESS": "run-workers-0-0.run:8080",
}
EXPLICIT = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
            "JAX_PROCESS_ID": "2"}


def test_no_cluster_is_a_single_process():
    assert detect({"HOME": "/root"}) == ClusterSpec("single", None, 1, 0)


def test_explicit_variables():
    assert detect(EXPLICIT) == ClusterSpec("explicit", "10.0.0.1:1234", 4, 2)


@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID are not set"),
    ({**EXPLICIT, "JAX_PROCESS_ID": "4"}, "outside 0..3"),
    ({**EXPLICIT, "JAX_NUM_PROCESSES": "four"}, "JAX_NUM_PROCESSES='four' must be an integer"),
    ({**EXPLICIT, "JAX_COORDINATOR_ADDRESS": "10.0.0.1"}, "must be host:port"),
])
def test_incomplete_or_bad_explicit_variables_are_named(env, message):
    with pytest.raises(JaxscaleError, match=message):
        detect(env)


def test_slurm_one_process_per_node():
    port = 61440 + 12345 % 4095
    assert detect(SLURM) == ClusterSpec("slurm", f"gpu003:{port}", 4, 2, None)


def test_slurm_one_process_per_gpu_drives_its_local_device():
    env = {**SLURM, "SLURM_NTASKS": "16", "SLURM_PROCID": "13", "SLURM_LOCALID": "5"}
    spec = detect(env)
    assert (spec.num_processes, spec.process_id, spec.local_device_ids) == (16, 13, (5,))


def test_slurm_allocation_outside_an_srun_step_is_a_single_process():
    assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}).mode == "single"


@pytest.mark.parametrize("nodelist, first", [
    ("node001", "node001"), ("node001,host2", "node001"), ("gpu[003-007,9],cpu1", "gpu003"),
    ("a[7,9-11]", "a7"), ("tpu-vm-2", "tpu-vm-2"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_gke_jobset_pod():
    assert detect(GKE) == ClusterSpec("gke", "run-workers-0-0.run:8476", 8, 7)


def test_gke_pod_missing_variables_are_named():
    env = {k: v for k, v in GKE.items() if k != "PROCESSES_IN_JOB"}
    with pytest.raises(JaxscaleError, match="PROCESSES_IN_JOB is not set.*jaxscale.launch.gke"):
        detect(env)


def test_gke_tpu_pod_uses_the_tpu_worker_list():
    assert detect(GKE_TPU) == ClusterSpec("tpu", "run-workers-0-0.run:8482", 8, 6)


def test_gke_multislice_tpu_pod_without_megascale_coordinator_uses_jobset_pod_0():
    env = {k: v for k, v in GKE_TPU.items() if k != "MEGASCALE_COORDINATOR_ADDRESS"}
    env["TPU_WORKER_HOSTNAMES"] = "run-workers-1-0.run,run-workers-1-1.run"  # this slice's hosts
    env["TPU_WORKER_ID"] = "1"
    assert detect(env) == ClusterSpec("tpu", "run-workers-0-0.run:8482", 4, 3)


def test_multislice_tpu_outside_gke_needs_the_megascale_coordinator():
    env = {k: v for k, v in GKE_TPU.items()
           if k not in GKE and k != "MEGASCALE_COORDINATOR_ADDRESS"}
    with pytest.raises(JaxscaleError, match="MEGASCALE_COORDINATOR_ADDRESS is not set"):
        detect(env)


def test_cloud_tpu_vm_is_left_to_jax_metadata_discovery():
    assert detect({}, on_cloud_tpu_vm=True) == ClusterSpec("tpu", None, None, None)


def test_explicit_variables_that_agree_with_the_scheduler_win():
    env = {**SLURM, **EXPLICIT}
    assert detect(env).mode == "explicit"


@pytest.mark.parametrize("env, message", [
    ({**SLURM, **GKE}, "both a Slurm step .* and gke"),
    ({**SLURM, **EXPLICIT, "JAX_NUM_PROCESSES": "8"}, "JAX_NUM_PROCESSES=8 contradicts the slurm"),
    ({**GKE, **EXPLICIT, "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "1"},
     "JAX_PROCESS_ID=1 contradicts the gke"),
    ({**GKE, "JOB_COMPLETION_INDEX": "4"}, "process id 8, outside 0..7"),
])
def test_contradictory_environments_raise(env, message):
    with pytest.raises(JaxscaleError, match=message):
        detect(env)


def test_initialize_without_a_cluster_is_single_and_idempotent(monkeypatch):
    for var in (*distributed.EXPLICIT_VARS, "JOBSET_NAME", "SLURM_JOB_ID",
                "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_joined", None)
    monkeypatch.setattr(distributed, "is_tpu_vm", lambda: False)
    assert distributed.initialize().mode == "single"
    assert distributed.initialize() is distributed.initialize()


# --- TPU chips on the PCI bus ----------------------------------------------------------------


def fake_pci_bus(root, devices: dict[str, tuple[str, str]]) -> str:
    """A sysfs PCI device folder: slot -> (vendor, device), as the kernel writes them."""
    for slot, (vendor, device) in devices.items():
        os.makedirs(root / slot)
        (root / slot / "vendor").write_text(f"{vendor}\n")
        (root / slot / "device").write_text(f"{device}\n")
    return str(root)


def test_tpu_chips_are_counted_and_other_google_devices_are_not(tmp_path):
    bus = fake_pci_bus(tmp_path, {
        "0000:00:04.0": ("0x1ae0", "0x005e"), "0000:00:05.0": ("0x1ae0", "0x005e"),  # TPU v4
        "0000:00:06.0": ("0x1ae0", "0x0042"),  # Google's gVNIC network card, on every GCE VM
        "0000:00:07.0": ("0x8086", "0x005e"),  # another vendor's device with a TPU's number
    })
    assert tpu_host.tpu_chips(bus) == 2


def test_no_pci_bus_in_sysfs_means_no_tpu(tmp_path):
    assert tpu_host.tpu_chips(str(tmp_path / "absent")) == 0


def test_an_unreadable_pci_device_fails_loudly(tmp_path):
    bus = fake_pci_bus(tmp_path, {"0000:00:04.0": ("0x1ae0", "0x0062")})
    os.remove(os.path.join(bus, "0000:00:04.0", "device"))
    with pytest.raises(JaxscaleError, match="cannot read .*0000:00:04.0/device .* to tell whether "
                                            "TPU chips are attached"):
        tpu_host.tpu_chips(bus)


def test_every_tpu_that_jax_knows_is_known_here():
    # jax._src is private, which is why tpu_host copies the list: this test, not a user's run,
    # fails when JAX moves it or adds a TPU generation.
    from jax._src import hardware_utils

    assert set(hardware_utils._TPU_PCI_DEVICE_IDS) <= tpu_host.TPU_PCI_DEVICE_IDS
    assert hardware_utils._GOOGLE_PCI_VENDOR_ID == tpu_host.GOOGLE_PCI_VENDOR_ID


# --- the rendezvous ----------------------------------------------------------------------------


def _run_processes(num_processes: int, ids, timeout_s: float, port: int,
                   claimed_count=None, min_processes=None, runs_on=lambda count: True) -> dict:
    """Runs the rendezvous of processes `ids` in threads; returns id -> (new id, count) or the
    error."""
    results = {}

    def one(process_id):
        count = num_processes if process_id == 0 else claimed_count or num_processes
        spec = ClusterSpec("explicit", f"localhost:{port}", count, process_id)
        try:
            results[process_id] = rendezvous.rendezvous(spec, time.monotonic() + timeout_s,
                                                        min_processes, runs_on)
        except (JaxscaleError, TransientError) as e:
            results[process_id] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_rendezvous_when_everyone_arrives():
    port = free_port()
    assert _run_processes(3, [0, 1, 2], 10, port) == {0: (0, 3), 1: (1, 3), 2: (2, 3)}


def test_an_elastic_rendezvous_admits_those_that_came_when_they_reach_the_minimum():
    """4 at most, 2 at least; 0, 1 and 3 come: they start as 0, 1, 2 of 3 at the deadline."""
    start = time.monotonic()
    results = _run_processes(4, [0, 1, 3], 1.5, free_port(), min_processes=2)
    assert results == {0: (0, 3), 1: (1, 3), 3: (2, 3)}
    assert 1.5 <= time.monotonic() - start < 10  # it waited for process 2 until the deadline


def test_a_rendezvous_starts_the_largest_count_that_runs_and_the_others_are_spares():
    """4 at most, 1 at least, only 1 and 2 run (3 would leave a host all idle): 0, 1, 2 come and
    start as 0 and 1 of 2, at once; 2 is told it is a spare. All 4 come: all 4 start."""
    runs = {1, 2, 4}.__contains__
    start = time.monotonic()
    results = _run_processes(4, [0, 1, 2], 1.5, free_port(), min_processes=1, runs_on=runs)
    assert results[0] == (0, 2) and results[1] == (1, 2), results
    assert isinstance(results[2], rendezvous.Spare)
    assert str(results[2]) == ("process 2 of 4 is a spare: process 0 started the run on 2 of the "
                               "processes that came, since on more a whole host's devices would "
                               "be idle")
    assert time.monotonic() - start < 10
    assert _run_processes(4, [0, 1, 2, 3], 10, free_port(), min_processes=1, runs_on=runs) == {
        0: (0, 4), 1: (1, 4), 2: (2, 4), 3: (3, 4)}


def test_an_elastic_rendezvous_below_its_minimum_names_who_is_missing():
    results = _run_processes(4, [0, 2], 1.5, free_port(), min_processes=3)
    assert all(isinstance(results[i], TransientError) for i in (0, 2)), results
    assert "process(es) [1, 3] never arrived" in str(results[0])
    assert "[1,3] of 4 never arrived" in str(results[2])


def test_rendezvous_names_the_missing_process_instead_of_hanging():
    port = free_port()
    start = time.monotonic()
    results = _run_processes(4, [0, 1, 3], 1.5, port)
    assert time.monotonic() - start < 10
    assert all(isinstance(results[i], TransientError) for i in (0, 1, 3)), results
    assert "process(es) [2] never arrived" in str(results[0])
    for peer in (1, 3):
        assert "[2] of 4 never arrived" in str(results[peer])


def test_rendezvous_names_an_absent_coordinator():
    port = free_port()
    error = _run_processes(2, [1], 1.0, port)[1]
    assert isinstance(error, TransientError)
    assert f"could not reach process 0 (the coordinator) at localhost:{port}" in str(error)


def test_rendezvous_rejects_processes_that_disagree_on_the_count():
    port = free_port()
    results = _run_processes(2, [0, 1], 5, port, claimed_count=3)
    assert isinstance(results[0], JaxscaleError) and isinstance(results[1], JaxscaleError)
    assert "process 1 expects 3 processes but process 0 expects 2" in str(results[0])
    assert "expects 3 processes" in str(results[1])


def _connect_when_listening(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("localhost", port), timeout=1)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the rendezvous never listened"
            time.sleep(0.05)


@pytest.mark.parametrize("stranger_says", [b"", b"GET / HTTP/1.1\r\n\r\n"])
def test_a_silent_or_foreign_connection_holds_up_nobody(stranger_says):
    """A health check or port scanner connects first; the processes still meet at once, long
    before the stranger's connection would time out."""
    port = free_port()
    results = {}
    coordinator = threading.Thread(
        target=lambda: results.update(_run_processes(2, [0], 20, port)))
    coordinator.start()
    with _connect_when_listening(port) as stranger:
        stranger.sendall(stranger_says)
        start = time.monotonic()
        results.update(_run_processes(2, [1], 20, port))
        coordinator.join()
        assert time.monotonic() - start < rendezvous.HELLO_TIMEOUT_S / 2
    assert results == {0: (0, 2), 1: (1, 2)}


@pytest.mark.parametrize("earlier_closed", [True, False])
def test_a_peer_that_came_back_is_welcome(earlier_closed, monkeypatch):
    """Process 1 reported, then was started again while process 0 waited for process 2: its new
    report replaces the earlier one, whether that start's connection closed or (a lost node sends
    no FIN) still looks open; it is not taken for a second process claiming its id."""
    port = free_port()
    results = {}
    hellos_read = threading.Semaphore(0)
    read_hello = rendezvous._read_hello

    def counted(*args):
        read_hello(*args)
        hellos_read.release()
    monkeypatch.setattr(rendezvous, "_read_hello", counted)
    coordinator = threading.Thread(
        target=lambda: results.update(_run_processes(3, [0], 20, port)))
    coordinator.start()
    with _connect_when_listening(port) as first_start:
        first_start.sendall(f"{rendezvous.HELLO} 1 3\n".encode())
        assert hellos_read.acquire(timeout=10)
        if earlier_closed:
            first_start.close()
        # Process 2 only once process 1's new start has been heard: were process 2 first, the
        # earlier start would complete the count, as a live process would.
        second_start = threading.Thread(
            target=lambda: results.update(_run_processes(3, [1], 20, port)))
        second_start.start()
        assert hellos_read.acquire(timeout=10)
        results.update(_run_processes(3, [2], 20, port))
        second_start.join()
        coordinator.join()
        if not earlier_closed:  # told why it is dropped
            assert first_start.recv(1024).startswith(b"error process 1 reported again")
    assert results == {0: (0, 3), 1: (1, 3), 2: (2, 3)}


def test_process_0_listens_where_jax_binds_its_coordinator(monkeypatch):
    port = free_port()
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", f"127.0.0.1:{port}")
    assert _run_processes(2, [0, 1], 10, port) == {0: (0, 2), 1: (1, 2)}
    with rendezvous._listen(f"127.0.0.1:{port}") as server:
        assert server.getsockname() == ("127.0.0.1", port)
    with rendezvous._listen(f"[::]:{port}") as server:  # JAX's default: every interface
        assert server.family == socket.AF_INET6 and server.getsockname()[0] == "::"
    # A kernel without IPv6 (ipv6.disable=1): every IPv4 interface instead.
    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: False)
    with rendezvous._listen(f"[::]:{port}") as server:
        assert server.family == socket.AF_INET and server.getsockname() == ("0.0.0.0", port)


def test_a_coordinator_port_in_use_is_transient():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(TransientError, match=f"cannot listen on the coordinator port {port}"):
            rendezvous._listen(f"[::]:{port}")


# --- the guard ---------------------------------------------------------------------------------

EXPLICIT_1 = ClusterSpec("explicit", "127.0.0.1:1234", 2, 1)
# What jaxlib 0.10.2 writes when the coordination service finds a peer dead, then aborts.
JAX_ABORT = r"""E1124 08:20:34.749765   10373 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1124 08:20:34.749906   10373 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
0
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.

RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
*** Check failure stack trace: ***
    @     0x7f177fa40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_jax_aborting_the_child_for_a_lost_peer_is_transient(capfd):
    child = _python(f"import os, sys; sys.stderr.write({JAX_ABORT!r}); sys.stderr.flush(); "
                    "os.abort()")
    with pytest.raises(TransientError) as raised:
        distributed.guard(child, EXPLICIT_1)
    assert str(raised.value) == (
        "process 1 stopped: JAX's distributed service reported UNAVAILABLE: The following tasks "
        "are unhealthy (stopped sending heartbeats): 0 The tasks have crashed. Check the task "
        "logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug "
        "further.; the run lost a process or its coordinator: start every process again to "
        "resume from the last checkpoint")
    stderr = capfd.readouterr().err
    assert "Polled an error from coordination service" in stderr  # what came before is shown
    assert "Terminating process" not in stderr and "SendToLog" not in stderr


def test_the_guard_exits_as_its_child_does():
    assert distributed.guard(_python("import sys; sys.exit(42)"), EXPLICIT_1) == 42


GUARD = ("import sys; from jaxscale.runtime import distributed\n"
         "spec = distributed.ClusterSpec('explicit', '127.0.0.1:1234', 2, 1)\n"
         "sys.exit(distributed.guard(sys.argv[1:], spec))")


def _guarded(child_code: str) -> subprocess.Popen:
    """A guard process running `child_code`, whose first line of output (stdout) is waited for."""
    guard = subprocess.Popen([*_python(GUARD), *_python(child_code)], stdout=subprocess.PIPE,
                             text=True)
    guard.first_line = guard.stdout.readline()
    return guard


def test_a_sigterm_to_the_guard_reaches_the_child_once():
    guard = _guarded("import signal, sys, time\n"
                     "signal.signal(signal.SIGTERM, lambda *_: (print('TERM'), sys.exit(42)))\n"
                     "print('ready', flush=True); time.sleep(60)")
    guard.send_signal(signal.SIGTERM)
    assert guard.communicate(timeout=30)[0] == "TERM\n"
    assert guard.returncode == 42


def test_a_sigterm_before_the_trainer_catches_it_is_a_preemption():
    """The trainer was still importing (no handler yet) and died of the SIGTERM passed on:
    nothing was lost since the last checkpoint, so the guard asks for a restart (42), not a
    crash's budget."""
    child = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); "
             "print('ready', flush=True); time.sleep(60)")
    guard = subprocess.Popen([*_python(GUARD), *_python(child)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert guard.stdout.readline() == "ready\n"
    guard.send_signal(signal.SIGTERM)
    _, err = guard.communicate(timeout=30)
    assert guard.returncode == 42
    assert "preempted before training started" in err


def test_a_child_killed_by_a_signal_kills_the_guard_with_it():
    guard = _guarded("import os, signal; print('ready', flush=True); "
                     "os.kill(os.getpid(), signal.SIGKILL)")
    assert guard.wait(timeout=30) == -signal.SIGKILL


def test_a_kill_9_of_the_guard_takes_the_child_with_it():
    guard = _guarded("import os, time; print(os.getpid(), flush=True); time.sleep(60)")
    child = int(guard.first_line)
    guard.kill()
    guard.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its guard"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_only_processes_that_join_others_are_guarded(monkeypatch):
    monkeypatch.delenv(distributed.GUARDED_ENV, raising=False)
    assert not distributed.needs_guard(ClusterSpec("single", None, 1, 0))
    assert distributed.needs_guard(EXPLICIT_1)
    monkeypatch.setenv(distributed.GUARDED_ENV, "1")  # the guarded child itself
    assert not distributed.needs_guard(EXPLICIT_1)


@pytest.mark.parametrize("value, problem", [
    ("0", "JAXSCALE_MIN_PROCESSES=0 is outside 1..4 for 4 processes"),
    ("5", "JAXSCALE_MIN_PROCESSES=5 is outside 1..4 for 4 processes"),
    ("some", "JAXSCALE_MIN_PROCESSES='some' must be an integer")])
def test_an_elastic_minimum_outside_the_count_is_named(value, problem):
    spec = ClusterSpec("explicit", "localhost:1", 4, 0)
    with pytest.raises(JaxscaleError, match=re.escape(problem)):
        distributed.min_processes({"JAXSCALE_MIN_PROCESSES": value}, spec)
    assert distributed.min_processes({"JAXSCALE_MIN_PROCESSES": "3"}, spec) == 3
    assert distributed.min_processes({}, spec) == 4


@pytest.mark.parametrize("value, problem", [
    ("2", "JAXSCALE_MAX_PROCESSES=2 is below the 3 processes running"),
    ("many", "JAXSCALE_MAX_PROCESSES='many' must be an integer")])
def test_an_elastic_maximum_below_the_count_is_named(value, problem):
    """The maximum a narrow run is written for (its global batch, its stop's tier)."""
    with pytest.raises(JaxscaleError, match=re.escape(problem)):
        distributed.max_processes({"JAXSCALE_MAX_PROCESSES": value}, 3)
    assert distributed.max_processes({"JAXSCALE_MAX_PROCESSES": "4"}, 3) == 4
    assert distributed.max_processes({}, 3) == 3


@pytest.mark.parametrize("value", ["", "..", "a/b", "host 1"])
def test_a_host_slot_that_is_no_folder_name_is_named(value):
    with pytest.raises(JaxscaleError, match=re.escape(f"JAXSCALE_HOST_SLOT={value!r} is not a "
                                                      "folder name")):
        distributed.host_slot({"JAXSCALE_HOST_SLOT": value}, 0)
    assert distributed.host_slot({"JAXSCALE_HOST_SLOT": "node-7.a"}, 0) == "node-7.a"
    assert distributed.host_slot({}, 2) == "2"


@pytest.mark.parametrize("message, cause", [
    ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection "
     "closed by peer [127.0.0.1]:5777", "Connection closed by peer [127.0.0.1]:5777"),
    # An all-reduce's name has a hyphen: once not read as a lost peer, and a survivor of 4
    # processes exited through JAX's shutdown, which waited for the lost one.
    ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
     "[127.0.0.1]:31624: Connection reset by peer",
     "Read error [127.0.0.1]:31624: Connection reset by peer"),
])
def test_a_collective_that_lost_its_peer_is_read_as_a_lost_peer(message, cause):
    lost = distributed.lost_peer(ValueError(message), 3)
    assert str(lost).startswith(f"process 3 lost a peer in a collective ({cause}); ")
    assert distributed.lost_peer(ValueError("UNKNOWN: something else failed"), 3) is None
