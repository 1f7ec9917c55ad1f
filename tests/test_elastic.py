"""An elastic run on fewer devices keeps its global batch: the microbatches chosen, idle devices
said, and the config left alone on the full count (jaxscale/training/elastic.py); launch.local's
host range with stand-in processes: going on after a loss, exit 75 below the minimum, a planned
restart taking a process back."""

import os
import subprocess
import sys
import types

import pytest

from jaxscale.checks import runs_on, validate
from jaxscale.config import default_config
from jaxscale.errors import ConfigError
from jaxscale.training.elastic import fitted

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(batch: int, microbatches: int = 1, **mesh):
    c = default_config()
    c.train.batch_size, c.train.microbatches = batch, microbatches
    for axis, size in mesh.items():
        c.mesh[axis] = size
    return c


def test_the_full_count_changes_nothing():
    c = config(12)
    assert fitted(c, list(range(4)), 4) == (c, list(range(4)), None)


def test_fewer_devices_raise_accumulation_to_keep_the_global_batch_and_the_rows_per_device():
    """12 rows on 4 devices: 3 each. On 3: 4 each would not fit, so 2 microbatches of 2 rows."""
    fit, devices, note = fitted(config(12), list(range(3)), 4)
    assert (fit.train.batch_size, fit.train.microbatches, devices) == (12, 2, [0, 1, 2])
    assert note == ("elastic: 3 of 4 devices, global batch 12 kept: data-parallel width 4 -> 3, "
                    "train.microbatches 1 -> 2")


def test_a_width_that_divides_the_batch_with_rows_to_spare_keeps_the_microbatches():
    """16 rows in 2 microbatches on 8 devices: 1 row each; on 4 devices, 4 microbatches."""
    fit, devices, _ = fitted(config(16, 2), list(range(4)), 8)
    assert (fit.train.microbatches, len(devices)) == (4, 4)


def test_devices_are_left_idle_when_no_width_divides_the_batch_and_it_is_said():
    """8 rows: 3 devices cannot split them; 2 can (2 microbatches of 2 rows each), one idles."""
    fit, devices, note = fitted(config(8), list(range(3)), 4)
    assert (fit.train.microbatches, devices) == (2, [0, 1])
    assert note.endswith("; 1 device(s) left idle: no width of the 3 present divides 8")


def test_fixed_axes_are_kept_and_only_the_minus_one_axis_refilled():
    """tensor=2 fixed, data=-1: 8 -> 6 devices is data 4 -> 3; 24 rows: 6 -> 8 per data shard."""
    fit, devices, note = fitted(config(24, tensor=2), list(range(6)), 8)
    assert (fit.train.microbatches, len(devices)) == (2, 6)
    assert "data-parallel width 4 -> 3" in note


def test_no_layout_at_all_is_a_config_error():
    """tensor=2 needs two devices; one is left."""
    with pytest.raises(ConfigError, match="on at most 1 devices splits train.batch_size=4"):
        fitted(config(4, tensor=2), [0], 4)


def gpu_hosts(hosts: int, per_host: int = 2) -> list:
    return [types.SimpleNamespace(process_index=h, platform="gpu")
            for h in range(hosts) for _ in range(per_host)]


def test_a_dcn_factor_across_hosts_is_set_to_the_hosts_present():
    """4 hosts x 2 GPUs, dcn.data=4: 24 rows over width 8, 3 per device. On 3 hosts dcn.data=3,
    width 6: 4 rows each would not fit, so 2 microbatches of 2; every device of each host used."""
    c = config(24)
    c.mesh.dcn.data = 4
    fit, devices, note = fitted(c, gpu_hosts(3), 8)
    assert (fit.mesh.dcn.data, fit.train.microbatches, len(devices)) == (3, 2, 6)
    assert c.mesh.dcn.data == 4  # the config itself is left alone
    assert note == ("elastic: 3 of 4 hosts, global batch 24 kept: mesh.dcn.data 4 -> 3, "
                    "data-parallel width 8 -> 6, train.microbatches 1 -> 2")
    assert validate(fit, len(devices), 3)  # the refitted mesh is one the checks accept


def test_a_dcn_layout_that_cannot_follow_the_hosts_is_a_config_error():
    """The batch over two DCN factors (data 2 x fsdp 2): which one shrinks is not the config's
    to guess; and a batch no width of the hosts left divides."""
    c = config(24)
    c.mesh.dcn.data, c.mesh.dcn.fsdp = 2, 2
    with pytest.raises(ConfigError, match="exactly one DCN factor"):
        fitted(c, gpu_hosts(3), 8)
    c = config(16)
    c.mesh.dcn.data = 4
    with pytest.raises(ConfigError, match="does not split over the data-parallel width 6"):
        fitted(c, gpu_hosts(3), 8)


def test_tpu_slices_are_not_refitted():
    c = config(24)
    c.mesh.dcn.data = 2
    slices = [types.SimpleNamespace(process_index=h, slice_index=h, platform="tpu")
              for h in range(1) for _ in range(4)]
    assert fitted(c, slices, 8) == (c, slices, None)


# --- launch.local's host range, with stand-in processes ------------------------------------------

