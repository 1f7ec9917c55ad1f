"""`python -m jaxscale.export_hf --workdir=W --out=DIR [--step=N] [--dtype=bfloat16]`

Writes a run's parameters (its newest checkpoint, or step N) as a Hugging Face folder of its model's
family that transformers' LlamaForCausalLM (Qwen3ForCausalLM, ...).from_pretrained(DIR) loads:
config.json, safetensors sharded at 5 GB without the padded vocabulary rows, and the run's tokenizer
file (tokenizer.json, or a SentencePiece tokenizer.model) when it used one. The model comes from
W/config.json, so it is exported as it was trained. The parameters are restored onto the first
device and written one tensor at a time; the host holds one tensor at a time.

A LoRA run (model.lora.rank > 0) checkpoints its adapters alone: they are merged into the weights
of the base they were trained on -- the run's checkpoint.restore_from (a Hugging Face folder or a
jaxscale run, read in float32), else the init of train.seed -- each targeted W becoming
W + (alpha / r) A B, and the merged model is written as above. `--adapters_only` writes the
adapters instead, as a PEFT folder (adapter_config.json, adapter_model.safetensors;
jaxscale/hf/peft.py) for `peft.PeftModel.from_pretrained(base, DIR)`.
"""

from __future__ import annotations

import os
import sys
import tempfile

from jaxscale.cli import ArgumentParser, fail_with, number_flag
from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.kinds import whole
from jaxscale.models import family
from jaxscale.runtime import cuda_plugin
from jaxscale.runtime.storage import (
    check_bucket,
    classified,
    filesystem,
    in_bucket,
    writing,
)
from jaxscale.runtime.tpu_host import quiet_libtpu
from jaxscale.runtime.workdir import check_writable, folder_or_bucket_flag, read_config

DTYPES = ("bfloat16", "float32", "float16")  # jaxscale.hf.weights.DTYPES, without importing JAX
# Beside a tokenizer file, what holds its chat template (and special tokens) for transformers.
CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m jaxscale.export_hf",
                            description="Export a run's parameters as a Hugging Face model "
                                        "folder of its family (model.name).")
    parser.add_argument("--workdir", required=True, type=folder_or_bucket_flag,
                        help="The run's workdir (its config.json and checkpoints; local, gs:// "
                             "or s3://).")
    parser.add_argument("--out", required=True, help="The folder to write (local, gs:// or "
                        "s3://); it must not exist or be empty.")
    parser.add_argument("--step", type=number_flag(whole("[0, inf)")), default=None,
                        help="The checkpoint's step (default: the newest).")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="The files' dtype (default bfloat16, as Llama and Qwen3 ship; float32 "
                             "keeps the parameters exactly).")
    parser.add_argument("--adapters_only", action="store_true",
                        help="A LoRA run: write its adapters as a PEFT folder "
                             "(adapter_config.json, adapter_model.safetensors) instead of the "
                             "model with the adapters merged into its weights.")
    return parser


def checkpoint_step(directory: str, step: int | None) -> int:
    """The step to export: `step`, or the newest in `directory`; JaxscaleError naming the ones
    there when it is missing."""
    from jaxscale.checkpoint.restore_from import saved_steps  # imports JAX: only once flags parsed

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


def check_adapters_only(config, workdir: str) -> None:
    """JaxscaleError unless the run has adapters and a base peft can load them onto."""
    if not config.model.lora.rank:
        raise JaxscaleError(f"--adapters_only: the run in {workdir!r} trained no LoRA adapters "
                            "(model.lora.rank=0); export its whole model without "
                            "--adapters_only")
    if not config.checkpoint.restore_from:
        raise JaxscaleError(
            f"--adapters_only: the adapters of {workdir!r} were trained on the init of "
            f"train.seed={config.train.seed} (checkpoint.restore_from is empty), which no Hugging "
            "Face folder holds for peft to load them onto; export without --adapters_only to "
            "write the model with the adapters merged in")


def export(workdir: str, out: str, step: int | None, dtype: str,
           adapters_only: bool = False) -> str:
    """Writes the folder, on a local disk or in a bucket; returns a line saying what was written.

    A bucket's folder is written on local disk first and then copied up, file by file: the
    safetensors writer writes each tensor at its offset, which an object store cannot."""
    if not in_bucket(out):
        return _export(workdir, out, step, dtype, adapters_only)
    check_bucket(out, "--out")
    fs, root = filesystem(out, "--out")
    if fs.exists(root) and fs.ls(root, detail=False):
        raise JaxscaleError(f"--out={out!r} exists and is not an empty folder; pass a new folder")
    with tempfile.TemporaryDirectory(prefix="export_hf-") as staged:
        written = _export(workdir, staged, step, dtype, adapters_only)
        fix = "pass --out=<a bucket folder this account can write>"
        # An OSError names the file it failed on (`writing`); a bucket library's error does not.
        with classified(f"cannot write --out={out!r}", fix), writing(out, fix):
            fs.put(staged + "/", root.rstrip("/") + "/", recursive=True)
    return written.replace(staged, out)


