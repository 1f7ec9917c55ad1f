"""An elastic run (launch.local, 4 processes x 1 CPU device, --min_processes=3) loses process 2
(SIGKILL, a lost host) after step 3: it goes on with 3 processes at the same global batch (in 2
microbatches), takes the 4th back once the 3 have met (--return_after_s=0): the launcher starts it
as a late process, which finds the run started without it and writes its arrival marker; the 3's
process 0 sees it, they save one agreed step and exit 42, and the launcher restarts on 4, whose
process 0 clears the marker. Every step's loss equals an uninterrupted 4-process run's to 1e-5
relative (float32): the same documents in the same order, the same schedule. The runs are
benchmarks/elastic.py's. The second test loses a host from a range where the survivors' count
cannot run: the run goes on narrower still, with a spare."""

import re

import pytest

from tests.helpers import benchmark_module

pytestmark = pytest.mark.slow

elastic = benchmark_module("elastic")


def assert_the_same_steps(whole, lost) -> None:
    """Every step of run `lost` logged the loss of run `whole`'s (to 1e-5) and its rate."""
    expected, got = elastic.metrics(str(whole)), elastic.metrics(str(lost))
    assert sorted(got) == sorted(expected) == list(range(1, elastic.STEPS + 1))
    for step in expected:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
        assert got[step]["lr"] == expected[step]["lr"], step


def test_a_lost_host_is_gone_on_without_then_taken_back_and_the_losses_are_unchanged(tmp_path):
    cache = str(tmp_path / "compilation_cache")
    whole = elastic.run(str(tmp_path / "whole"), cache, None, elastic=False, return_after_s=0)
    assert whole.status == 0, whole.output[-3000:]
    lost = elastic.run(str(tmp_path / "lost"), cache, 3, elastic=True, return_after_s=0)
    assert lost.status == 0, lost.output[-3000:]
    output = lost.output
    went_on = output.index("launch.local: process(es) [2] lost (SIGKILL); going on with 3 of 4")
    narrow = output.index("[0] jaxscale: elastic: 3 of 4 devices, global batch 12 kept: "
                          "data-parallel width 4 -> 3, train.microbatches 1 -> 2", went_on)
    marker = f"{tmp_path}/lost/checkpoints/elastic/arrived/2"
    announced = output.index("[returning 2] jaxscale: elastic: process 2 of 4 arrived after the "
                             "run had started without it: JAX's service, not a rendezvous, "
                             "answered at 127.0.0.1:", narrow)
    assert f"announced at {marker}, waiting to be taken back" in output[announced:]
    seen = output.index("[0] jaxscale: elastic: slot(s) ['2'] arrived ", announced)
    stopped = output.index("[0] preempted at step ", seen)  # saved for it, at an agreed step
    wide = output.index("launch.local: taking back the lost process(es): restarting on 4", stopped)
    assert "[0] step " in output[narrow:wide]  # the 3 trained before the 4th came back
    assert "[0] jaxscale: elastic: arrival marker(s) of slot(s) ['2'] cleared at this start (4 " \
           "processes)" in output[wide:]
    assert lost.seconds_to_take_back() < elastic.TAKE_BACK_BOUND_S
    assert lost.seconds_to_resume() < elastic.RESUME_BOUND_S
    assert_the_same_steps(tmp_path / "whole", tmp_path / "lost")


def test_survivors_that_cannot_all_run_go_on_narrower_with_a_spare_until_the_lost_host_returns(
        tmp_path):
    """Batch 8 and a range of 2-4: on the 3 survivors of process 2's loss no width divides 8 with
    every process holding rows, so the rendezvous starts 2 (2 microbatches) and the third, slot 3,
    waits as a spare; its marker alone makes no count that runs, the returning slot 2's with it
    does: the 2 stop at an agreed step and the run goes back to 4. The losses equal an
    uninterrupted run's."""
    cache, batch = str(tmp_path / "compilation_cache"), ("--config.train.batch_size=8",)
    whole = elastic.run(str(tmp_path / "whole"), cache, None, elastic=False, return_after_s=0,
                        train_flags=batch)
    assert whole.status == 0, whole.output[-3000:]
    lost = elastic.run(str(tmp_path / "lost"), cache, 3, elastic=True, return_after_s=0,
                       min_processes=2, train_flags=batch)
    assert lost.status == 0, lost.output[-3000:]
    output = lost.output
    went_on = output.index("launch.local: process(es) [2] lost (SIGKILL); going on with 3 of 4")
    narrow = output.index("[0] jaxscale: elastic: 2 of 4 devices, global batch 8 kept: "
                          "data-parallel width 4 -> 2, train.microbatches 1 -> 2", went_on)
    assert "[2] jaxscale: elastic: process 2 of 3 is a spare: process 0 started the run on 2 of " \
           "the processes that came" in output[went_on:]
    seen = output.index("[0] jaxscale: elastic: slot(s) ['2', '3'] arrived ", narrow)
    stopped = output.index("[0] preempted at step ", seen)
    wide = output.index("launch.local: taking back the lost process(es): restarting on 4", stopped)
    assert "[0] step " in output[narrow:wide]  # the 2 trained while the spare waited
    # Process 0 asked for no stop while the spare's marker was alone.
    assert re.findall(r"^\[0\] jaxscale: elastic: slot\(s\) (\[.*?\]) arrived ",
                      output[narrow:wide], re.M) == ["['2', '3']"]
    assert lost.seconds_to_resume() < elastic.RESUME_BOUND_S
    assert_the_same_steps(tmp_path / "whole", tmp_path / "lost")
