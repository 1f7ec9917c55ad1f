"""`python -m jaxscale.sample --workdir=DIR | --hf=FOLDER --prompt=TEXT [--max_new_tokens=N]
[--temperature=T] [--top_p=P] [--seed=S]`

Continues a prompt with a trained run's newest checkpoint (its parameters only) or a Hugging Face
Llama or Qwen3 folder, and prints the continuation. One jitted program prefills a KV cache with the
prompt and decodes one token at a time, sharded on the run's mesh (all devices on `data` when the
run's mesh does not fit the devices here). Temperature 0 is greedy; top-p keeps the smallest set of
most likely tokens whose probability reaches P. The same seed gives the same text. The text stops at
the tokenizer's EOS when the run framed documents with one. A mistake the user can fix prints one
`error: ...` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from jaxscale.cli import ArgumentParser, fail_with, number_flag
from jaxscale.config import NUMBERS
from jaxscale.errors import ConfigError, JaxscaleError, TransientError
from jaxscale.kinds import real, whole
from jaxscale.runtime import cuda_plugin
from jaxscale.runtime.tpu_host import quiet_libtpu
from jaxscale.runtime.workdir import folder_or_bucket_flag

PROG = "python -m jaxscale.sample"
# The kinds of the numeric flags (jaxscale.config.Number), as the config's keys have theirs.
MAX_NEW_TOKENS = whole("[1, inf)")
TEMPERATURE = real("[0, inf)", {0: "greedy", 1: "the model's own distribution"})
TOP_P = real("(0, 1]", {1: "keeps every token"})
SEED = NUMBERS["train.seed"]  # the same seeds as training's


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n", 1)[1].strip(),
                            epilog=f"example: {PROG} --workdir=runs/default "
                                   "--prompt='def fib(n):' --temperature=0.7")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", metavar="DIR", type=folder_or_bucket_flag,
                        help="A run's workdir: its config.json and newest checkpoint (local, or "
                             "gs://... copied there).")
    source.add_argument("--hf", metavar="FOLDER", type=folder_or_bucket_flag,
                        help="A Hugging Face Llama or Qwen3 folder (config.json, safetensors, "
                             "tokenizer.json), local or gs://, s3://.")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="The text to continue.")
    parser.add_argument("--max_new_tokens", type=number_flag(MAX_NEW_TOKENS), default=100,
                        metavar="N", help="How many tokens to generate (default 100).")
    parser.add_argument("--temperature", type=number_flag(TEMPERATURE), default=0.8, metavar="T",
                        help="Softmax temperature; 0 is greedy (default 0.8).")
    parser.add_argument("--top_p", type=number_flag(TOP_P), default=0.95, metavar="P",
                        help="Nucleus sampling: sample among the most likely tokens that together "
                             "have this probability; 1 keeps all (default 0.95).")
    parser.add_argument("--seed", type=number_flag(SEED), default=0, metavar="S",
                        help="Random seed: the same seed gives the same text (default 0).")
    return parser


# --- the command line ---------------------------------------------------------------------------

def run_config(workdir: str):
    """The run's config (config.json over the defaults) and the checkpoint folder holding at least
    one step; ConfigError naming what is missing."""
    from jaxscale.checkpoint.manager import checkpoint_dir
    from jaxscale.checkpoint.restore_from import saved_steps
    from jaxscale.runtime.workdir import read_config

    config = read_config(workdir)
    directory = checkpoint_dir(config, workdir)  # local, or a bucket (checkpoint.dir=gs://...)
    if not saved_steps(directory):
        raise ConfigError(f"workdir {workdir!r} has no checkpoint in {directory}; train it first "
                          f"(python -m jaxscale.train --workdir={workdir}), or pass the workdir "
                          "of a run that has saved one")
    return config, directory


def prompt_ids(tokenizer, config, text: str, max_new_tokens: int):
    """[1, length] ids of `text`, after BOS when the run framed documents with one; ConfigError
    when the prompt and the tokens to generate do not fit in model.max_seq_len."""
    from jaxscale.data.tokenizers import encode_prompt

    max_seq_len = config.model.max_seq_len
    ids = encode_prompt(tokenizer, config, text)
    if not len(ids):
        raise ConfigError("--prompt='' is empty and the tokenizer adds no BOS token; give some "
                          "text to continue")
    if len(ids) + max_new_tokens > max_seq_len:
        raise ConfigError(f"the prompt is {len(ids)} tokens and --max_new_tokens={max_new_tokens}:"
                          f" {len(ids) + max_new_tokens} positions, more than the model's "
                          f"max_seq_len={max_seq_len}; shorten the prompt or lower "
                          "--max_new_tokens")
    return ids[None]


def continuation(args: argparse.Namespace) -> str:
    """The text that follows `args.prompt`."""
    import jax

    from jaxscale.config import default_config
    from jaxscale.data.tokenizers import decode_continuation, tokenizer_from_config
    from jaxscale.inference.sampler import Sampler, restored_model, sampling_mesh
    from jaxscale.parallel.sharding import rules_from_config

    if args.workdir is not None:
        config, source = run_config(args.workdir)
    else:
        from jaxscale.hf.config import update_config  # no JAX; the weights load as a checkpoint's

        config, source = default_config(), args.hf
        update_config(config, args.hf, "--hf")  # the model section and the tokenizer
    tokenizer = tokenizer_from_config(config)
    prompt = prompt_ids(tokenizer, config, args.prompt, args.max_new_tokens)
    mesh = sampling_mesh(config, jax.devices())
    rules = rules_from_config(config.sharding.rules)
    model, restored = restored_model(config, source, mesh, rules)
    print(f"restored {restored}", file=sys.stderr, flush=True)
    tokens = Sampler(model, mesh, rules).generate(
        prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed)[0]
    return decode_continuation(tokenizer, config, tokens)


def main(argv: list[str]) -> None:
    args = make_parser().parse_args(argv)  # before JAX is imported: --help and flag errors are fast
    try:
        with quiet_libtpu(), cuda_plugin.kept_out():
            text = continuation(args)
    except (JaxscaleError, TransientError) as e:
        fail_with(e)
    print(text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