def _export(workdir: str, out: str, step: int | None, dtype: str, adapters_only: bool) -> str:
    # A run that is not there (a missing bucket too) is refused before JAX is imported: seconds.
    config = read_config(workdir)
    if adapters_only:
        check_adapters_only(config, workdir)
    from jaxscale.checkpoint.manager import checkpoint_dir  # JAX from here on
    from jaxscale.checkpoint.restore_from import lora_base, restore_params
    from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
    from jaxscale.hf import save_model
    from jaxscale.hf.config import is_hf_folder
    from jaxscale.hf.peft import save_adapters
    from jaxscale.models.spec import model_spec

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

    # The checkpoint's params: every parameter, or with LoRA the adapters alone.
    params = restore_params(os.path.join(directory, str(step)), spec.trained(abstract),
                            spec.config).params
    base, rank = config.checkpoint.restore_from, config.model.lora.rank
    if adapters_only:
        hf_base = None
        if is_hf_folder(base, "checkpoint.restore_from"):  # a bucket's URL is absolute already
            hf_base = base if in_bucket(base) else os.path.abspath(base)
        files = save_adapters(params, spec.config, out, dtype, base_model_name_or_path=hf_base,
                              dropout=config.model.lora.dropout)
        what = f"the LoRA adapters (rank {rank}) of step {step} of {workdir} to {out} ({dtype})"
        architecture = family(config.model.name).hf_architecture
        then = (f"; load them with peft.PeftModel.from_pretrained({architecture}."
                f"from_pretrained({hf_base!r}), {out!r})" if hf_base else
                f"; their base is the jaxscale run {base!r}: export it with python -m "
                "jaxscale.export_hf and load them onto that with peft")
    else:
        what, then = f"step {step} of {workdir} to {out} ({dtype})", ""
        if rank:  # the adapters, merged into the base they were trained on
            base_params, base_name = lora_base(config, spec, spec.frozen(abstract))
            params = merge_into(base_params, params, spec.config.lora)
            what += f", its LoRA adapters (rank {rank}) merged into their base {base_name}"
        ids = {f"{key}_token_id": getattr(tokenizer, f"{key}_id") for key in ("bos", "eos")}
        files = ["config.json"] + save_model(params, spec.config, out, dtype,
                                             **{k: v for k, v in ids.items() if v >= 0})
    if not isinstance(tokenizer, ByteTokenizer):
        # The tokenizer's folder may be a bucket's.
        fs, source = filesystem(os.path.expanduser(config.data.tokenizer), "data.tokenizer")
        target = "tokenizer.json" if source.endswith(".json") else "tokenizer.model"
        fix = "make data.tokenizer's folder readable"
        with classified(f"cannot copy the tokenizer {source!r}", fix):
            fs.get_file(source, os.path.join(out, target))
            files.append(target)
            # A chat model keeps its chat template: the files transformers reads it from.
            for name in CHAT_TEMPLATE_FILES:
                beside = f"{os.path.dirname(source)}/{name}"
                if fs.isfile(beside):
                    fs.get_file(beside, os.path.join(out, name))
                    files.append(name)
    return f"exported {what}: {', '.join(files)}{then}"


def merge_into(base: dict, adapters: dict, cfg) -> dict:
    """`base` with each weight that has an adapter replaced, in place, by the weight with the
    adapter folded in (`lora.merged`: W + (alpha / r) A B, in float32), one weight at a time,
    so that no more than one weight is held twice."""
    from jaxscale.models.lora import ADAPTER_SUFFIX, merged  # imports JAX, as above

    for key, value in adapters.items():
        if key.endswith(ADAPTER_SUFFIX):
            name = key.removesuffix(ADAPTER_SUFFIX)
            base[name] = merged({name: base[name], key: value}, cfg)[name]
        else:
            merge_into(base[key], value, cfg)
    return base


def main(argv: list[str]) -> None:
    args = make_parser().parse_args(argv)
    try:
        with quiet_libtpu(), cuda_plugin.kept_out():
            print(export(args.workdir, args.out, args.step, args.dtype, args.adapters_only),
                  flush=True)
    except (JaxscaleError, TransientError) as e:
        fail_with(e)


if __name__ == "__main__":
    main(sys.argv[1:])