STAND_IN = '''
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))  # saved; restart me
n, i = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
full = int(os.environ["JAXSCALE_MAX_PROCESSES"])
print(f"{i} of {n}, at most {full}", flush=True)
if i == 0:
    print("jaxscale: distributed mode stand-in", flush=True)  # met: late ones may come now
narrow_ran = os.path.join(os.environ["MARKS"], "narrow_ran")
arrived = os.path.join(os.environ["MARKS"], "arrived")  # runtime/arrivals.py's marker
if n < full:
    open(narrow_ran, "w").close()
elif os.path.exists(arrived):
    sys.exit(0)  # back on the full count: done
elif os.path.exists(narrow_ran):
    open(arrived, "w").close()  # a late process: announced, it waits to be taken back
    time.sleep(60)
if f"{n}:{i}" in os.environ["LOSE"].split(","):
    os.kill(os.getpid(), signal.SIGKILL)  # a lost host
# A step line once every process has its handler, as a real step is taken by all together.
open(os.path.join(os.environ["MARKS"], f"started_{n}_{i}"), "w").close()
while not all(os.path.exists(os.path.join(os.environ["MARKS"], f"started_{n}_{j}"))
              for j in range(n)):
    time.sleep(0.05)
print("step 1 | loss 1.0", flush=True)
for _ in range(1200):
    if n < full and os.path.exists(arrived):
        sys.exit(42)  # process 0 saw the marker: every process saves one step, planned stop
    time.sleep(0.05)
'''


def launch_stand_ins(tmp_path, lose: str, *flags: str):
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO]),
           "MARKS": str(tmp_path), "LOSE": lose}
    return subprocess.run([sys.executable, "-m", "jaxscale.launch.local", "--processes=3",
                           "--devices_per_process=1", "--module=stand_in", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_a_loss_below_the_minimum_exits_75_naming_who_is_missing(tmp_path):
    """Process 2 of 3 lost: the run goes on at once on 2 (ids 0, 1); then process 1 of those."""
    result = launch_stand_ins(tmp_path, "3:2,2:1", "--min_processes=2")
    assert result.returncode == 75, result.stdout + result.stderr
    assert "[1] 1 of 2, at most 3" in result.stdout  # renumbered, told the range's maximum
    assert ("launch.local: process(es) [2] lost (SIGKILL); going on with 2 of 3 processes"
            in result.stderr)
    assert result.stderr.splitlines()[-1] == (
        "error: process(es) [1] of 2 lost and 1 left, below --min_processes=2; exit 75: start "
        "the run again once the hosts are back")


def test_a_lost_process_is_taken_back_by_a_planned_restart(tmp_path):
    result = launch_stand_ins(tmp_path, "3:2", "--min_processes=2", "--return_after_s=0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1] 1 of 2, at most 3" in result.stdout and "[2] 2 of 3" in result.stdout
    assert "[returning 2] 2 of 3, at most 3" in result.stdout  # started late, as slot 2
    assert "launch.local: slot(s) [2] back: starting them as late processes" in result.stderr
    assert "launch.local: taking back the lost process(es): restarting on 3" in result.stderr


def test_a_minimum_above_the_count_is_one_error_line(tmp_path):
    result = launch_stand_ins(tmp_path, "", "--min_processes=4")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: --min_processes=4 is above --processes=3; pass a minimum no larger than the "
        "process count"]


def test_a_range_whose_minimum_the_mesh_cannot_run_on_is_refused_before_anything_starts(tmp_path):
    """fsdp=4 fixed: 3 processes of 1 device could not go on."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.launch.local", "--processes=4", "--min_processes=3",
         "--devices_per_process=1", "--", "--config=configs/tiny.py", "--config.mesh.data=1",
         "--config.mesh.fsdp=4", f"--workdir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "run").exists()
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no mesh of the axes {"), lines
    assert lines[0].endswith("(checked for 3 devices, as the run would go on after losing hosts; "
                             "raise the range's minimum or change the mesh)")


def test_a_range_whose_minimum_leaves_a_whole_host_idle_is_refused_naming_the_nearest_batch(
        capsys):
    """4 hosts of 8 GPUs, a 3-4 range, batch 256: on 24 GPUs no width in 17..24 divides 256, so
    a whole host would idle at the minimum. The line names 288; the launchers' own check (the
    oracle) takes it, and refuses every batch nearer to 256. launch.local and launch.gke check
    only a 2-4 range's minimum, which takes 256: 3 hosts run on 2 and keep the third as a spare
    (runtime/rendezvous.py)."""
    from jaxscale.launch.cli import check_train_args

    def refused(batch: int, minimum: int = 24) -> bool:
        try:
            check_train_args(["--config=configs/tiny.py", f"--config.train.batch_size={batch}"],
                             32, 4, fewer_devices=(minimum,))
        except SystemExit as e:
            assert e.code == 2
            return True
        return False

    assert refused(256)
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("error: on 24 devices the run would leave 8 idle (no width of them "
                           "divides train.batch_size=256), a whole host's 8"), line
    assert "(the nearest: 288)" in line, line
    assert not refused(288)
    assert all(refused(b) for b in range(225, 288) if b != 256)
    assert not refused(256, minimum=16)


@pytest.mark.parametrize("batch, per_host, counts", [
    (8, 1, [1, 2, 4]),  # 3 devices: a width of 2, the third host all idle
    (12, 1, [1, 2, 3, 4]),
    (8, 2, [1, 2, 4]),  # 6 devices: a width of 4, the third host's 2 idle
    (24, 2, [1, 2, 3, 4]),  # 6 devices: a width of 6
])
def test_the_host_counts_a_run_runs_on_leave_no_host_all_idle(batch, per_host, counts):
    """Closed form: a count runs when the widest width of its devices that divides the batch
    leaves fewer than one host's devices idle."""
    c = config(batch)
    assert [n for n in range(1, 5) if runs_on(c, n, per_host, 4)] == counts
    widths = {n: max(w for w in range(1, n * per_host + 1) if batch % w == 0) for n in range(1, 5)}
    assert counts == [n for n, w in widths.items() if n * per_host - w < per_host]
