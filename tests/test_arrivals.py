"""Taking a returning host back (runtime/arrivals.py): a process that arrives after the run started
learns it from JAX's own coordination service (a real one, in a child process), announces itself
with a marker in the checkpoint folder and waits; process 0's watch sees the marker and asks for
the planned stop; a start clears the markers. The whole path, on real processes:
tests/test_elastic_processes.py."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.launch.local import free_port
from jaxscale.runtime import arrivals, distributed, rendezvous
from jaxscale.runtime.distributed import ClusterSpec
from tests.storage_servers import gcs, s3  # noqa: F401 (fixtures)

# A one-process run whose JAX coordinator holds the port, as a run that started without the
# process under test does.
STARTED_RUN = """
import sys, jax
jax.distributed.initialize(coordinator_address="127.0.0.1:" + sys.argv[1], num_processes=1,
                           process_id=0)
print("up", flush=True)
sys.stdin.read()  # until the test closes it
"""


@pytest.fixture(scope="module")
def started_run():
    """The coordinator port of a run that has started: JAX's service holds it."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.Popen([sys.executable, "-c", STARTED_RUN, str(port)], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline() == "up\n"
        yield port
    finally:
        run.stdin.close()
        run.wait(timeout=30)


def test_a_process_that_arrives_after_the_run_started_is_told_at_once(started_run):
    spec = ClusterSpec("explicit", f"127.0.0.1:{started_run}", 4, 2)
    began = time.monotonic()
    with pytest.raises(rendezvous.RunStarted, match="process 2 of 4 arrived after the run had "
                                                     "started without it"):
        rendezvous.rendezvous(spec, time.monotonic() + 30, 3)
    assert time.monotonic() - began < 5  # the answer, not the 30 s timeout


def late_process(monkeypatch, port: int, minimum: int | None) -> ClusterSpec:
    monkeypatch.setattr(distributed, "LATE_RETRY_S", 0.2)
    monkeypatch.setenv(distributed.HOST_SLOT_VAR, "host-b")
    if minimum is None:
        monkeypatch.delenv(distributed.MIN_PROCESSES_VAR, raising=False)
    else:
        monkeypatch.setenv(distributed.MIN_PROCESSES_VAR, str(minimum))
    return ClusterSpec("explicit", f"127.0.0.1:{port}", 4, 2)


def test_a_late_process_in_a_range_announces_itself_and_waits_until_its_timeout(
        started_run, monkeypatch, tmp_path, capsys):
    spec = late_process(monkeypatch, started_run, minimum=3)
    began = time.monotonic()
    with pytest.raises(TransientError, match="was not taken back before the timeout; start it "
                                             "again"):
        distributed._admitted(spec, time.monotonic() + 3, str(tmp_path))
    assert time.monotonic() - began >= 2  # it waited, trying again
    marker = tmp_path / "elastic" / "arrived" / "host-b"
    assert marker.exists()
    # Announced once, however many tries.
    assert capsys.readouterr().out.count(f"announced at {marker}, waiting to be taken back") == 1


def test_a_late_process_without_a_range_writes_nothing(started_run, monkeypatch, tmp_path):
    spec = late_process(monkeypatch, started_run, minimum=None)
    with pytest.raises(TransientError, match="give the run a range"):
        distributed._admitted(spec, time.monotonic() + 30, str(tmp_path))
    assert not (tmp_path / "elastic").exists()


def markers_are_written_once_listed_and_cleared(folder: str) -> None:
    assert arrivals.arrived(folder) == [] and arrivals.cleared(folder) == []
    assert arrivals.announce(folder, "3") == f"{folder}/elastic/arrived/3"
    assert arrivals.announce(folder, "3") is None  # there already
    arrivals.announce(folder, "1")
    assert arrivals.arrived(folder) == ["1", "3"]
    assert arrivals.cleared(folder) == ["1", "3"]
    assert arrivals.arrived(folder) == []


def test_markers_are_written_once_listed_and_cleared(tmp_path):
    markers_are_written_once_listed_and_cleared(str(tmp_path / "checkpoints"))
    assert os.listdir(tmp_path / "checkpoints" / "elastic" / "arrived") == []


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_markers_in_a_bucket_too(server, request):
    bucket = request.getfixturevalue(server).bucket
    markers_are_written_once_listed_and_cleared(f"{bucket}/arrivals-{os.getpid()}/checkpoints")


