"""The Slurm script's host range (`sbatch --nodes=MIN-MAX` with JAXSCALE_NODES=MIN-MAX): the
script derives the range's processes for the run, checks the config for the range's minimum,
refuses a range it cannot honour, starts on fewer of the nodes given where more would leave one
idle, and a job given 3 nodes of a 2-4 range trains to its end. The
stand-in srun starts one real local process (1 CPU device) per "node" as Slurm would."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxscale.launch.local import free_port
from tests.helpers import REPO

SBATCH = os.path.join(REPO, "deploy", "slurm", "jaxscale.sbatch")
SMALL = ["--config=configs/tiny.py", "--config.train.steps=3", "--config.train.log_every=1",
         "--config.train.seq_len=32", "--config.train.batch_size=12",
         "--config.train.eval_every=0", "--config.model.n_layers=1", "--config.model.d_model=64",
         "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.model.mlp_dim=128",
         "--config.precision.compute_dtype=float32"]


@pytest.fixture
def sbatch(tmp_path):
    """Runs the script as the batch step of a job given `nodes` nodes of 1 device each, with
    stand-ins for scontrol (logs) and srun, which logs the range it was given (and `--nodes`) and
    runs its command once per node (of those `--nodes` names) in the background, as tasks
    SLURM_PROCID=0..nodes-1 on this host (nodes node0, node1, ... in SLURMD_NODENAME, as slurmd
    names them), each output in task<i>.out, and exits with the highest of their statuses as
    srun does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        nodes=$SLURM_JOB_NUM_NODES given=""
        while [[ $1 == --* ]]; do
          if [[ $1 == --nodes=* ]]; then nodes=${{1#--nodes=}} given=" nodes=$nodes"; fi
          shift
        done
        echo "srun min=${{JAXSCALE_MIN_PROCESSES:-}} max=${{JAXSCALE_MAX_PROCESSES:-}}$given" \\
          >> {log}
        pids=()
        for ((i = 0; i < nodes; i++)); do
          SLURM_PROCID=$i SLURM_LOCALID=0 SLURMD_NODENAME=node$i \\
            SLURM_NTASKS=$nodes \\
            SLURM_STEP_NUM_NODES=$nodes SLURM_STEP_NODELIST=localhost \\
            "$@" > {tmp_path}/task$i.out 2>&1 &
          pids+=($!)
        done
        highest=0
        for pid in "${{pids[@]}}"; do
          wait "$pid"
          status=$?
          if ((status > highest)); then highest=$status; fi
        done
        exit $highest
        """))
    (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "scontrol $*" >> {log}\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)

    def run(nodes, node_range: str, *flags: str, timeout: float = 60):
        """`nodes`: a count, or (count, tasks per node)."""
        nodes, per_node = nodes if isinstance(nodes, tuple) else (nodes, 1)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:"
                                     f"{os.environ['PATH']}",
               "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": str(nodes),
               "SLURM_NTASKS": str(nodes * per_node), "SLURM_GPUS_ON_NODE": "1",
               "JAXSCALE_NODES": node_range, "JAX_PLATFORMS": "cpu",
               "JAX_COORDINATOR_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
               "JAXSCALE_TRANSIENT_DELAY_S": "0",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
        job = subprocess.run([SBATCH, *flags], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=timeout)
        logged = log.read_text().splitlines() if log.exists() else []
        return job, logged

    return run


@pytest.mark.parametrize("nodes, node_range, message", [
    (3, "4-2", "JAXSCALE_NODES=4-2 must be a range MIN-MAX of node counts with 1 <= MIN <= MAX"),
    (3, "0-4", "JAXSCALE_NODES=0-4 must be a range MIN-MAX"),
    (3, "3", "JAXSCALE_NODES=3 must be a range MIN-MAX"),
    (5, "2-4", "Slurm gave the job 5 nodes, outside JAXSCALE_NODES=2-4; pass sbatch "
               "--nodes=2-4, the same range"),
    ((3, 8), "2-4", "JAXSCALE_NODES=2-4 needs one process per node, not 8; drop "
                    "--ntasks-per-node (each process drives its node's GPUs)"),
])
def test_a_range_the_script_cannot_honour_is_refused_before_anything_starts(
        sbatch, tmp_path, nodes, node_range, message):
    job, logged = sbatch(nodes, node_range, *SMALL, f"--workdir={tmp_path / 'run'}")
    assert job.returncode == 2
    lines = job.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert logged == []  # neither srun nor a requeue
    assert not (tmp_path / "run").exists()


def test_a_range_whose_minimum_the_mesh_cannot_run_on_is_refused(sbatch, tmp_path):
    """fsdp=4 fixed: 4 nodes of 1 device fit, 3 could not go on; nothing starts."""
    job, logged = sbatch(4, "3-4", *SMALL, "--config.mesh.data=1", "--config.mesh.fsdp=4",
                         f"--workdir={tmp_path / 'run'}")
    assert job.returncode == 2 and logged == [] and not (tmp_path / "run").exists()
    lines = job.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no mesh of the axes {"), lines
    assert "(checked for 3 devices, as the run would go on after losing hosts" in lines[0]


def test_a_range_whose_minimum_would_leave_a_whole_host_idle_is_refused(sbatch, tmp_path):
    """Batch 8 on 3 nodes of 1 device: width 2, the third node's device idle, a whole process
    with no shard of the state, which crashed at its first step (int(state.step)) and had the
    job requeued forever. At a 3-4 range's minimum there are no fewer nodes to run on: refused
    before anything starts."""
    job, logged = sbatch(3, "3-4", *SMALL, "--config.train.batch_size=8",
                         f"--workdir={tmp_path / 'run'}")
    assert job.returncode == 2 and logged == [] and not (tmp_path / "run").exists()
    assert job.stderr.splitlines() == [
        "error: on 3 devices the run would leave 1 idle (no width of them divides "
        "train.batch_size=8), a whole host's 1, which the trainer cannot run; pass a "
        "train.batch_size that the range runs on (the nearest: 12), or raise the range's "
        "minimum"]


def stand_in_python(tmp_path) -> None:
    """A python on the stand-ins' PATH that records each task (its slot, its id of how many)
    instead of training, and runs the script's config check for real."""
    (tmp_path / "bin" / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [[ $2 == jaxscale.train ]]; then
          echo "$JAXSCALE_HOST_SLOT $SLURM_PROCID of $SLURM_NTASKS" > {tmp_path}/task$SLURM_PROCID
          exit 0
        fi
        exec {sys.executable} "$@"
        """))
    (tmp_path / "bin" / "python").chmod(0o755)


def test_a_job_given_a_count_that_would_leave_a_node_idle_runs_on_fewer(sbatch, tmp_path):
    """Batch 8, a 2-4 range, 3 nodes given: on 3 a node would be all idle, so the run starts on
    2 (srun --nodes=2) and the third node idles; the line says so."""
    stand_in_python(tmp_path)
    job, logged = sbatch(3, "2-4", *SMALL, "--config.train.batch_size=8",
                         f"--workdir={tmp_path / 'run'}", timeout=120)
    assert job.returncode == 0, job.stderr
    assert logged == ["srun min=2 max=4 nodes=2"]
    assert sorted(p.name for p in tmp_path.glob("task?")) == ["task0", "task1"]
    assert (tmp_path / "task1").read_text() == "node1-0 1 of 2\n"
    assert "jaxscale: job 7, attempt 1, 3 nodes, running on 2 (on more, a node's GPUs would all " \
           "be idle) (range 2-4)" in job.stdout


@pytest.mark.slow
def test_a_job_given_3_nodes_of_a_2_to_4_range_trains_to_its_end(sbatch, tmp_path):
    workdir = tmp_path / "run"
    job, logged = sbatch(3, "2-4", *SMALL, f"--workdir={workdir}", timeout=300)
    outputs = [(tmp_path / f"task{i}.out").read_text() for i in range(3)]
    assert job.returncode == 0, job.stderr + outputs[0][-3000:]
    assert "jaxscale: job 7, attempt 1, 3 nodes (range 2-4)" in job.stdout
    assert logged == ["srun min=2 max=4"]  # the range as processes, no requeue
    assert ("jaxscale: elastic: 3 of 4 devices, global batch 12 kept: data-parallel width "
            "4 -> 3, train.microbatches 1 -> 2") in outputs[0]
    assert "step 3" in outputs[0]


def test_each_task_runs_with_its_nodes_slot(sbatch, tmp_path):
    """Each task's JAXSCALE_HOST_SLOT is its node and local id (the folder of its local
    checkpoints, which a requeue on fewer nodes must find again); a stand-in python records it
    instead of training, and runs the script's config check for real."""
    stand_in_python(tmp_path)
    job, _ = sbatch(2, "2-2", *SMALL, f"--workdir={tmp_path / 'run'}", timeout=120)
    assert job.returncode == 0, job.stderr
    slots = [(tmp_path / f"task{i}").read_text().split()[0] for i in range(2)]
    assert slots == ["node0-0", "node1-0"]
