"""Surviving a long run: Orbax checkpoints (`manager.py`: when to save to which tier, how a failed
save ends, resuming from the newest good one onto any mesh; `restore_from.py`: starting from
another run or a Hugging Face folder; `tier.py`: the persistent tier and the
local one on each host; `barrier.py`: the background barrier every process leaves when one's save
fails; `reading.py`: what one checkpoint holds and one try at reading it; `verdict.py`: telling a
damaged checkpoint from storage that fails for now; `bucket_retries.py`: how long TensorStore
retries a bucket that fails) and stopping on a signal (`signals.py`:
preemption, Ctrl-C)."""

from jaxscale.checkpoint.manager import LOCAL, PERSISTENT, Checkpoints
from jaxscale.checkpoint.reading import Restored
from jaxscale.checkpoint.restore_from import lora_base, restore_from, restore_params

__all__ = ["LOCAL", "PERSISTENT", "Checkpoints", "Restored", "lora_base", "restore_from",
           "restore_params"]
