"""Samples during training (train.sample_every): each is the greedy continuation of its prompt by
the parameters of that step (checked against the full forward pass of the checkpoint of that
step), written to samples.jsonl and every tracker; bad settings are one error line."""

import json

import numpy as np
import pytest
from flax import nnx

from jaxscale.checkpoint import restore_from
from jaxscale.checks import validate
from jaxscale.data.tokenizers import tokenizer_from_config
from jaxscale.errors import ConfigError
from jaxscale.trainer import Trainer
from tests.helpers import one_line_error, small_config
from tests.test_sample import full_forward_greedy

PROMPTS = ("Once upon a time", "def f(")


def sampling_config(**train):
    config = small_config(data=8)
    config.train.update({**dict(steps=4, log_every=2, sample_every=2, sample_prompts=PROMPTS,
                                sample_tokens=6), **train})
    config.checkpoint.update(compilation_cache=False, every_steps=2)
    return config


@pytest.mark.slow  # trains with samples, then decodes each step's checkpoint (about 13 s)
def test_samples_are_the_greedy_continuations_of_the_parameters_of_that_step(tmp_path):
    config = sampling_config()
    trainer = Trainer(config, str(tmp_path))
    trainer.run()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4]
    tokenizer = tokenizer_from_config(config)
    program = trainer.program
    for line in lines:
        restored = restore_from(str(tmp_path / "checkpoints" / str(line["step"])),
                                program.abstract_state, params_only=True,
                                model_config=program.model.config)
        model = nnx.merge(program.model.graphdef, restored.params)
        expected = {}
        for prompt in PROMPTS:  # the run's framing: BOS first; no EOS cut (add_eos ends nothing)
            ids = np.asarray([[tokenizer.bos_id, *tokenizer.encode(prompt)]], np.int32)
            tokens = full_forward_greedy(model, ids, config.train.sample_tokens)[0]
            ends = np.flatnonzero(tokens == tokenizer.eos_id)
            expected[prompt] = tokenizer.decode(tokens[:ends[0]] if len(ends) else tokens)
        assert line["samples"] == expected
    # Two steps of training change what the model says (else the check above proves little).
    assert lines[0]["samples"] != lines[1]["samples"]


@pytest.mark.parametrize("train, message", [
    (dict(sample_prompts=()), "must be a non-empty tuple of strings"),
    (dict(sample_prompts=(3,)), "must be a non-empty tuple of strings"),
    (dict(sample_tokens=10_000), "more than model.max_seq_len"),
])
def test_bad_sampling_settings_are_one_error_line(train, message):
    config = sampling_config()
    config.train.update(**train)
    assert message in one_line_error(ConfigError, lambda: validate(config, 8))


def test_no_prompts_are_needed_when_sampling_is_off():
    config = sampling_config(sample_every=0)
    config.train.sample_prompts = ()
    validate(config, 8)