@pytest.fixture
def sigterms(monkeypatch):
    """Counts the SIGTERMs this (single) process gets, as the trainer's handler would catch them."""
    got = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.set())
    monkeypatch.setattr(arrivals, "LIST_EVERY_S", 0.1)
    yield got
    signal.signal(signal.SIGTERM, previous)


def test_process_0_clears_old_markers_then_asks_for_the_stop_on_an_arrival(tmp_path, sigterms,
                                                                            capsys):
    folder = str(tmp_path)
    arrivals.announce(folder, "0")  # the last start's: acted on already
    with arrivals.watched(folder, elastic=True, narrower=True):
        assert "slot(s) ['0'] cleared at this start" in capsys.readouterr().out
        time.sleep(0.5)
        assert not sigterms.is_set()  # nothing arrived
        arrivals.announce(folder, "2")
        deadline = time.monotonic() + 10
        while not sigterms.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)  # the handler runs on this thread, between its bytecodes
    assert sigterms.is_set()
    assert f"slot(s) ['2'] arrived ({tmp_path}/elastic/arrived); saving at an agreed step and " \
           "exiting 42" in capsys.readouterr().out


def test_arrivals_that_make_no_count_that_runs_wait_as_spares_until_more_come(tmp_path, sigterms,
                                                                             capsys):
    """A run on 2 of 4 whose 3 would leave a host all idle: one marker is said to wait, once;
    with a second, 4 run, and the stop is asked."""
    folder = str(tmp_path)
    with arrivals.watched(folder, elastic=True, narrower=True, widens=lambda arrived: arrived >= 2):
        arrivals.announce(folder, "3")
        time.sleep(2.5 * arrivals.LIST_EVERY_S)  # two listings or more
        assert not sigterms.is_set()
        assert capsys.readouterr().out.count("slot(s) ['3'] waiting as spares: with them the run "
                                             "would leave a whole host's devices idle") == 1
        arrivals.announce(folder, "2")
        deadline = time.monotonic() + 10
        while not sigterms.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sigterms.is_set()
    assert "slot(s) ['2', '3'] arrived" in capsys.readouterr().out


def test_a_spare_announces_itself_and_waits_as_a_late_process_does(monkeypatch, tmp_path, capsys):
    """Process 0 of 2 (a range 1-2) on which 2 would not run starts alone; process 1 is told it
    is a spare, writes its marker and says so, and tries again until its timeout."""
    monkeypatch.setattr(distributed, "LATE_RETRY_S", 0.2)
    monkeypatch.setattr(distributed, "_runs_on", lambda count: count == 1)
    monkeypatch.setenv(distributed.MIN_PROCESSES_VAR, "1")
    monkeypatch.setenv(distributed.HOST_SLOT_VAR, "host-b")
    port = free_port()
    first = threading.Thread(target=rendezvous.rendezvous, args=(
        ClusterSpec("explicit", f"127.0.0.1:{port}", 2, 0), time.monotonic() + 30, 1,
        distributed._runs_on))
    first.start()
    with pytest.raises(TransientError):  # process 0 has gone on: nobody answers any more
        distributed._admitted(ClusterSpec("explicit", f"127.0.0.1:{port}", 2, 1),
                              time.monotonic() + 3, str(tmp_path))
    first.join()
    marker = tmp_path / "elastic" / "arrived" / "host-b"
    assert marker.exists()
    assert "jaxscale: elastic: process 1 of 2 is a spare: process 0 started the run on 1 of the " \
           f"processes that came, since on more a whole host's devices would be idle; announced " \
           f"at {marker}, waiting to be taken back" in capsys.readouterr().out


def test_a_range_on_no_count_of_which_the_run_runs_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.setattr(distributed, "_runs_on", lambda count: False)
    monkeypatch.setenv(distributed.MIN_PROCESSES_VAR, "1")
    with pytest.raises(JaxscaleError, match="on no count of processes from 1 to 2 does the run"):
        distributed._admitted(ClusterSpec("explicit", f"127.0.0.1:{free_port()}", 2, 1),
                              time.monotonic() + 3, str(tmp_path))


def test_a_run_at_its_full_count_clears_markers_and_watches_for_none(tmp_path, sigterms):
    folder = str(tmp_path)
    arrivals.announce(folder, "2")
    with arrivals.watched(folder, elastic=True, narrower=False):
        assert arrivals.arrived(folder) == []
        arrivals.announce(folder, "2")
        time.sleep(0.5)
    assert not sigterms.is_set()
