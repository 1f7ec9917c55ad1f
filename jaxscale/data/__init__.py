"""The trainer's input: an iterator of global, sharded batches with a checkpointable position.

    it = make_input(config, "train", batch_sharding)
    batch = next(it)          # dict of global jax.Arrays, [train.batch_size, train.seq_len]
    state = it.get_state()    # small, JSON-serializable; store it with the checkpoint
    it.set_state(state)       # the next batch is the one an uninterrupted run would get
    it.close()                # stops the prefetch and reader threads

    check_splits(config, ("train", "eval"))  # at start: JaxscaleError if a split has no documents
    check_data(config)  # the data section, reading no document: ConfigError on the first problem

Batch keys: `inputs`, `targets` (int32 next-token pairs), `loss_mask` (float32, 0 on padding;
in chat data, 1 only where the target is an assistant's or a completion's token), `segment_ids`
(int32, 1, 2, ... per packed document, 0 on padding), `positions` (int32, from 0 in each
document). See docs/data.md.
"""

from jaxscale.data.input import HeldOut, Input, check_data, make_input
from jaxscale.data.sources import check_splits

__all__ = ["HeldOut", "Input", "check_data", "check_splits", "make_input"]
