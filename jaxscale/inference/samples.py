"""Samples during training: every `train.sample_every` steps, the greedy continuation of each of
`train.sample_prompts` (`train.sample_tokens` new tokens) from the parameters being trained,
logged as text to every tracker. A glance at them tells a run that learns from one that only
lowers its loss (repetition, a broken tokenizer, a chat template the model ignores).

The prompts are tokenized once, as the run frames its documents; the sampler is compiled once, on
the training mesh, and each sample reads the current parameters in place (nothing is copied to
the host but the generated ids).
"""

from __future__ import annotations

import ml_collections
from flax import nnx
from jax.sharding import Mesh

from jaxscale.data.tokenizers import decode_continuation, encode_prompt, tokenizer_from_config
from jaxscale.errors import ConfigError
from jaxscale.inference.sampler import Sampler
from jaxscale.parallel.sharding import Rules


def check_samples(config: ml_collections.ConfigDict) -> None:
    """ConfigError when `train.sample_every` is on without prompts, a prompt is not a string, or
    a prompt and its new tokens do not fit in model.max_seq_len."""
    t = config.train
    if not t.sample_every:
        return
    prompts = t.sample_prompts
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"train.sample_prompts={prompts!r} must be a non-empty tuple of "
                          f"strings with train.sample_every={t.sample_every}, e.g. "
                          "--config.train.sample_prompts=\"('Once upon a time',)\"; or "
                          "train.sample_every=0")
    tokenizer = tokenizer_from_config(config)
    for prompt in prompts:
        length = len(encode_prompt(tokenizer, config, prompt))
        if not length:
            raise ConfigError(f"train.sample_prompts has an empty prompt {prompt!r} and the "
                              "tokenizer adds no BOS token; give it some text")
        if length + t.sample_tokens > config.model.max_seq_len:
            raise ConfigError(
                f"train.sample_prompts: {prompt[:40]!r} is {length} tokens and "
                f"train.sample_tokens={t.sample_tokens}: more than model.max_seq_len="
                f"{config.model.max_seq_len}; shorten the prompt or lower train.sample_tokens")


class TrainingSamples:
    """The continuations of the config's prompts by parameters of `graphdef` on `mesh`."""

    def __init__(self, config: ml_collections.ConfigDict, graphdef: nnx.GraphDef, mesh: Mesh,
                 rules: Rules):
        self.config, self.graphdef, self.mesh, self.rules = config, graphdef, mesh, rules
        self.tokenizer = tokenizer_from_config(config)
        self.prompts = {text: encode_prompt(self.tokenizer, config, text)[None]
                        for text in config.train.sample_prompts}
        self._sampler: Sampler | None = None

    def __call__(self, params) -> dict[str, str]:
        """prompt -> its greedy continuation by `params` (the train state's, on the mesh)."""
        if self._sampler is None:  # compiled on first use, for the parameters' tree and layout
            self._sampler = Sampler(nnx.merge(self.graphdef, params), self.mesh, self.rules)
        tokens = self.config.train.sample_tokens
        return {text: decode_continuation(
                    self.tokenizer, self.config,
                    self._sampler.generate(ids, max_new_tokens=tokens, params=params)[0])
                for text, ids in self.prompts.items()}
