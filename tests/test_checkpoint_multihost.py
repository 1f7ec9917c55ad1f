"""Two processes with four CPU devices each: a SIGTERM to one of them stops both at the same step
(JAX's preemption sync point), each writes its own shards and data position, and the resumed run
logs the losses of an uninterrupted one."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from jaxscale.errors import RESTART_EXIT_CODE
from jaxscale.launch.local import process_env
from tests.test_checkpoint_resume import losses, wait_for_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "multihost_worker.py")
STEPS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(workdir):
    port = free_port()
    return [subprocess.Popen([sys.executable, WORKER, str(workdir), str(STEPS)], cwd=REPO,
                             env=process_env(dict(os.environ), i, 2, 4, port),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def finish(processes):
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    return [p.returncode for p in processes], "\n".join(outputs)


@pytest.mark.slow
def test_a_sigterm_to_one_process_stops_all_at_one_step_and_the_run_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    codes, output = finish(start(straight))
    assert codes == [0, 0], output[-3000:]

    processes = start(resumed)
    wait_for_step(processes[0], resumed, 3)
    processes[1].send_signal(signal.SIGTERM)
    codes, output = finish(processes)
    assert codes == [RESTART_EXIT_CODE] * 2, output[-3000:]
    (step,) = os.listdir(resumed / "checkpoints")
    checkpoint = resumed / "checkpoints" / step
    for i in range(2):  # every process wrote its own shards and its own data position
        assert (checkpoint / "params" / f"ocdbt.process_{i}").is_dir()
        assert (checkpoint / "data" / f"process_{i}.json").is_file()

    codes, output = finish(start(resumed))
    assert codes == [0, 0], output[-3000:]
    assert losses(resumed) == losses(straight)
