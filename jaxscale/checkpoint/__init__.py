"""Surviving a long run: Orbax checkpoints (`manager.py`: when to save, async multi-host saves,
restoring the newest good one onto any mesh; `reading.py`: what one checkpoint holds and one try
at reading it; `verdict.py`: telling a damaged checkpoint from storage that fails for now) and
stopping on a signal (`signals.py`: preemption, Ctrl-C)."""

from jaxscale.checkpoint.manager import Checkpoints, lora_base, restore_from, restore_params
from jaxscale.checkpoint.reading import Restored

__all__ = ["Checkpoints", "Restored", "lora_base", "restore_from", "restore_params"]
