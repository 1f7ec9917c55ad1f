"""Counting non-finite steps in a row, and stopping the run when there are too many.

The train step already drops the update of a step whose loss or gradient norm is not finite (and
lowers the float16 loss scale). Here the host counts those skipped steps. Their flags stay on the
device until `settle()` fetches them, on logging steps and before a checkpoint, so counting adds no
device->host sync to other steps.
"""

from __future__ import annotations

import jax

from jaxscale.errors import JaxscaleError


class TooManyBadSteps(JaxscaleError):
    """`train.max_bad_steps` steps in a row were not finite; the run stops."""


class BadSteps:
    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self._pending: list[tuple[int, jax.Array]] = []  # (step, skipped flag on the device)
        self._in_a_row = 0
        self._first_bad_step: int | None = None

    def add(self, step: int, skipped: jax.Array) -> None:
        self._pending.append((step, skipped))

    def settle(self) -> int:
        """Fetches the flags of the steps added since the last call; returns the skipped steps in
        a row ending at the newest step (0 when it was finite). Raises TooManyBadSteps once that
        count reaches `max_in_a_row`."""
        steps = [step for step, _ in self._pending]
        flags = jax.device_get([flag for _, flag in self._pending])
        self._pending.clear()
        for step, skipped in zip(steps, flags):
            if skipped:
                self._first_bad_step = self._first_bad_step or step
                self._in_a_row += 1
            else:
                self._first_bad_step, self._in_a_row = None, 0
        if self._in_a_row >= self.max_in_a_row:
            raise TooManyBadSteps(
                f"{self._in_a_row} steps in a row (from step {self._first_bad_step}) had a "
                f"non-finite loss or gradient norm (train.max_bad_steps={self.max_in_a_row}); "
                f"their updates were skipped and no checkpoint was saved after step "
                f"{self._first_bad_step - 1}. Lower optim.lr, raise optim.warmup_steps or check "
                "the data, then restart from that checkpoint")
        return self._in_a_row
