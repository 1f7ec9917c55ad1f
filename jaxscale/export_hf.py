"""`python -m jaxscale.export_hf --workdir=W --out=DIR [--step=N] [--dtype=bfloat16]`

Writes a run's parameters (its newest checkpoint, or step N) as a Hugging Face Llama folder that
transformers' LlamaForCausalLM.from_pretrained(DIR) loads: config.json, safetensors sharded at
5 GB without the padded vocabulary rows, and the run's tokenizer file (tokenizer.json, or a
SentencePiece tokenizer.model) when it used one. The model comes from W/config.json, so it is
exported as it was trained. The parameters are restored onto the first device and written one
tensor at a time; the host holds one tensor at a time.
"""

from __future__ import annotations

import os
import shutil
import sys

from jaxscale.cli import fail_with, folder_flag, number_flag
from jaxscale.kinds import whole
from jaxscale.runtime.tpu_host import quiet_libtpu
from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.launch.cli import ArgumentParser
from jaxscale.runtime.workdir import check_writable, read_config

DTYPES = ("bfloat16", "float32", "float16")  # jaxscale.hf.weights.DTYPES, without importing JAX


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m jaxscale.export_hf",
                            description="Export a run's parameters as a Hugging Face Llama "
                                        "folder.")
    parser.add_argument("--workdir", required=True, type=folder_flag,
                        help="The run's workdir (its config.json and checkpoints).")
    parser.add_argument("--out", required=True, help="The folder to write; it must not exist "
                        "or be empty.")
    parser.add_argument("--step", type=number_flag(whole("[0, inf)")), default=None,
                        help="The checkpoint's step (default: the newest).")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="The files' dtype (default bfloat16, as Llama ships; float32 "
                             "keeps the parameters exactly).")
    return parser


def checkpoint_step(directory: str, step: int | None) -> int:
    """The step to export: `step`, or the newest in `directory`; JaxscaleError naming the ones
    there when it is missing."""
    from jaxscale.checkpoint.manager import saved_steps  # imports JAX: only once flags parsed

    steps = saved_steps(directory)
    if not steps:
        raise JaxscaleError(f"{directory!r} holds no checkpoint; train the run first (or "
                            "point --workdir at the run that has them)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise JaxscaleError(f"--step={step}: {directory!r} has no checkpoint of that step; "
                            f"its steps are {steps}")
    return step


def export(workdir: str, out: str, step: int | None, dtype: str) -> str:
    """Writes the folder; returns a line saying what was written."""
    from jaxscale.checkpoint.manager import checkpoint_dir, restore_from  # JAX from here on
    from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
    from jaxscale.hf import save_model
    from jaxscale.training.state import TrainState, model_spec

    config = read_config(workdir)
    directory = checkpoint_dir(config, workdir)
    step = checkpoint_step(directory, step)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise JaxscaleError(f"--out={out!r} exists and is not an empty folder; pass a new folder")
    check_writable(out, "--out", "pass --out=<a folder you can write>")
    tokenizer = tokenizer_from_config(config)  # names a tokenizer file that is gone
    import jax
    from jax.sharding import SingleDeviceSharding

    spec = model_spec(config)
    device = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            spec.abstract_params)
    restored = restore_from(os.path.join(directory, str(step)),
                            TrainState(step=None, params=abstract, opt_state=None,
                                       loss_scale=None, good_steps=None),
                            params_only=True, model_config=spec.config)
    ids = {f"{key}_token_id": getattr(tokenizer, f"{key}_id") for key in ("bos", "eos")}
    files = save_model(restored.params, spec.config, out, dtype,
                       **{k: v for k, v in ids.items() if v >= 0})
    if not isinstance(tokenizer, ByteTokenizer):
        source = os.path.expanduser(config.data.tokenizer)
        target = "tokenizer.json" if source.endswith(".json") else "tokenizer.model"
        shutil.copyfile(source, os.path.join(out, target))
        files.append(target)
    return (f"exported step {step} of {workdir} to {out} ({dtype}): config.json, "
            f"{', '.join(files)}")


def main(argv: list[str]) -> None:
    args = make_parser().parse_args(argv)
    try:
        with quiet_libtpu():
            print(export(args.workdir, args.out, args.step, args.dtype), flush=True)
    except (JaxscaleError, TransientError) as e:
        fail_with(e)


if __name__ == "__main__":
    main(sys.argv[1:])
