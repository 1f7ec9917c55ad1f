"""Taking a returning host back (an elastic run on fewer processes than its range's maximum).

A process that finds the run started without it (rendezvous.RunStarted) announces itself with a
marker, `<checkpoint.dir>/elastic/arrived/<slot>`, and keeps trying the rendezvous until its
start-up timeout (then it exits 75, and its launcher starts it again). Process 0 of the narrower
run lists that folder every `LIST_EVERY_S` seconds, in a thread (never per step: on a bucket a
listing is a request); on a marker it asks for a planned stop, and every process saves one agreed
step and exits 42. The next start's rendezvous admits the returning process, and its process 0
removes every marker it finds (`cleared`): a marker is acted on once, and a process still left out
writes its marker again on its next try.

Why the checkpoint folder: it is the one place every launcher gives every process (a bucket on
GKE), while the coordinator port belongs to JAX's gRPC service once the run has started.

Why the stop is a SIGTERM that process 0 sends itself: JAX's preemption sync point, which every
process asks after every step (checkpoint/signals.py), is where the processes agree on one step to
stop at; a notice on one process reaches the others there, as a Ctrl-C's does, and costs nothing
while none is pending.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

import jax

from jaxscale.runtime.storage import filesystem, library_errors, writing

LIST_EVERY_S = 2.0  # a listing is a request on a bucket: about 43,000 a day
FOLDER = "elastic/arrived"  # in the checkpoint folder
KEY = "checkpoint.dir"
FIX = f"check that {KEY} can be written by every process"


def _folder(checkpoint_dir: str):
    """(the filesystem, the markers' folder within it)."""
    fs, inner = filesystem(checkpoint_dir, KEY)
    return fs, f"{inner.rstrip('/')}/{FOLDER}"


def shown(checkpoint_dir: str) -> str:
    """The markers' folder, as the user gave the checkpoint folder (a local path, a URL)."""
    return f"{checkpoint_dir.rstrip('/')}/{FOLDER}"


def announce(checkpoint_dir: str, slot: str) -> str | None:
    """Writes this slot's marker unless it is there; returns its path when written now."""
    fs, folder = _folder(checkpoint_dir)
    path = f"{folder}/{slot}"
    with writing(path, FIX):
        fs.invalidate_cache(folder)
        if fs.exists(path):
            return None
        fs.makedirs(folder, exist_ok=True)
        fs.pipe_file(path, b"")
    return f"{shown(checkpoint_dir)}/{slot}"


def arrived(checkpoint_dir: str) -> list[str]:
    """The slots whose markers are in the folder, sorted."""
    fs, folder = _folder(checkpoint_dir)
    fs.invalidate_cache(folder)  # a bucket's library caches listings
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False))
    except FileNotFoundError:
        return []


def cleared(checkpoint_dir: str) -> list[str]:
    """Removes every marker (process 0, at a start); returns their slots."""
    fs, folder = _folder(checkpoint_dir)
    with writing(folder, FIX):
        slots = arrived(checkpoint_dir)
        for slot in slots:
            fs.rm(f"{folder}/{slot}")
    return slots


@contextlib.contextmanager
def watched(checkpoint_dir: str, *, elastic: bool, narrower: bool,
            widens: Callable[[int], bool] = lambda arrived: True):
    """Process 0 of a run with a host range (`elastic`) clears the markers at its start; on fewer
    processes than its maximum (`narrower`) it watches for arrivals while the block runs, and
    asks for the planned stop once those arrived make a count that `widens` the run (not every
    count runs: runtime/rendezvous.py's spares)."""
    if not elastic or jax.process_index() != 0:
        yield
        return
    if slots := cleared(checkpoint_dir):
        print(f"jaxscale: elastic: arrival marker(s) of slot(s) {slots} cleared at this start "
              f"({jax.process_count()} processes)", flush=True)
    if not narrower:
        yield
        return
    done = threading.Event()
    watch = threading.Thread(target=_watch, args=(checkpoint_dir, done, widens), daemon=True)
    watch.start()
    try:
        yield
    finally:
        done.set()
        watch.join()


def _watch(checkpoint_dir: str, done: threading.Event, widens: Callable[[int], bool]) -> None:
    waiting: list[str] = []  # the slots said to wait, said once
    while not done.wait(LIST_EVERY_S):
        try:
            slots = arrived(checkpoint_dir)
        except (OSError, *library_errors()):
            continue  # the storage failing for now: the next listing tries again
        if slots and not widens(len(slots)):
            if slots != waiting:
                print(f"jaxscale: elastic: slot(s) {slots} waiting as spares: with them the run "
                      "would leave a whole host's devices idle; it goes on until more come",
                      flush=True)
                waiting = slots
            continue
        if slots and _stop_can_be_asked():
            print(f"jaxscale: elastic: slot(s) {slots} arrived ({shown(checkpoint_dir)}); "
                  "saving at an agreed step and exiting 42 to restart with them", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _stop_can_be_asked() -> bool:
    """Whether a SIGTERM now is a planned stop: with several processes JAX's preemption service
    catches it from the start; a single process catches it only while it trains
    (checkpoint/signals.py's handler), and before that it would end the process unsaved."""
    return jax.process_count() > 1 or callable(signal.getsignal(signal.SIGTERM))
