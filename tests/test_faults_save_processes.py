"""A save failing on one process in its blocking part (the state copied off the devices, the
temporary folder made), on 2 real processes: both exit within SAVE_FAILURE_BOUND_S with the
failure's status (75 for a storage error, 2 for a refusal), each with the same one error line
naming process 1, no step folder of the failed save is committed, and a restart resumes exactly.
The failure is injected into Orbax's blocking part on process 1 (no disk fails on one process
alone here), after Orbax's own start barriers, where a real one (EIO, a host out of memory)
happens."""

import errno
import os
import subprocess
import sys
import time

import pytest

from jaxscale.errors import TRANSIENT_EXIT_CODE, USAGE_EXIT_CODE
from jaxscale.launch.local import free_port, process_env
from tests.helpers import REPO
from tests.test_checkpoint_resume import flags
from tests.test_faults_checkpoint import merged_losses

pytestmark = pytest.mark.slow

# The step whose save fails on process 1, the env variable that says how, and the bound stated
# in docs/checkpointing.md (seconds from the failure until every process has exited).
FAILING_STEP = 4
FAILING_SAVE_ENV = "JAXSCALE_TEST_FAILING_SAVE"
SAVE_FAILURE_BOUND_S = 30


def inject_failing_save_from_env():
    """Run at the start of every Python process of the test (a `sitecustomize`): on process 1,
    the blocking part of the save of FAILING_STEP raises $JAXSCALE_TEST_FAILING_SAVE's error,
    once Orbax's start barriers are passed, and writes the time it failed to a file beside it."""
    how = os.environ.get(FAILING_SAVE_ENV)
    if not how or os.environ.get("JAX_PROCESS_ID") != "1":
        return
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    from jaxscale.runtime import agreement

    if how == "refused":
        # The announcer slow on its way out (as when its error unwinds through a slow close):
        # process 0, which holds the coordination service, must not exit before it, or JAX aborts
        # it and it ends with 75 ("lost its coordinator"), not its own failure's 2.
        leave = agreement.leave
        agreement.leave = lambda status: (time.sleep(5), leave(status))
    # And slow between saying it leaves and leaving, as a loaded host can hold it: process 0 must
    # give it that moment, or the service goes first and JAX aborts it (75, a second line).
    exit_now = os._exit
    os._exit = lambda status: (time.sleep(1), exit_now(status))
    real = async_checkpointer.AsyncCheckpointer._save

    async def failing_save(self, tmpdir, *args, **kwargs):
        if tmpdir.get_final().name == str(FAILING_STEP):
            with open(os.environ[FAILING_SAVE_ENV + "_AT"], "w") as f:
                f.write(str(time.time()))
            if how == "refused":  # what gcsfs raises for HTTP 403: no errno
                raise OSError(f"Forbidden: {tmpdir.get()}\nsa@p.iam.gserviceaccount.com does "
                              "not have storage.objects.create access")
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(tmpdir.get()))
        return await real(self, tmpdir, *args, **kwargs)
    async_checkpointer.AsyncCheckpointer._save = failing_save


def two_processes(workdir, steps, tmp_path, how=None):
    """Trains `steps` in `workdir` on 2 processes (2 devices each); with `how`, process 1's save
    of FAILING_STEP fails. Returns ([exit status, output] of each, seconds from the failure until
    both had exited, or None)."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "from tests.test_faults_save_processes import inject_failing_save_from_env\n"
        "inject_failing_save_from_env()\n")
    failed_at = tmp_path / "failed_at"
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    if how:
        env.update({FAILING_SAVE_ENV: how, FAILING_SAVE_ENV + "_AT": str(failed_at)})
    args = [*flags(workdir, steps, every_steps=2,
                  compilation_cache_dir=tmp_path / "cache"),
            "--config.optim.warmup_steps=1", "--config.optim.min_lr_ratio=1.0",
            "--config.mesh.data=1", "--config.mesh.fsdp=4"]
    port = free_port()
    processes = [subprocess.Popen(
        [sys.executable, "-m", "jaxscale.train", *args], cwd=REPO,
        env=process_env(env, i, 2, devices=2, port=port), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    ended = time.time()
    seconds = ended - float(failed_at.read_text()) if failed_at.exists() else None
    return [(p.returncode, out) for p, out in zip(processes, outputs)], seconds


@pytest.mark.parametrize("how, status, words", [
    ("eio", TRANSIENT_EXIT_CODE, "Input/output error"),
    ("refused", USAGE_EXIT_CODE, "does not have storage.objects.create access")])
def test_a_save_failing_on_one_process_ends_both_within_the_bound(tmp_path, how, status,
                                                                    words):
    workdir = tmp_path / "run"
    ended, seconds = two_processes(workdir, 6, tmp_path, how)

    errors = []
    for code, output in ended:
        assert code == status, output[-3000:]
        errors += [line for line in output.splitlines() if line.startswith("error: ")]
    assert seconds is not None and seconds < SAVE_FAILURE_BOUND_S, seconds
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert errors[0].startswith(f"error: process 1 of 2: checkpoint {workdir}/checkpoints/"
                                f"{FAILING_STEP} could not be written"), errors
    assert words in errors[0], errors
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    if status == TRANSIENT_EXIT_CODE:  # a restart (no failure now) resumes from step 2, exactly
        ended, _ = two_processes(workdir, 6, tmp_path)
        assert [code for code, _ in ended] == [0, 0], ended[0][1][-3000:]
        assert f"restored {workdir}/checkpoints/2 " in ended[0][1]
        straight, _ = two_processes(tmp_path / "straight", 6, tmp_path)
        assert merged_losses(workdir) == merged_losses(tmp_path / "straight")
