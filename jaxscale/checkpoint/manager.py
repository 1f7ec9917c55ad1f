"""A run's checkpoints: when to save to which tier, how a failed save ends, and resuming from the
newest checkpoint every process can trust (starting from another run's is restore_from.py's).

Two tiers (tier.py): the persistent one (`checkpoint.dir`, often a bucket) and, with
`checkpoint.local_dir`, a local one on each host, saved to more often and on a stop (SIGTERM).

Saving. Orbax writes a checkpoint into a temporary folder and renames it to `<step>` once every
process has finished, so a crash mid-save leaves the earlier checkpoints as they were (the
unfinished folder is removed at the next start), and deletes old checkpoints only after the new
one is complete. How a save went is agreed by every process (tier.py), and `_settle` acts on it
alike everywhere: a local save that failed turns the local tier off for this start; a persistent
save that failed on storage (ENOSPC, EIO) is tried again at the next save while the run trains
on, and ends the run after FAILED_SAVES_IN_A_ROW such failures or when the run cannot go on
without it (exit 75; exit 2 when no space was left). A save the storage refuses (a permission, a
read-only mount, a bucket the account has no rights on) ends it with a JaxscaleError (exit 2): no
retry grants access.

Restoring takes the newest step that every process holds locally, or the newest persistent one,
whichever is newer (`restore_order`). It reads one checkpoint at a time (`reading.py`) and never
renames or deletes one because reading it failed: each failure is sorted into damaged or
unavailable (`verdict.py`), the same on every process. When the storage does not deliver a
persistent checkpoint, the run stops with TransientError (exit 75), every checkpoint where it
was; when it refuses this process, with a JaxscaleError (exit 2), renaming nothing. An older
checkpoint is not used instead: the newer one is likely sound, and the run would later save its
step again over it (a local one that does not read is passed over for an older one: the local
tier only caches what the persistent one holds). A damaged checkpoint is skipped for the one
before it; once one restores, the damaged ones after it are renamed `<step>.corrupt-<time>` with
a warning (a later save of the same step would collide with them). When every checkpoint is
damaged the run stops with a JaxscaleError (exit 2) naming them all and renames nothing, so that
a person can look at them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from etils import epath

from jaxscale.checkpoint.barrier import failure_behind
from jaxscale.checkpoint.reading import (
    Restored,
    State,
    holds_every_shard,
    holds_whole_arrays,
    own_steps,
    process_layout,
)
from jaxscale.checkpoint.tier import SaveOutcome, Tier
from jaxscale.checkpoint.verdict import (
    SaveFailure,
    Verdict,
    raise_unless_ok,
    save_error,
    save_failure_kind,
)
from jaxscale.errors import ConfigError, JaxscaleError, TransientError
from jaxscale.runtime.agreement import gathered, gravest, process_0_decides
from jaxscale.runtime.distributed import host_slot, max_processes
from jaxscale.runtime.storage import check_bucket
from jaxscale.runtime.workdir import check_writable

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    path = config.checkpoint.dir or os.path.join(workdir, CHECKPOINT_SUBDIR)
    # Orbax refuses relative paths; a URL (gs://...) is absolute already.
    return path if "://" in path else os.path.abspath(path)


# The tiers, as `due` names them.
PERSISTENT, LOCAL = "persistent", "local"
# Local checkpoints another layout of the state saved (another process count or mesh), which a
# start restores when every process holds the step whole (`_moved_local`).
MOVED = "local, of another layout"
# The record in a local tier's layout folder of what its checkpoints hold (`_record_layout`).
LAYOUT_RECORD = "layout.json"
# Persistent saves that may fail in a row (on storage; each leaving the checkpoints before it
# intact) while the run trains on; the next failure stops it (docs/checkpointing.md).
FAILED_SAVES_IN_A_ROW = 3
# The newest local steps of each process that a restart compares (checkpoint.local_keep is at
# most half of it, leaving room for steps an earlier start left).
_GATHERED_STEPS = 64


class Checkpoints:
    """The checkpoints of one run: the persistent tier in `checkpoint_dir(config, workdir)` and,
    with `checkpoint.local_dir`, the local tier on each host (tier.py). Tiers are named
    "persistent" and "local" where the trainer picks one (`due`, `save`).

    With `checkpoint.enabled=False` the run has none: nothing is due, nothing restores.
    `async_save=False` makes every save synchronous (the benchmark's baseline).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, async_save: bool = True):
        self.options = o = config.checkpoint
        self.enabled = o.enabled
        self.directory = epath.Path(checkpoint_dir(config, workdir))
        self._async_save = async_save
        self.persistent = Tier(self.directory, process_local=False, keep=o.keep,
                               keep_every_steps=o.keep_every_steps, async_save=async_save)
        # This process's folder of the local tier, named after its slot (its first process id,
        # which an elastic restart's renumbering keeps: runtime/distributed.py). The tier itself
        # lives in a folder named after the layout of the state, made when that is known
        # (`_local_tier`); off: None.
        self._local_root = (epath.Path(os.path.abspath(o.local_dir)) /
                            f"process_{host_slot(os.environ, jax.process_index())}"
                            ) if o.enabled and o.local_dir else None
        self._local: Tier | None = None
        self._local_on = self._local_root is not None
        # The range's maximum, which a narrow run (an elastic run gone on without a host) has
        # fewer processes than: a later start may take a host back, which holds no local copy
        # of what this one saves.
        self._full_count = max_processes(os.environ, jax.process_count())
        self._narrow = jax.process_count() < self._full_count
        # Set by `restore_newest`: why a newer local checkpoint of another layout is not used.
        self.unused_local: str | None = None
        self._last_save = {PERSISTENT: time.monotonic(), LOCAL: time.monotonic()}
        self._owed: str | None = None  # the tier of a due save postponed from a non-finite step
        self._failed_in_a_row = 0  # persistent saves that failed since the last that did not

    def check_writable(self) -> None:
        """ConfigError unless the folders can be created and written; writes nothing."""
        if self.enabled and "://" in str(self.directory):
            check_checkpoint_bucket(str(self.directory), "checkpoint.dir")
        elif self.enabled:
            check_writable(str(self.directory), "checkpoint directory",
                           "pass --config.checkpoint.dir=<a folder you can write>")
        if self._local_root is not None:
            check_writable(str(self._local_root), "checkpoint.local_dir",
                           "pass --config.checkpoint.local_dir=<a folder on this host you can "
                           "write>, or '' for no local checkpoints")

    def open_for_saving(self) -> None:
        """Opens the persistent tier for saving, creating its folder (nothing is written before);
        the local tier opens at its first save."""
        if self.enabled:
            self.persistent.open_for_saving()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the saves in flight on this process (a run that is ending: no agreement);
        raises TransientError or JaxscaleError when the persistent one failed on storage."""
        if self._local is not None:
            try:
                self._local.close()
            except (TransientError, JaxscaleError) as e:
                logger.warning("%s", e)
        self.persistent.close()

    # -- saving ------------------------------------------------------------------------------

    def due(self, step: int, *, log_step: bool, final: bool = False) -> str | None:
        """The tier `step` should be saved to, or None: PERSISTENT on the run's last step, every
        `every_steps`, after `every_minutes`, or for a save postponed from a non-finite step;
        else LOCAL every `local_every_steps` or after `local_every_minutes`.

        The clocks are read on logging steps only, where process 0's answer is shared with the
        others: processes must agree, and a broadcast on every step would cost a sync each.
        """
        if not self.enabled:
            return None
        self._note_finished_saves()
        o = self.options
        persistent = final or self._owed == PERSISTENT or bool(
            o.every_steps and step % o.every_steps == 0)
        local = self._local_on and (self._owed == LOCAL or bool(
            o.local_every_steps and step % o.local_every_steps == 0))
        local_clock = self._local_on and o.local_every_minutes
        if log_step and (o.every_minutes or local_clock):
            now = time.monotonic()
            by_clock = process_0_decides(np.array([
                bool(o.every_minutes) and now - self._last_save[PERSISTENT] >= 60 * o.every_minutes,
                bool(local_clock) and now - self._last_save[LOCAL] >= 60 * o.local_every_minutes]))
            persistent, local = persistent or bool(by_clock[0]), local or bool(by_clock[1])
        return PERSISTENT if persistent else LOCAL if local else None

    def save(self, step: int, state: State, data_state: dict, meta: dict, *,
             finite: bool = True, tier: str = PERSISTENT) -> bool:
        """Starts saving `step` to `tier`; returns once the state is copied off the devices, so
        training can go on (and donate the state's buffers) while the files are written. Waits
        first for the tier's save before it, and settles how that one went (`_settle`).

        A step that was not `finite` is not saved: the save moves to the next step (`due` says
        so), and no checkpoint ever follows a non-finite step. Returns whether it saved: a local
        save that cannot be made turns the local tier off instead.
        """
        if not finite:
            self._owed = tier
            logger.warning("step %d was not finite: its checkpoint waits for a finite step", step)
            return False
        if tier == LOCAL:
            saved = self._save_locally(step, state, data_state, meta)
        else:
            self.persistent.open_for_saving()
            self._settle(PERSISTENT, self.persistent.finish(), can_go_on=True)
            self.persistent.save(step, state, data_state, meta)
            saved = True
        if saved:
            now = time.monotonic()
            self._last_save[LOCAL] = now  # a persistent checkpoint is as fresh as a local one
            if tier == PERSISTENT:
                self._last_save[PERSISTENT] = now
            self._owed = None
        return saved

    def _save_locally(self, step: int, state: State, data_state: dict, meta: dict) -> bool:
        local = self._local_tier(state)
        if local is None:
            return False
        self._settle(LOCAL, local.finish(), can_go_on=True)
        if not self._local_on or not self._local_is_open(state, local):
            return False
        problem = ""
        try:
            local.save(step, state, data_state, meta)
        except (TransientError, JaxscaleError) as e:  # this host's disk: the run goes on
            problem = str(e)
        failed, problem = gravest(bool(problem), problem)
        if failed:
            self._local_off(problem)
        return self._local_on

    def _local_is_open(self, state: State, local: Tier) -> bool:
        """Opens the local tier for saving at its first save, when every process can: every
        shard it holds writable, its folder written (a full disk turns the tier off)."""
        if local.is_open:
            return True
        holds = holds_every_shard(state)
        unfit, problem = gravest(not holds, "" if holds else (
            "it holds shards of one replica and others of another, which Orbax's process-local "
            "writer does not save whole"))
        if unfit:
            self._local_off(f"the local tier cannot serve this mesh ({problem})")
            return False
        try:
            local.open_for_saving()
        except (TransientError, JaxscaleError) as e:  # agreed: the same on every process
            self._local_off(str(e))
            return False
        _record_layout(local.directory, holds_whole_arrays(state))
        return True

    def save_to_stop(self, step: int, state: State, data_state: dict, meta: dict, *,
                     finite: bool = True) -> epath.Path | None:
        """Saves `step` to the fastest tier the next start will find on every host, waits until
        it is durable and returns its folder; None when the step was not finite (no checkpoint
        ever follows one). That is the local tier when it is on, but in a narrow run (fewer
        processes than its range's maximum): the next start may take back a host with no local
        copy, and would resume from an older persistent step, so the stop saves persistently.
        A failed local save turns the local tier off and saves to the persistent tier instead."""
        if not finite:
            return None
        if self._local_on and self._narrow and jax.process_index() == 0:
            logger.info("the run is on %d of its range's %d processes: its stop saves to %s, "
                        "which a wider restart can read on every host", jax.process_count(),
                        self._full_count, self.directory)
        if self._local_on and not self._narrow and self.save(step, state, data_state, meta,
                                                             tier=LOCAL):
            self.wait()
            if self._local_on:
                return self._local.path(step)
        self.save(step, state, data_state, meta)
        self.wait()
        return self.persistent.path(step)

    def wait(self) -> None:
        """Blocks until the saves in flight are durable and settles how they went (every process
        together): raises when the persistent one failed, turns the local tier off when its
        failed."""
        if self._local is not None and self._local_on:
            self._settle(LOCAL, self._local.finish(), can_go_on=False)
        self._settle(PERSISTENT, self.persistent.finish(), can_go_on=False)

    def _settle(self, tier: str, outcome: SaveOutcome, *, can_go_on: bool) -> None:
        """Acts on how a save of `tier` went, every process alike (the outcome is agreed).

        A local save that failed turns the local tier off until the run restarts, with one
        warning: training goes on, saving to the persistent tier. A persistent save the storage
        refused stops the run (JaxscaleError, exit 2). One that failed on storage left the
        checkpoints before it intact: where the run `can_go_on`, training goes on and the next
        save tries again, up to FAILED_SAVES_IN_A_ROW failures in a row; then, or where the run
        cannot go on without it (its last step, a stop), the run stops: with exit 2 when no space
        was left (a restart would train to the same full disk), else with exit 75. Anything else
        is a bug, raised."""
        failure, problem = outcome.failure, outcome.problem
        if failure is SaveFailure.NONE:
            if tier == PERSISTENT and outcome.step is not None:
                self._failed_in_a_row = 0
            return
        if failure is SaveFailure.BUG:
            own = failure_behind(outcome.error) if outcome.error is not None else None
            if own is not None and save_failure_kind(own)[0] is SaveFailure.BUG:
                raise outcome.error
            raise RuntimeError(f"a checkpoint save failed on another process: {problem}")
        if tier == LOCAL:
            self._local_off(f"the local checkpoint of step {outcome.step} could not be written "
                            f"({problem})")
            return
        what = f"checkpoint {self.persistent.path(outcome.step)} could not be written"
        if failure is SaveFailure.REFUSED:
            raise save_error(failure, what, problem)
        if failure is SaveFailure.MISSING:  # as STORAGE, unless the bucket itself is gone
            self.persistent.raise_if_bucket_gone()
        self._failed_in_a_row += 1
        in_a_row = (f"; {self._failed_in_a_row} saves in a row failed"
                    if self._failed_in_a_row > 1 else "")
        if failure is SaveFailure.NO_SPACE and (
                not can_go_on or self._failed_in_a_row >= FAILED_SAVES_IN_A_ROW):
            raise JaxscaleError(
                f"{what}: no space left ({problem}){in_a_row}; the checkpoints before it are "
                f"intact. Free space in {self.directory} (or lower checkpoint.keep, or point "
                "checkpoint.dir at a folder with room), then run the same command again")
        if not can_go_on or self._failed_in_a_row >= FAILED_SAVES_IN_A_ROW:
            raise TransientError(f"{what}; the checkpoints before it are intact and a restart "
                                 f"resumes from the newest ({problem}){in_a_row}")
        logger.warning("%s (%s); the checkpoints before it are intact. Training goes on and the "
                       "next save tries again (%d failed in a row; %d stop the run)", what,
                       problem, self._failed_in_a_row, FAILED_SAVES_IN_A_ROW)

    def _local_tier(self, state: Any) -> Tier | None:
        """The local tier for `state`'s layout (arrays or abstract shapes); None while off."""
        if self._local_on and self._local is None:
            self._local = Tier(self._local_root / process_layout(state), process_local=True,
                               keep=self.options.local_keep, async_save=self._async_save,
                               label="local checkpoint", metrics_prefix="local_")
        return self._local if self._local_on else None

    def _local_off(self, why: str) -> None:
        """Turns the local tier off for the rest of this start (every process alike), saying so
        once: the persistent tier goes on."""
        self._local_on = False
        if self._owed == LOCAL:
            self._owed = None
        if jax.process_index() == 0:
            logger.warning("%s; local checkpoints are off until the run restarts: checkpoints go "
                           "to %s only", why, self.directory)

    def take_metrics(self) -> dict[str, float]:
        """Timings of saves since the last call, of each tier: the blocking part and the total
        (start to durable)."""
        self._note_finished_saves()
        metrics = {}
        for tier in (self.persistent, self._local):
            if tier is not None:
                metrics.update(tier.metrics)
                tier.metrics = {}
        return metrics

    def _note_finished_saves(self) -> None:
        for tier in (self.persistent, self._local):
            if tier is not None and tier.is_open:
                tier.note_finished_save()

    # -- restoring ---------------------------------------------------------------------------

    def restore_newest(self, abstract_state: State) -> Restored | None:
        """The newest checkpoint that restores, into `abstract_state`'s shapes and shardings:
        of the local tier when every process holds it (in this layout, or whole in another:
        `_moved_local`, a restart on another process count), else of the persistent tier
        (`restore_order`).

        Reads only, but for damaged checkpoints newer than the one restored, which are renamed
        (see the module's docstring), and for local checkpoints newer than it that some process
        lacks, which no start can use and which are removed. Raises TransientError when the
        storage does not deliver a checkpoint (a local one only when nothing older restores),
        JaxscaleError when every checkpoint is damaged, and ConfigError when one does not fit
        the model config (the user's to resolve).
        """
        if not self.enabled:
            return None
        # Agreed, and before any process writes: a process that looked after another had created
        # the folder would open a reader (and its barriers) that the others do not.
        persistent = self.persistent.steps()
        local = self._local_tier(abstract_state)
        mine = local.steps() if local is not None else []
        everyone, incomplete = steps_everyone_holds(mine) if local is not None else ([], [])
        moved = self._moved_local() if local is not None else {}
        tiers = {PERSISTENT: self.persistent, LOCAL: local}
        damaged: dict[str, dict[int, str]] = {PERSISTENT: {}, LOCAL: {}}
        restored, unavailable = None, None
        for step, name in restore_order(everyone, persistent, sorted(moved)):
            tier = moved[step] if name == MOVED else tiers[name]
            outcome = tier.restore(step, abstract_state)
            if outcome.verdict is Verdict.OK:
                restored = outcome.value
                break
            if name == MOVED:  # another layout's: left as it is, for a start in that layout
                logger.warning("%s %s could not be read (%s); trying the one before it",
                               tier.label, tier.path(step), outcome.problem)
                continue
            if outcome.verdict is Verdict.DAMAGED:
                damaged[name][step] = outcome.problem
                logger.warning("%s %s is damaged (%s); trying the one before it", tier.label,
                               tier.path(step), outcome.problem)
            elif name == LOCAL and outcome.verdict is Verdict.UNAVAILABLE:
                unavailable = unavailable or outcome
                logger.warning("%s %s could not be read (%s); trying the one before it",
                               tier.label, tier.path(step), outcome.problem)
            else:
                raise_unless_ok(outcome, f"{tier.label} {tier.path(step)}")
        if restored is None and unavailable is not None:
            raise_unless_ok(unavailable, "the newest local checkpoint")
        if restored is None and (damaged[PERSISTENT] or damaged[LOCAL]):
            named = "; ".join(f"{'local ' if name == LOCAL else ''}{step}: {problem}"
                              for name in (LOCAL, PERSISTENT)
                              for step, problem in damaged[name].items())
            folders = " and ".join(str(tiers[name].directory) for name in (LOCAL, PERSISTENT)
                                   if damaged[name])
            raise JaxscaleError(
                f"every checkpoint in {folders} is damaged ({named}); none was renamed, so that "
                "you can inspect them: repair them, or move them away to start the run from "
                "scratch")
        for name, tier in tiers.items():
            if damaged[name]:
                tier.set_aside(damaged[name], restored.path if restored else None)
        since = restored.meta["step"] if restored is not None else -1
        if local is not None:
            local.remove([step for step in incomplete if step > since],
                         "another process lacks its part, so no start can restore it")
            self.unused_local = self._newer_in_another_layout(since)
        return restored

    def _moved_local(self) -> dict[int, Tier]:
        """{step: the tier of this process's folder that holds it} for the local steps that
        another layout saved and that every process holds whole (`_record_layout`), so that each
        restores its own copy onto the new layout exactly; agreed (one gather). A shard that only
        a lost process held is in no survivor's folder: no such step is taken."""
        folders: dict[int, epath.Path] = {}
        for folder in self._other_layouts():
            try:
                steps = own_steps(folder) if _whole_arrays_recorded(folder) else []
            except OSError as e:  # this process lacks them: the gather says so to the others
                logger.warning("local checkpoints in %s cannot be listed (%s); not used", folder, e)
                steps = []
            for step in steps:
                folders.setdefault(step, folder)
        everyone, _ = steps_everyone_holds(list(folders))
        return {step: Tier(folders[step], process_local=True, keep=self.options.local_keep,
                           label="local checkpoint") for step in everyone}

    def _other_layouts(self) -> list[epath.Path]:
        """This process's local tier folders of other layouts than this start's; none when its
        folder cannot be listed (said by `_newer_in_another_layout`)."""
        try:
            return sorted(folder for folder in self._local_root.iterdir()
                          if folder != self._local.directory and folder.is_dir())
        except OSError:
            return []

    def _newer_in_another_layout(self, since: int) -> str | None:
        """Why the newest local checkpoint after step `since` in this process's folder of another
        layout is not used (a start on another mesh, sharding or process count saved it); None
        when there is none. Kept, not removed: a start in that layout again resumes from it."""
        newest = None
        try:
            for folder in self._local_root.iterdir():
                if folder == self._local.directory or not folder.is_dir():
                    continue
                steps = [step for step in own_steps(folder) if step > since]
                if steps and (newest is None or max(steps) > newest[1]):
                    newest = folder, max(steps)
        except OSError:  # no folder yet, or one that cannot be listed: nothing to say of it
            return None
        if newest is None:
            return None
        folder, step = newest
        return (f"local checkpoint {folder / str(step)} is not used: another layout of the state "
                "(mesh, sharding or process count) saved it, and it restores onto this one only "
                "when every process holds it whole (a full replica each: data parallelism across "
                "processes), which they do not")


def restore_order(local: Sequence[int], persistent: Sequence[int], moved: Sequence[int] = ()
                  ) -> list[tuple[int, str]]:
    """The checkpoints a start tries, newest first, as (step, tier): the `local` steps (those
    every process holds), the `moved` ones (local steps of another layout that every process
    holds whole) and the `persistent` ones; of a step in several, the local copy first, then
    the moved one (the faster reads)."""
    rank = {LOCAL: 0, MOVED: 1, PERSISTENT: 2}
    return sorted([(step, LOCAL) for step in local] + [(step, MOVED) for step in moved] +
                  [(step, PERSISTENT) for step in persistent],
                  key=lambda candidate: (-candidate[0], rank[candidate[1]]))


def steps_everyone_holds(mine: Sequence[int],
                         gather: Callable[[np.ndarray], np.ndarray] = gathered
                         ) -> tuple[list[int], list[int]]:
    """(the steps every process holds, of the newest _GATHERED_STEPS of each; those of this
    process's that another lacks), oldest first. `gather` stacks every process's row (a test's
    stand-in for the allgather)."""
    newest = sorted(mine)[-_GATHERED_STEPS:]
    row = np.full(_GATHERED_STEPS, -1, np.int32)
    row[:len(newest)] = newest
    rows = np.asarray(gather(row)).reshape(-1, _GATHERED_STEPS)
    everyone = set.intersection(*(set(r[r >= 0].tolist()) for r in rows))
    return sorted(everyone), sorted(set(newest) - everyone)


def _record_layout(folder: epath.Path, whole_arrays: bool) -> None:
    """Writes in a local tier's layout `folder` whether its checkpoints hold every array whole
    (a start on another layout may then restore them); when it cannot, the folder is only ever
    restored in its own layout (a warning says so)."""
    try:
        (folder / LAYOUT_RECORD).write_text(json.dumps({"whole_arrays": whole_arrays}))
    except OSError as e:
        logger.warning("%s could not be written (%s): its local checkpoints restore only onto "
                       "this layout", folder / LAYOUT_RECORD, e)


def _whole_arrays_recorded(folder: epath.Path) -> bool:
    """Whether `folder`'s layout record says its checkpoints hold every array whole; False
    without one (a folder saved before records were written) or when it cannot be read."""
    try:
        return json.loads((folder / LAYOUT_RECORD).read_text()).get("whole_arrays") is True
    except (OSError, ValueError, AttributeError):
        return False


def check_checkpoint_bucket(path: str, key: str) -> None:
    """ConfigError unless checkpoints can be kept in the bucket `path` (config key `key`): its
    library installed, a bucket Orbax writes arrays to, and one that exists and answers."""
    # Orbax (0.12.8) gives TensorStore's own gcs driver the gs:// paths; any other URL reaches
    # its array writer as a local path ("s3:/b/x", after normpath), refused as not absolute at
    # the first save. TensorStore's s3 driver (OCDBT over it) and etils' epath both write to
    # moto's server; Orbax alone does not route s3:// to them (tests/test_buckets.py).
    if not path.startswith("gs://"):
        raise ConfigError(f"{key}={path!r}: Orbax keeps checkpoints in a local folder or a gs:// "
                          "bucket only (it hands TensorStore's bucket drivers gs:// paths alone "
                          "and takes s3:// for a relative local path); pass a gs:// path, or a "
                          "folder (an S3 bucket mounted with mountpoint-s3, for one); the data "
                          "can stay in s3://")
    check_bucket(path, key)
