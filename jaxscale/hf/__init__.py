"""Hugging Face model folders in and out: `load_model(path)` -> (model, DecoderConfig) and
`save_model(model_or_params, model_config, path)` (jaxscale/hf/model.py); a LoRA run's adapters
as a PEFT folder, `save_adapters(params, model_config, path)` (jaxscale/hf/peft.py);
docs/huggingface.md.

    from jaxscale import hf
    model, model_config = hf.load_model("Llama-3.2-1B", dtype="bfloat16")

`jaxscale.hf.config` (config.json <-> the `model` section) imports no JAX, so config files can
use it; the functions that need JAX are imported from here when first asked for.
"""

_MODEL_API = ("load_model", "save_model")
_PEFT_API = ("save_adapters",)


def __getattr__(name: str):
    if name in _MODEL_API:
        from jaxscale.hf import model  # JAX only when the weights are wanted

        return getattr(model, name)
    if name in _PEFT_API:
        from jaxscale.hf import peft  # JAX only when the weights are wanted

        return getattr(peft, name)
    raise AttributeError(f"module 'jaxscale.hf' has no attribute {name!r}")
