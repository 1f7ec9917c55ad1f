"""How the train step runs, as opposed to what it computes: its layer loop and its loss's slices.

    model.scan_unroll      layers per iteration of the layer loop (`lax.scan`'s `unroll`): 1, a
                           loop over single layers; 0, no loop (every layer written out)
    model.loss_chunk_len   positions of a row whose float32 logits exist at once (0: all)
    model.loss_vocab_tile  vocabulary entries of those logits made at once (0: all)

None of them changes the step's values beyond the order of a sum, nor the train state's layout
(checkpoints move freely between them): they trade speed for memory, and which side of the trade
pays differs by device: on a GPU the unrolled step with whole logits is the faster (the loop
writes each layer's gradients and saved activations into stacks, the slices and tiles remake the
logits in pieces); on a TPU v5p the slices and tiles are what fits llama3_8b's step in less memory
per chip, and a loop keeps compile time flat in depth (benchmarks/RESULTS.md, issue 44's H200
figures and benchmarks/memory.py's).

-1, each key's default, leaves the key to the device: `choices` lists what a device tries, in its
order of preference; a key the config sets is kept as set in every choice. A GPU tries the fast
settings, then the lean ones; a TPU and a CPU (tests, small experiments: compile time is what
matters there) the lean ones only. A plain run takes the first choice whose compiled step fits
the device's memory (`jaxscale.training.program.TrainProgram.compile_fitting_step`); `mesh.auto`
and `python -m jaxscale.plan` compile (and `mesh.auto` times) every choice with every layout.
"""

from __future__ import annotations

import dataclasses

import ml_collections

AUTO = -1  # the keys' default: the device chooses
# Under the lean settings: the positions and vocabulary entries whose float32 logits exist at
# once. Llama 3's 128256-entry vocabulary is 8 tiles.
LEAN_CHUNK_LEN = 1024
LEAN_VOCAB_TILE = 16384


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Values of the three keys (none of them AUTO)."""
    scan_unroll: int
    loss_chunk_len: int
    loss_vocab_tile: int

    def apply(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of `config` set to these settings."""
        config = config.copy_and_resolve_references()
        config.model.update(dataclasses.asdict(self))
        return config

    def label(self) -> str:
        """The settings in words, for the planner's table and the trainer's start-up line."""
        loop = {0: "layers unrolled", 1: "a layer loop"}.get(
            self.scan_unroll, f"{self.scan_unroll} layers a loop turn")
        if self.loss_chunk_len == 0 and self.loss_vocab_tile == 0:
            return f"{loop}, whole logits"
        chunk = f"{self.loss_chunk_len} positions" if self.loss_chunk_len else "whole rows"
        tile = f"{self.loss_vocab_tile} entries" if self.loss_vocab_tile else "whole vocabulary"
        return f"{loop}, logits in slices of {chunk} x {tile}"

    def cell(self) -> str:
        """The settings in a planner table's cell: the layer loop (`unrolled`, `loop`, `loop/N`
        for N layers a turn), then the logits' slices (`whole`, or positions x vocabulary
        entries, `all` where a key is 0)."""
        loop = {0: "unrolled", 1: "loop"}.get(self.scan_unroll, f"loop/{self.scan_unroll}")
        if self.loss_chunk_len == 0 and self.loss_vocab_tile == 0:
            return f"{loop}, whole"
        return f"{loop}, {self.loss_chunk_len or 'all'}x{self.loss_vocab_tile or 'all'}"


FAST = StepSettings(scan_unroll=0, loss_chunk_len=0, loss_vocab_tile=0)
LEAN = StepSettings(scan_unroll=1, loss_chunk_len=LEAN_CHUNK_LEN, loss_vocab_tile=LEAN_VOCAB_TILE)
# What each platform (jax.Device.platform) tries, in order; any other platform: the lean.
PREFERENCES = {"gpu": (FAST, LEAN), "tpu": (LEAN,), "cpu": (LEAN,)}


def choices(config: ml_collections.ConfigDict, platform: str) -> list[StepSettings]:
    """The settings a run of `config` on `platform`'s devices tries, in order, without repeats:
    the platform's preferences with the keys the config sets kept as set."""
    m = config.model
    found = []
    for preferred in PREFERENCES.get(platform, (LEAN,)):
        settings = StepSettings(**{
            key: preferred_value if getattr(m, key) == AUTO else getattr(m, key)
            for key, preferred_value in dataclasses.asdict(preferred).items()})
        if settings not in found:
            found.append(settings)
    return found

