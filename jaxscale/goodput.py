"""A run's restarts and goodput, counted across the processes that resume it.

Goodput is the share of wall time since the run first started that went into training steps that
count. Start-up, compilation, restoring, eval, the blocking part of checkpoint saves, and steps
redone after a restart do not count: the productive seconds travel inside each checkpoint, so the
steps a crash loses (those after the last checkpoint) drop out when the run resumes. When the run
first started and how many times it has started live in `<workdir>/run.json`.
"""

from __future__ import annotations

import json
import os
import time

RUN_RECORD = "run.json"


class RunClock:
    """Reads and updates `<workdir>/run.json`; only process 0 should pass `enabled=True`."""

    def __init__(self, workdir: str, *, enabled: bool):
        self.started_at, self.restarts = time.time(), 0
        if not enabled:
            return
        path = os.path.join(workdir, RUN_RECORD)
        record = {"started_at": self.started_at, "starts": 0}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        record["starts"] += 1
        # Written whole then renamed: a crash mid-write must not lose the run's start time.
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
        self.started_at, self.restarts = record["started_at"], record["starts"] - 1

    def goodput(self, productive_seconds: float) -> float:
        return productive_seconds / max(time.time() - self.started_at, 1e-9)
