"""How a family's parameters lie in a Hugging Face folder: one `HfTensor` per parameter, which a
family's `hf_tensors(cfg)` lists and jaxscale/hf/ reads and writes.

Each jaxscale parameter is one Hugging Face tensor (or one per layer, stacked on the `layers`
axis) reshaped and transposed: HF's Linear weights are [out, in], ours [in, ..., out] with the
heads split out; both use RoPE's "rotate half" layout, so no permutation of q/k rows is needed.
The embedding and head have `padded_vocab_size` rows here and `vocab_size` in the files.

A mixture of experts' expert weights are one parameter per layer with an `experts` axis after
`layers`, and one Hugging Face tensor per layer and expert (`with_experts`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from jaxscale.errors import JaxscaleError

LAYER = "model.layers.{}."  # the prefix of a decoder layer's tensors; "{}" is the layer
# transformers (5.x) fuses a mixture's experts, whatever its files name them, into one module per
# layer holding gate_up_proj [experts, 2 x mlp, d_model] (the gate's rows, then the up's) and
# down_proj [experts, d_model, mlp] as parameters: where PEFT sits the experts' adapters.
FUSED_EXPERTS = LAYER + "mlp.experts"


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One parameter: `hf_name` ("{}" = the layer), whose [out, in] tensor reshaped to `view` and
    transposed by `perm` is our (one layer's, unpadded) array."""
    path: tuple[str, ...]
    hf_name: str
    view: tuple[int, ...]
    perm: tuple[int, ...]
    # > 0: one tensor per layer and expert, "{expert}" in `hf_name` naming the expert, stacked on
    # our `experts` axis after `layers`.
    experts: int = 0

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

    def lead_shape(self, n_layers: int) -> tuple[int, ...]:
        """The axes our array has before the file's tensor: (), (layers,) or (layers, experts)."""
        return ((n_layers,) if self.stacked else ()) + ((self.experts,) if self.experts else ())

    def indices(self, n_layers: int) -> list[tuple[int, ...]]:
        """Where each file tensor (in `names` order) lies along `lead_shape`."""
        return list(itertools.product(*map(range, self.lead_shape(n_layers))))

    def names(self, n_layers: int) -> list[str]:
        if not self.experts:
            return [self.hf_name.format(*index) for index in self.indices(n_layers)]
        return [self.hf_name.format(layer, expert=expert)
                for layer, expert in self.indices(n_layers)]


def with_experts(dense: list[HfTensor], cfg: Any, router: str,
                 experts: tuple[str, str, str]) -> list[HfTensor]:
    """The tensors of `cfg`'s model, whose every layer is an MoE layer (`cfg.moe.every` 1), from
    those of the same model with dense feed-forwards (`dense`): each block's parameters moved
    into the stack's unit (the one block of its `BlockGroup`), its dense feed-forward replaced
    by the router (`router`, a layer's tensor name after LAYER) and the experts' gate, up and
    down weights (`experts`, with "{expert}")."""
    check_moe_in_every_layer(cfg)
    d, f, e = cfg.d_model, cfg.mlp_dim, cfg.moe.experts
    block = ("blocks", "layers", 0)
    moe = [HfTensor(block + ("mlp", "router"), LAYER + router, (e, d), (1, 0))] + [
        HfTensor(block + ("mlp", name), LAYER + hf_name, view, (1, 0), experts=e)
        for name, hf_name, view in zip(("gate", "up", "down"), experts, ((f, d), (f, d), (d, f)))]
    tensors = []
    for t in dense:
        if t.path[:2] == ("blocks", "mlp"):
            tensors += moe if t.path[2] == "gate" else []
        else:
            tensors.append(dataclasses.replace(t, path=block + t.path[1:]) if t.stacked else t)
    return tensors


def check_moe_in_every_layer(cfg: Any) -> None:
    """JaxscaleError unless `cfg`'s every layer is an MoE layer, as a Hugging Face mixture of
    experts' is."""
    every = cfg.moe.every if cfg.moe else 0
    if every != 1:
        raise JaxscaleError(f"model.moe.every={every} has no Hugging Face {cfg.family} layout, "
                            "whose every layer is MoE; use model.moe.every=1")
