"""Cluster detection from (fake) environments, and the rendezvous that names missing processes."""

import threading
import time

import pytest

from jaxscale import distributed
from jaxscale.distributed import ClusterSpec, detect, first_slurm_host
from jaxscale.rendezvous import rendezvous
from jaxscale.errors import JaxscaleError
from jaxscale.launch.local import free_port_pair

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
    monkeypatch.setattr(distributed, "_on_cloud_tpu_vm", lambda: False)
    assert distributed.initialize().mode == "single"
    assert distributed.initialize() is distributed.initialize()


def _run_processes(num_processes: int, ids, timeout_s: float, port: int,
                   claimed_count=None) -> dict:
    """Runs the rendezvous of processes `ids` in threads; returns id -> None or the error."""
    results = {}

    def one(process_id):
        count = num_processes if process_id == 0 else claimed_count or num_processes
        spec = ClusterSpec("explicit", f"localhost:{port - 1}", count, process_id)
        try:
            rendezvous(spec, time.monotonic() + timeout_s)
            results[process_id] = None
        except JaxscaleError as e:
            results[process_id] = str(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_rendezvous_when_everyone_arrives():
    port = free_port_pair() + 1
    assert _run_processes(3, [0, 1, 2], 10, port) == {0: None, 1: None, 2: None}


def test_rendezvous_names_the_missing_process_instead_of_hanging():
    port = free_port_pair() + 1
    start = time.monotonic()
    results = _run_processes(4, [0, 1, 3], 1.5, port)
    assert time.monotonic() - start < 10
    assert "process(es) [2] never arrived" in results[0]
    assert "[2] of 4 never arrived" in results[1] and "[2] of 4 never arrived" in results[3]


def test_rendezvous_names_an_absent_coordinator():
    port = free_port_pair() + 1
    results = _run_processes(2, [1], 1.0, port)
    assert "could not reach process 0 (the coordinator)" in results[1]


def test_rendezvous_rejects_processes_that_disagree_on_the_count():
    port = free_port_pair() + 1
    results = _run_processes(2, [0, 1], 5, port, claimed_count=3)
    assert "process 1 expects 3 processes but process 0 expects 2" in results[0]
    assert "expects 3 processes" in results[1]
