"""runtime/agreement.py on 2 real processes (2 CPU devices each, gloo): each primitive gives every
process the same answer, made of each process's own input."""

import json
import os
import subprocess
import sys

import pytest

from jaxscale.launch.local import free_port
from tests.helpers import REPO

# Each process runs this with its id; it prints one JSON line of what each primitive answered.
PROGRAM = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[1]))
import numpy as np
from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.runtime import agreement

me = jax.process_index()
answers = {
    "gathered": agreement.gathered(np.array([me, 10 * me])).tolist(),
    # messages of different sizes, one past the budget
    "bytes": [m.decode() for m in agreement.gathered_bytes(("x" * (3 + 5 * me)).encode())],
    "bytes_cut": [m.decode() for m in agreement.gathered_bytes(b"abcdef"[:4 + me], 4)],
    "everyone": agreement.everyone(me == 1).tolist(),
    "gravest": list(agreement.gravest(3 * me, f"problem of {me}")),
    "nothing_grave": list(agreement.gravest(0, f"fine {me}")),
    "process_0": agreement.process_0_decides(np.array([1.5 + me, 2.5])).tolist(),
}
try:
    with agreement.agreed_checks():
        if me == 1:
            raise TransientError("disk of host 1 is failing")
    answers["checks"] = None
except (JaxscaleError, TransientError) as e:
    answers["checks"] = [type(e).__name__, str(e)]
print(json.dumps(answers), flush=True)
"""


@pytest.fixture(scope="module")
def answers():
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    processes = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(i), str(port)], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]
    outputs = [p.communicate(timeout=120) for p in processes]
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_every_process_gets_the_same_answers(answers):
    assert answers[0] == answers[1]


def test_gathered_stacks_each_processes_row_in_process_order(answers):
    assert answers[0]["gathered"] == [[0, 0], [1, 10]]


def test_messages_of_any_size_or_cut_to_a_budget(answers):
    assert answers[0]["bytes"] == ["xxx", "x" * 8]
    assert answers[0]["bytes_cut"] == ["abcd", "abcd"]


def test_everyone_and_gravest_and_process_0(answers):
    assert answers[0]["everyone"] == [False, True]
    assert answers[0]["gravest"] == [3, "process 1: problem of 1"]
    assert answers[0]["nothing_grave"] == [0, ""]
    assert answers[0]["process_0"] == [1.5, 2.5]


def test_a_check_failing_on_one_process_stops_both_with_its_kind_and_words(answers):
    assert answers[0]["checks"] == ["TransientError",
                                    "process 1 of 2: disk of host 1 is failing"]
