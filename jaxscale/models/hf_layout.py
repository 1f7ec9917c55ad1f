"""How a family's parameters lie in a Hugging Face folder: one `HfTensor` per parameter, which a
family's `hf_tensors(cfg)` lists and jaxscale/hf/ reads and writes.

Each jaxscale parameter is one Hugging Face tensor (or one per layer, stacked on the `layers`
axis) reshaped and transposed: HF's Linear weights are [out, in], ours [in, ..., out] with the
heads split out; both use RoPE's "rotate half" layout, so no permutation of q/k rows is needed.
The embedding and head have `padded_vocab_size` rows here and `vocab_size` in the files.
"""

from __future__ import annotations

import dataclasses

LAYER = "model.layers.{}."  # the prefix of a decoder layer's tensors; "{}" is the layer


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One parameter: `hf_name` ("{}" = the layer), whose [out, in] tensor reshaped to `view` and
    transposed by `perm` is our (one layer's, unpadded) array."""
    path: tuple[str, ...]
    hf_name: str
    view: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The file's shape: `view` with the heads merged back into one dimension."""
        if len(self.view) == 3:  # q/k/v: [heads, head_dim, in]; o: [out, heads, head_dim]
            return ((self.view[0] * self.view[1], self.view[2]) if self.perm[0] == 2
                    else (self.view[0], self.view[1] * self.view[2]))
        return self.view

    @property
    def stacked(self) -> bool:
        """Whether it is one tensor per layer, stacked on our `layers` axis."""
        return "{}" in self.hf_name

    def names(self, n_layers: int) -> list[str]:
        return [self.hf_name.format(i) for i in range(n_layers)] if self.stacked \
            else [self.hf_name]
