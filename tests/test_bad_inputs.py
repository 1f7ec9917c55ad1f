"""Bad inputs, one table (issue 8): every mistake a user can make on any entry point -- flags,
overrides, config files, data sources, tokenizers, checkpoints, workdirs, every launcher -- ends
with exit status 2 and one `error: <what, the bad value, the fix>` line on stderr, shows no
traceback, and writes nothing: a fresh (empty) workdir stays empty and an existing one (a real run
with a checkpoint) stays byte-for-byte as it was.

Each case runs in a folder of its own, which holds its input files, an empty `fresh/` workdir and
a copy of a real run's workdir, `existing/`; after the run the whole folder must be unchanged
(every file's relative path, size and sha256, every folder; Python's own `__pycache__` aside).
Cases whose `workdirs` are ("fresh", "existing") run once against each. Besides the examples, every
path an entry point takes is given each wrong input of its kind (PATH_KINDS: a folder where a
file belongs, a file where a folder belongs, a file of another format, a missing one).

The entry points run in this process (`module.main(...)`, as their `__main__` block calls it,
with `SystemExit` caught and stderr read with capfd); the cases marked `cli` run as real
`python -m ...` subprocesses, to show that the real command line behaves the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import traceback

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOTH = ("fresh", "existing")
FRESH = ("fresh",)
EXISTING = ("existing",)

D_MODEL_32 = re.compile(r"\b32\b")  # the other d_model, in a shape: not float32, not the path

# A model that builds in a blink; synthetic data, so nothing is read. The existing workdir is this
# config trained for 2 steps (a checkpoint at step 2); a case whose mistake goes unnoticed would
# resume it (or start afresh) and train to step 4, writing -- which the test then reports.
SMALL_CONFIG_LINES = (
    "from jaxscale.config import default_config",
    "",
    "",
    "def get_config():",
    "    c = default_config()",
    "    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, "
    "mlp_dim=128)",
    "    c.train.update(steps=4, batch_size=8, seq_len=16, log_every=1, eval_every=0)",
    "    c.precision.compute_dtype = 'float32'",
    "    c.optim.warmup_steps = 1",
    "    c.checkpoint.update(every_steps=2, compilation_cache=False)",
    "    c.data.sources = (dict(format='synthetic'),)",
    "    c.mesh.data = -1",
)


# The line of a config file made by config_file() that holds the first of its `lines`.
FIRST_LINE = len(SMALL_CONFIG_LINES) + 1


def config_file(*lines: str) -> str:
    """The small config with `lines` (indented into get_config) applied before it returns."""
    return "\n".join([*SMALL_CONFIG_LINES, *(f"    {line}" for line in lines),
                      "    return c", ""])


def sources_file(*sources: str, more: tuple[str, ...] = ()) -> str:
    """The small config reading `sources` (Python text of dicts; relative paths are relative to
    the case's folder, where it runs)."""
    return config_file(f"c.data.sources = ({', '.join(sources)},)", *more)


def _fixture(*parts: str) -> bytes:
    with open(os.path.join(REPO, "tests", "fixtures", *parts), "rb") as f:
        return f.read()


# Hugging Face model folders (tests/fixtures/hf_*), whole or broken.
HF_CONFIG = f"--config={REPO}/configs/hf.py:model"
HF_TIED = {f"model/{name}": _fixture("hf_tied", name) for name in
           ("config.json", "model.safetensors", "tokenizer.json")}
HF_MISTRAL = {**HF_TIED, "model/config.json": HF_TIED["model/config.json"].replace(
    b'"model_type": "llama"', b'"model_type": "mistral"')}
HF_ONE_SHARD_MISSING = {f"model/{name}": _fixture("hf_untied", name) for name in
                        ("config.json", "model.safetensors.index.json",
                         "model-00001-of-00002.safetensors")}
SYNTHETIC = "--config.data.sources=(dict(format='synthetic'),)"

GOOD_JSONL = "".join(f'{{"text": "document number {i} has some words in it"}}\n'
                     for i in range(40))
NOT_A_TOKENIZER_JSON = '{"version": "1.0", "model": {"type": "Nonsense"}}'


@dataclasses.dataclass(frozen=True)
class Link:
    """A symbolic link to `target` (relative to the link's folder), in a case's `files`."""
    target: str


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    module: str
    args: tuple[str, ...]  # str.format'ed with tmp (the case's folder), cfg, workdir, python
    # What the error line must name, outside the case's folder: the bad value (and its key); a
    # substring or a compiled regex.
    names: tuple
    # name -> text, bytes, None (a folder) or a Link
    files: dict = dataclasses.field(default_factory=dict)
    workdirs: tuple[str, ...] = ()  # run once with {workdir} each of these
    cli: bool = False  # a real subprocess instead of main() in this process


def train(id: str, *args: str, names, files=None, workdirs=BOTH, cli=False) -> Case:
    """A `jaxscale.train` case: the small config unless `args` name another, and
    `--workdir={workdir}` unless `args` give one."""
    args = list(args)
    if not any(a.startswith("--config=") for a in args):
        args.insert(0, "--config={cfg}")
    if workdirs and not any(a.startswith("--workdir") for a in args):
        args.append("--workdir={workdir}")
    return Case(id, "jaxscale.train", tuple(args), tuple(names), files or {}, workdirs, cli)


def launcher(module: str, id: str, *args: str, names, files=None, workdirs=(), cli=False) -> Case:
    return Case(id, module, tuple(args), tuple(names), files or {}, workdirs, cli)


LOCAL, FIT, GKE, CHECK = ("jaxscale.launch.local", "jaxscale.launch.fit", "jaxscale.launch.gke",
                          "jaxscale.launch.check")
SUPERVISE, PREPARE = "jaxscale.launch.supervise", "jaxscale.data.prepare"
EXPORT = "jaxscale.export_hf"
SAMPLE = "jaxscale.sample"
GKE_OK = ("--image=img", "--bucket=bucket", "--nodes=1", "--gpus_per_node=8")
NOTES = {"notes.txt": "a file, not a folder\n"}

CASES = [
    # --- flags and overrides ------------------------------------------------------------------
    train("an unknown flag is named", "--stepz=3", names=["stepz"]),
    train("an unknown config key is named", "--config.train.stepz=3", names=["stepz"]),
    train("a word where a whole number belongs is named", "--config.train.steps=ten",
          names=["ten"]),
    train("a fraction where a whole number belongs is named", "--config.train.batch_size=8.5",
          names=["8.5"]),
    train("a word where a boolean belongs is named", "--config.checkpoint.enabled=maybe",
          names=["maybe"]),
    train("an unexpected positional argument is named", "extra", names=["extra"]),
    train("mesh sizes that do not multiply to the device count are refused",
          "--config.mesh.data=3", names=["mesh", "3"]),
    train("two mesh axes of -1 are refused", "--config.mesh.fsdp=-1", names=["fsdp", "-1"]),
    train("a mesh axis of size 0 is refused", "--config.mesh.tensor=0", names=["mesh.tensor=0"]),
    train("a DCN factor without the hosts to match is refused", "--config.mesh.dcn.data=2",
          names=["mesh.dcn", "1"]),
    train("ZeRO-1 that cannot split a parameter is refused",
          "--config.sharding.optimizer_state=data", "--config.model.d_model=36",
          "--config.model.head_dim=18", "--config.model.mlp_dim=72", names=["data=8", "[2, 36, "]),
    train("an unknown optimizer-state layout is named", "--config.sharding.optimizer_state=zero9",
          names=["zero9"]),
    train("a straggler ratio of at most 1 is refused", "--config.train.straggler_ratio=1.0",
          names=["straggler_ratio=1.0"]),
    train("pipeline stages that do not divide the layers are refused", "--config.mesh.data=2",
          "--config.mesh.pipeline=4", names=["n_layers=2", "4 x 1"]),
    train("pipeline microbatches that do not split the batch are refused",
          "--config.mesh.data=4", "--config.mesh.pipeline=2", "--config.pipeline.microbatches=3",
          names=["microbatches=3", "8 sequences"]),
    train("fewer pipeline microbatches than stages are refused", "--config.mesh.data=4",
          "--config.mesh.pipeline=2", "--config.pipeline.microbatches=1",
          names=["microbatches=1", "2 stages"]),
    train("1f1b with circular repeats is refused", "--config.mesh.data=4",
          "--config.mesh.pipeline=2", "--config.model.n_layers=4", "--config.pipeline.repeats=2",
          "--config.pipeline.schedule=1f1b", names=["1f1b", "repeats=2"]),
    train("an unknown pipeline schedule is named", "--config.pipeline.schedule=zigzag",
          names=["zigzag"]),
    train("experts that the expert axis does not divide are refused",
          "--config.model.moe.every=1", "--config.model.moe.experts=6", "--config.mesh.expert=4",
          names=["experts=6", "= 4"]),
    train("an expert axis on a dense model is refused", "--config.mesh.expert=2",
          names=["mesh.expert", "every=0"]),
    train("an expert axis that the rows are not split over is refused",
          "--config.model.moe.every=1", "--config.model.moe.experts=4", "--config.mesh.expert=2",
          "--config.sharding.rules.batch=('data','fsdp')", names=["rules.batch", "'fsdp')"]),
    train("a batch that the expert axis does not split is refused", "--config.model.moe.every=1",
          "--config.model.moe.experts=4", "--config.mesh.expert=4", "--config.train.batch_size=4",
          names=["batch", "mesh.expert=4"]),
    train("an experts rule off the expert axis is refused", "--config.model.moe.every=1",
          "--config.model.moe.experts=4", "--config.mesh.expert=2",
          "--config.sharding.rules.experts=('fsdp',)", names=["rules.experts", "('fsdp',)"]),
    # Configs written before the logical axis was renamed `experts` (the mesh axis keeps `expert`).
    train("a rule for the old logical axis name expert is refused", "--config=oldrule.py",
          files={"oldrule.py": config_file("c.sharding.rules.expert = ('expert',)")},
          names=["unknown logical axis 'expert'", "'experts'"]),
    train("a sequence that 2 x the context axis does not divide is refused",
          "--config.mesh.context=4", "--config.train.seq_len=12",
          names=["seq_len=12", "mesh.context=4"]),
    train("splash attention on a context axis is refused", "--config.mesh.context=2",
          "--config.model.attention=splash", names=["splash", "mesh.context=2"]),
    train("cuDNN attention on CPUs is refused", "--config.model.attention=cudnn",
          names=["model.attention='cudnn'", "devices are cpu"]),
    train("cuDNN attention on CPUs is refused before planning", "--config.mesh.auto=True",
          "--config.model.attention=cudnn", names=["model.attention='cudnn'", "devices are cpu"]),
    train("a planner that times no candidate is refused", "--config.mesh.auto=True",
          "--config.mesh.auto_trials=0", names=["mesh.auto_trials=0", ">= 1"]),
    train("a bound of one segment per row is refused", "--config.data.max_segments=1",
          names=["data.max_segments=1", ">= 2"]),
    train("a batch that the mesh does not divide is refused", "--config.train.batch_size=12",
          names=["batch", "12"]),
    train("an unknown remat policy is named", "--config.model.remat=sometimes",
          names=["sometimes"]),
    train("an unknown compute dtype is named", "--config.precision.compute_dtype=fp8",
          names=["fp8"]),
    train("an unknown matmul precision is named", "--config.precision.matmul=int8",
          names=["precision.matmul='int8'"]),
    train("fp8 matmuls with float32 compute are refused", "--config.precision.matmul=fp8",
          names=["precision.matmul='fp8'", "compute_dtype"]),
    train("an unknown LoRA target is named", "--config.model.lora.rank=8",
          "--config.model.lora.targets=('q','qkv')", names=["model.lora.targets", "qkv"]),
    train("a LoRA dropout rate of 1 or more is refused", "--config.model.lora.rank=8",
          "--config.model.lora.dropout=1.0", names=["model.lora.dropout=1.0"]),
    train("LoRA dropout on the experts' adapters is refused", "--config.model.lora.rank=8",
          "--config.model.lora.dropout=0.1", "--config.model.moe.every=2",
          "--config.model.moe.experts=4", names=["model.lora.dropout=0.1", "model.moe.every=2"]),
    train("LoRA with fp8 matmuls is refused", "--config.model.lora.rank=8",
          "--config.precision.matmul=fp8", "--config.precision.compute_dtype=bfloat16",
          names=["model.lora", "precision.matmul='fp8'"]),
    train("a negative LoRA rank is refused", "--config.model.lora.rank=-1",
          names=["model.lora.rank=-1"]),
    train("samples without prompts are refused", "--config.train.sample_every=10",
          names=["train.sample_prompts=()", "sample_every=10"]),
    train("an unknown model name is named", "--config.model.name=gpt", names=["gpt"]),
    train("kv heads that do not divide the heads are refused", "--config.model.n_kv_heads=3",
          names=["n_kv_heads=3"]),
    train("an odd head_dim is refused (RoPE rotates pairs)", "--config.model.d_model=60",
          "--config.model.head_dim=15", names=["model.head_dim=15", "even"]),
    train("microbatches that do not divide the batch are refused",
          "--config.train.microbatches=3", names=["microbatches=3"]),
    train("zero steps are refused", "--config.train.steps=0", names=["train.steps=0"]),
    train("a negative learning rate is refused", "--config.optim.lr=-0.001",
          names=["optim.lr=-0.001"]),
    train("a zero log interval is refused", "--config.train.log_every=0",
          names=["log_every=0"]),
    train("a sequence longer than the model's maximum is refused",
          "--config.train.seq_len=4096", names=["seq_len=4096"]),
    train("a vocabulary smaller than the tokenizer's is refused", "--config.model.vocab_size=100",
          names=["vocab_size=100"]),
    train("an unknown packing method is named", "--config.data.packing=zip", names=["zip"]),
    train("keeping zero checkpoints is refused", "--config.checkpoint.keep=0",
          names=["checkpoint.keep=0"]),
    train("restoring params only without restore_from is refused",
          "--config.checkpoint.restore_params_only=True", names=["restore_params_only"]),
    train("a profile window past the run's last step is refused", "--config.profile.steps=3",
          "--config.profile.start_step=2", names=["profile.start_step=2", "train.steps=4"]),
    train("an XLA flags setting that is no flags is named", "--config.performance.xla_flags=fast",
          names=["xla_flags", "fast"]),
    train("an XLA flag this jaxlib does not know is named",
          "--config.performance.xla_flags=--xla_gpu_no_such_flag=1",
          names=["--xla_gpu_no_such_flag=1"]),
    train("an unknown moment dtype is named", "--config.optim.moment_dtype=fp8", names=["fp8"]),
    train("bfloat16 moments too slow to decay in bfloat16 are refused",
          "--config.optim.moment_dtype=bfloat16", "--config.optim.b2=0.999",
          names=["optim.b2=0.999", "bfloat16"]),
    # --- config files ---------------------------------------------------------------------------
    train("a config file with a syntax error names the file and the line", "--config=broken.py",
          files={"broken.py": "from jaxscale.config import default_config\n\n"
                              "def get_config(:\n    return default_config()\n"},
          names=["broken.py", "line 3"]),
    train("a config file without get_config names the file", "--config=empty.py",
          files={"empty.py": "CONFIG = 'not a function'\n"}, names=["empty.py", "get_config"]),
    train("a config file whose get_config returns a dict names the file", "--config=plain.py",
          files={"plain.py": "def get_config():\n    return dict(train=dict(steps=10))\n"},
          names=["plain.py", "dict"]),
    train("a string where a config file needs an int names the file and the key",
          "--config=typed.py", files={"typed.py": config_file("c.train.steps = '100'")},
          names=["typed.py", f"line {FIRST_LINE}", "steps"]),
    train("a float batch size in a config file names the file and the key", "--config=typed.py",
          files={"typed.py": config_file("c.train.batch_size = 8.5")},
          names=["typed.py", f"line {FIRST_LINE}", "batch_size"]),
    train("a config file whose get_config raises names the file and the reason",
          "--config=raises.py",
          files={"raises.py": config_file("raise ValueError('no dataset called pile')")},
          names=["raises.py", f"line {FIRST_LINE}", "no dataset called pile"]),
    train("a config file importing a missing module names the module", "--config=imports.py",
          files={"imports.py": "import jaxscale_no_such_module\n" + config_file()},
          names=["imports.py", "jaxscale_no_such_module"]),
    train("a config file whose get_config exits names the file and the status",
          "--config=exits.py", files={"exits.py": config_file("import sys", "sys.exit(3)")},
          names=["exits.py", f"line {FIRST_LINE + 1}", "status 3"]),
    train("an unknown key set in a config file is named", "--config=newkey.py",
          files={"newkey.py": config_file("c.train.stepz = 3")}, names=["stepz"]),
    # --- data sources and tokenizers ------------------------------------------------------------
    train("an empty data folder is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='text', path='corpus')"), "corpus": None},
          names=["corpus"]),
    train("a wrong JSONL text field is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='jsonl', path='docs.jsonl', "
                                      "text_field='body')"), "docs.jsonl": GOOD_JSONL},
          names=["body"]),
    train("a JSONL file of malformed lines is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='jsonl', path='docs.jsonl')"),
                 "docs.jsonl": "this is not json\n{also not\n"}, names=["docs.jsonl"]),
    train("an empty text file is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='text', path='empty.txt')"), "empty.txt": ""},
          names=["empty.txt"]),
    train("an unknown data format is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='csv', path='docs.csv')"),
                 "docs.csv": "text\nhello\n"}, names=["csv"]),
    train("an unknown key of a source is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='jsonl', path='docs.jsonl', field='text')"),
                 "docs.jsonl": GOOD_JSONL}, names=["field"]),
    train("a negative source weight is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='jsonl', path='docs.jsonl', weight=-1)"),
                 "docs.jsonl": GOOD_JSONL}, names=["weight", "-1"]),
    train("a text source with an unknown document kind is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='text', path='a.txt', document='page')"),
                 "a.txt": "some text\n"}, names=["page"]),
    train("sources on the command line that are not Python literals are named",
          "--config.data.sources=jsonl", names=["jsonl"]),
    train("an unknown format in command-line sources is named",
          "--config.data.sources=(dict(format='csv', path='a.csv'),)", names=["csv"]),
    train("a garbage tokenizer.json is named", "--config.data.tokenizer=tok/tokenizer.json",
          files={"tok/tokenizer.json": "<html>not json</html>\n"}, names=["tok/tokenizer.json"]),
    train("a tokenizer.json that is JSON but no tokenizer is named",
          "--config.data.tokenizer=tok/tokenizer.json",
          files={"tok/tokenizer.json": NOT_A_TOKENIZER_JSON}, names=["tok/tokenizer.json"]),
    train("a garbage SentencePiece model is named", "--config.data.tokenizer=tok/sp.model",
          files={"tok/sp.model": b"\x00garbage\xff" * 10}, names=["tok/sp.model"]),
    train("an eval split with no documents is found at the start", "--config=c.py",
          files={"c.py": sources_file("dict(format='jsonl', path='few.jsonl', "
                                      "eval_fraction=0.001)", more=("c.train.eval_every = 2",)),
                 "few.jsonl": '{"text": "one"}\n{"text": "two"}\n'},
          names=["few.jsonl", "eval"]),
    train("an eval_path with no documents is found at the start", "--config=c.py",
          files={"c.py": sources_file("dict(format='jsonl', path='docs.jsonl', "
                                      "eval_path='eval.jsonl')", more=("c.train.eval_every = 2",)),
                 "docs.jsonl": GOOD_JSONL, "eval.jsonl": ""},
          names=["eval.jsonl"]),
    # --- JSON files of another shape than the object the program reads ------------------------
    train("a tokenizer.json that is a JSON array is named",
          "--config.data.tokenizer=tok/tokenizer.json", files={"tok/tokenizer.json": "[]\n"},
          names=["tok/tokenizer.json", "JSON array, not an object"], workdirs=FRESH),
    train("a token file's description that is a JSON array is named", "--config=c.py",
          files={"c.py": sources_file("dict(format='tokens', path='docs.bin')"),
                 "docs.bin": b"\0" * 64, "docs.json": "[1, 2]\n"},
          names=["docs.json", "JSON array, not an object"], workdirs=FRESH),
    train("a run.json that is a JSON array is named", files={"existing/run.json": "[]\n"},
          names=["run.json", "JSON array, not an object"], workdirs=EXISTING),
    train("a metrics.jsonl line that is a JSON array is named", "--config.train.steps=2",
          files={"existing/metrics.jsonl": "[1]\n"},
          names=["metrics.jsonl line 1", "JSON array, not an object"], workdirs=EXISTING),
    # (A checkpoint's JSON of another shape is damage: tests/test_faults_checkpoint.py.)
    train("a Hugging Face config.json that is a JSON array is named", HF_CONFIG, SYNTHETIC,
          files={**HF_TIED, "model/config.json": "[]\n"},
          names=["model/config.json", "JSON array, not an object"], workdirs=FRESH),
    train("a Hugging Face tokenizer.json that is a JSON string is named", HF_CONFIG, SYNTHETIC,
          files={**HF_TIED, "model/tokenizer.json": '"tokens"\n'},
          names=["model/tokenizer.json", "JSON string, not an object"], workdirs=FRESH),
    launcher(SAMPLE, "sample names a workdir whose config.json is a JSON array",
             "--workdir=started", "--prompt=def", files={"started/config.json": "[]\n"},
             names=["started/config.json", "JSON array, not an object"]),
    launcher(PREPARE, "prepare names a manifest that is a JSON number", "--config={cfg}",
             "--out=tokens", files={"tokens/prepare.json": "7\n"},
             names=["tokens/prepare.json", "JSON number, not an object"]),
    # --- trackers -------------------------------------------------------------------------------
    train("an MLflow tracking URI under a regular file is named",
          "--config.metrics.trackers=('jsonl','mlflow')",
          "--config.metrics.mlflow_tracking_uri=file://{tmp}/notes.txt/mlruns", files=NOTES,
          names=["notes.txt", "mlflow_tracking_uri"]),
    # --- checkpoints ----------------------------------------------------------------------------
    train("a dangling symlink for the local tier's folder is refused",
          "--config.checkpoint.local_dir=ramdisk", "--config.checkpoint.local_every_steps=1",
          files={"ramdisk": Link("unmounted")},
          names=["checkpoint.local_dir", "/ramdisk' is a symbolic link to 'unmounted'"]),
    train("restoring from a folder without a checkpoint is refused",
          "--config.checkpoint.restore_from=notckpt", files={"notckpt/readme.txt": "hello\n"},
          names=["notckpt"], workdirs=FRESH),
    train("restoring another shape from a relative path names the shape",
          "--config.checkpoint.restore_from=existing", "--config.model.d_model=32",
          names=["existing", D_MODEL_32], workdirs=FRESH),
    train("restoring another shape from an absolute path names the shape",
          "--config.checkpoint.restore_from={tmp}/existing/checkpoints",
          "--config.model.d_model=32", names=["existing", D_MODEL_32], workdirs=FRESH),
    train("restoring a checkpoint already past train.steps is refused",
          "--config.checkpoint.restore_from={tmp}/existing", "--config.train.steps=1",
          names=["restore_from", "train.steps=1"], workdirs=FRESH),
    Case("a --config flag without its file is refused", "jaxscale.train",
         ("--workdir={workdir}", "--config"), ("--config",), {}, FRESH, False),
    train("resuming a workdir with another d_model names the shape", "--config.model.d_model=32",
          names=[D_MODEL_32], workdirs=EXISTING),
    train("resuming a workdir with another batch size names it", "--config.train.batch_size=16",
          names=["batch_size", "16"], workdirs=EXISTING),
    # --- Hugging Face folders ----------------------------------------------------------------
    train("configs/hf.py without a folder names the FILE:ARG form",
          f"--config={REPO}/configs/hf.py", names=["configs/hf.py:/path/to/model"], workdirs=FRESH),
    train("configs/hf.py given a file for its folder names the flag as given",
          f"--config={REPO}/configs/hf.py:notes.txt", files=NOTES,
          names=["configs/hf.py:notes.txt"], workdirs=FRESH),
    train("an unknown RoPE scaling type is named", "--config.model.rope_scaling.type=yarn",
          names=["rope_scaling.type", "yarn"], workdirs=FRESH),
    train("RoPE frequency factors out of order are refused",
          "--config.model.rope_scaling.type=llama3",
          "--config.model.rope_scaling.low_freq_factor=8.0", names=["low_freq_factor=8.0"],
          workdirs=FRESH),
    train("a Hugging Face folder without config.json is named", HF_CONFIG,
          files={"model/model.safetensors": HF_TIED["model/model.safetensors"]},
          names=["model", "config.json"], workdirs=FRESH),
    train("a Hugging Face folder of another architecture is named", HF_CONFIG, SYNTHETIC,
          files=HF_MISTRAL, names=["mistral", "llama"], workdirs=FRESH),
    train("a Hugging Face folder of another shape than the config's model is named",
          "--config.checkpoint.restore_from=model", files=HF_TIED,
          names=["d_model=32 (the config: 64)", "mlp_dim=64", "configs/hf.py:model"],
          workdirs=FRESH),
    train("a missing Hugging Face shard is named", HF_CONFIG, SYNTHETIC,
          files=HF_ONE_SHARD_MISSING, names=["model-00002-of-00002.safetensors"],
          workdirs=FRESH),
    # --- workdirs -------------------------------------------------------------------------------
    train("a URL workdir is refused", "--workdir=gs://bucket/run", names=["gs://bucket/run"],
          workdirs=()),
    train("an empty workdir flag is refused", "--workdir=", names=["workdir"], workdirs=()),
    # --- jaxscale.launch.local ------------------------------------------------------------------
    launcher(LOCAL, "launch.local refuses zero processes", "--processes=0", "--",
             "--config={cfg}", "--workdir={workdir}", names=["processes", "0"], workdirs=FRESH),
    launcher(LOCAL, "launch.local suggests -- for a training flag given without it",
             "--processes=2", "--config.train.steps=3", names=["--config.train.steps=3", " -- "]),
    launcher(LOCAL, "launch.local checks the mesh against its devices", "--processes=2",
             "--devices_per_process=4", "--", "--config={cfg}", "--workdir={workdir}",
             "--config.mesh.data=3", names=["mesh", "3"], workdirs=BOTH),
    launcher(LOCAL, "launch.local names an unknown training flag", "--", "--config={cfg}",
             "--workdir={workdir}", "--config.train.stepz=3", names=["stepz"], workdirs=FRESH),
    launcher(LOCAL, "launch.local refuses a port out of range", "--port=70000", "--",
             "--config={cfg}", names=["70000"]),
    launcher(LOCAL, "launch.local names a grace period that is not a number", "--grace_s=soon",
             "--", "--config={cfg}", names=["soon"]),
    launcher(LOCAL, "launch.local refuses a negative grace period", "--grace_s=-1", "--",
             "--config={cfg}", names=["--grace_s", "-1"]),
    launcher(LOCAL, "launch.local finds a DCN factor its processes do not match",
             "--processes=2", "--devices_per_process=1", "--", "--config={cfg}",
             "--config.mesh.dcn.data=3", names=["mesh.dcn", "3"], workdirs=FRESH),
    launcher(LOCAL, "launch.local names a missing config file", "--", "--config=nope.py",
             names=["nope.py"]),
    # --- jaxscale.launch.fit --------------------------------------------------------------------
    launcher(FIT, "launch.fit needs --devices", "--", "--config={cfg}", names=["--devices"]),
    launcher(FIT, "launch.fit names a device count that is not a number", "--devices=abc", "--",
             "--config={cfg}", names=["abc"]),
    launcher(FIT, "launch.fit finds a batch the devices do not divide", "--devices=6", "--",
             "--config={cfg}", names=["batch", "6"]),
    launcher(FIT, "launch.fit names a missing config file", "--devices=8", "--",
             "--config=nope.py", names=["nope.py"]),
    launcher(FIT, "launch.fit suggests -- for a training flag given without it", "--devices=8",
             "--config.mesh.data=3", names=["--config.mesh.data=3", " -- "]),
    launcher(FIT, "launch.fit finds a DCN factor that does not match the hosts", "--devices=8",
             "--granules=2", "--", "--config={cfg}", "--config.mesh.dcn.data=4",
             names=["mesh.dcn", "2"]),
    launcher(FIT, "launch.fit finds devices that do not split over the granules", "--devices=16",
             "--granules=3", "--", "--config={cfg}", names=["--devices=16", "--granules=3"]),
    launcher(FIT, "launch.fit finds GPU nodes larger than the GPU's", "--devices=18",
             "--granules=2", "--gpu=h100", "--", "--config={cfg}", "--config.train.batch_size=18",
             names=["h100:2x9", "1 to 8 GPUs"]),
    launcher(FIT, "launch.fit finds ZeRO-1 that cannot split a parameter", "--devices=8", "--",
             "--config={cfg}", "--config.sharding.optimizer_state=data",
             "--config.model.d_model=36", "--config.model.head_dim=18",
             "--config.model.mlp_dim=72", names=["optimizer_state", "data=8"]),
    # --- jaxscale.launch.gke --------------------------------------------------------------------
    launcher(GKE, "launch.gke needs --image", "--config={cfg}", "--bucket=bucket", "--nodes=1",
             names=["--image"]),
    launcher(GKE, "launch.gke names a bad job name", "--config={cfg}", *GKE_OK, "--name=My_Job",
             names=["My_Job"]),
    launcher(GKE, "launch.gke names a bad TPU topology", "--config={cfg}", "--image=img",
             "--bucket=bucket", "--tpu_accelerator=tpu-v5p-slice", "--tpu_topology=4by4",
             names=["4by4"]),
    launcher(GKE, "launch.gke names an unknown flag", "--config={cfg}", *GKE_OK, "--nodez=2",
             names=["nodez"]),
    launcher(GKE, "launch.gke checks the mesh against the cluster", "--config={cfg}", *GKE_OK,
             "--config.mesh.data=3", names=["mesh", "3"]),
    launcher(GKE, "launch.gke names a missing config file", "--config=nope.py", *GKE_OK,
             names=["nope.py"]),
    # --- jaxscale.launch.check ------------------------------------------------------------------
    launcher(CHECK, "launch.check refuses zero steps", "--steps=0", names=["steps", "0"]),
    launcher(CHECK, "launch.check refuses a negative interval", "--interval_s=-1",
             names=["interval_s", "-1"]),
    launcher(CHECK, "launch.check names an unknown flag", "--stepz=3", names=["stepz"]),
    launcher(CHECK, "launch.check names an interval that is not a number", "--interval_s=soon",
             names=["soon"]),
    # --- jaxscale.supervise ---------------------------------------------------------------------
    launcher(SUPERVISE, "supervise needs a command", names=["command", "--"]),
    launcher(SUPERVISE, "supervise names a command that does not exist", "--",
             "no-such-program-jaxscale", names=["no-such-program-jaxscale"]),
    launcher(SUPERVISE, "supervise refuses negative restarts", "--max_restarts=-1", "--",
             "{python}", "-c", "pass", names=["max_restarts", "-1"]),
    launcher(SUPERVISE, "supervise names a backoff that is not a number", "--backoff_seconds=fast",
             "--", "{python}", "-c", "pass", names=["fast"]),
    launcher(SUPERVISE, "supervise names an unknown flag", "--restarts=3", "--", "{python}", "-c",
             "pass", names=["restarts"]),
    # --- jaxscale.data.prepare ------------------------------------------------------------------
    launcher(PREPARE, "prepare needs --out", "--config={cfg}", names=["--out"]),
    launcher(PREPARE, "prepare refuses zero workers", "--config={cfg}", "--out=tokens",
             "--workers=0", names=["workers", "0"]),
    launcher(PREPARE, "prepare names an unknown flag", "--config={cfg}", "--outt=tokens",
             names=["outt"]),
    launcher(PREPARE, "prepare refuses an out folder of token files it cannot trace",
             "--config={cfg}", "--out=tokens", files={"tokens/source0.train.bin": b"\0" * 64},
             names=["tokens", "source0.train.bin"]),
    launcher(PREPARE, "prepare names a config file with a syntax error and its line",
             "--config=broken.py", "--out=tokens",
             files={"broken.py": "def get_config(:\n    pass\n"}, names=["broken.py", "line 1"]),
    launcher(PREPARE, "prepare names a missing data path", "--config=c.py", "--out=tokens",
             files={"c.py": sources_file("dict(format='jsonl', path='missing.jsonl')")},
             names=["missing.jsonl"]),
    launcher(PREPARE, "prepare names a garbage tokenizer.json", "--config={cfg}", "--out=tokens",
             "--config.data.tokenizer=tok/tokenizer.json",
             files={"tok/tokenizer.json": "<html>not json</html>\n"},
             names=["tok/tokenizer.json"]),
    # --- jaxscale.export_hf ---------------------------------------------------------------------
    launcher(EXPORT, "export_hf needs --out", "--workdir={workdir}", names=["--out"],
             workdirs=EXISTING),
    launcher(EXPORT, "export_hf names a workdir that is no run", "--workdir=notrun",
             "--out=exported", files={"notrun/notes.txt": "hello\n"},
             names=["notrun", "config.json"]),
    launcher(EXPORT, "export_hf names a step that has no checkpoint", "--workdir={workdir}",
             "--out=exported", "--step=5", names=["--step=5", "[2]"], workdirs=EXISTING),
    launcher(EXPORT, "export_hf refuses an out folder in use", "--workdir={workdir}",
             "--out=used", files={"used/notes.txt": "mine\n"}, names=["used", "empty"],
             workdirs=EXISTING),
    launcher(EXPORT, "export_hf --adapters_only refuses a run without LoRA",
             "--workdir={workdir}", "--out=exported", "--adapters_only",
             names=["--adapters_only", "model.lora.rank=0"], workdirs=EXISTING),
    launcher(EXPORT, "export_hf names an unknown dtype", "--workdir={workdir}",
             "--out=exported", "--dtype=int8", names=["int8"], workdirs=EXISTING),
    # --- jaxscale.sample ------------------------------------------------------------------------
    launcher(SAMPLE, "sample needs --prompt", "--workdir={workdir}", names=["--prompt"],
             workdirs=EXISTING),
    launcher(SAMPLE, "sample needs a workdir or a Hugging Face folder", "--prompt=def",
             names=["--workdir", "--hf"]),
    launcher(SAMPLE, "sample refuses both a workdir and a Hugging Face folder",
             "--workdir={workdir}", "--hf=model", "--prompt=def", names=["--hf", "--workdir"],
             files={"model": None}, workdirs=EXISTING),
    launcher(SAMPLE, "sample names a workdir that is no run", "--workdir=notrun", "--prompt=def",
             files={"notrun/notes.txt": "hello\n"}, names=["notrun", "config.json"]),
    launcher(SAMPLE, "sample names a workdir without a checkpoint", "--workdir=started",
             "--prompt=def", files={"started/config.json": "{}\n"},
             names=["started", "no checkpoint"]),
    launcher(SAMPLE, "sample names a Hugging Face folder without config.json", "--hf=model",
             "--prompt=def", files={"model/model.safetensors": HF_TIED["model/model.safetensors"]},
             names=["model", "config.json"]),
    launcher(SAMPLE, "sample refuses a negative temperature", "--workdir={workdir}",
             "--prompt=def", "--temperature=-1", names=["--temperature", "-1"],
             workdirs=EXISTING),
    launcher(SAMPLE, "sample refuses an infinite temperature", "--workdir={workdir}",
             "--prompt=def", "--temperature=inf", names=["--temperature", "inf"],
             workdirs=EXISTING),
    launcher(SAMPLE, "sample refuses a top_p of 0", "--workdir={workdir}", "--prompt=def",
             "--top_p=0", names=["--top_p", "(0, 1]"], workdirs=EXISTING),
    launcher(SAMPLE, "sample refuses a top_p above 1", "--workdir={workdir}", "--prompt=def",
             "--top_p=1.5", names=["--top_p", "1.5"], workdirs=EXISTING),
    launcher(SAMPLE, "sample refuses zero new tokens", "--workdir={workdir}", "--prompt=def",
             "--max_new_tokens=0", names=["--max_new_tokens", "0"], workdirs=EXISTING),
    launcher(SAMPLE, "sample refuses a prompt longer than the model's max_seq_len",
             "--workdir={workdir}", "--prompt=" + "x" * 2048, names=["2049", "max_seq_len=2048"],
             workdirs=EXISTING),
    launcher(SAMPLE, "sample refuses more new tokens than max_seq_len leaves",
             "--workdir={workdir}", "--prompt=def", "--max_new_tokens=2048",
             names=["--max_new_tokens=2048", "max_seq_len=2048"], workdirs=EXISTING),
    # --- the real command line, as a user runs it -----------------------------------------------
    train("the train command names an unknown config key", "--config.train.stepz=3",
          names=["stepz"], workdirs=FRESH, cli=True),
    train("the train command refuses to resume a workdir with another d_model",
          "--config.model.d_model=32", names=[D_MODEL_32], workdirs=EXISTING, cli=True),
    launcher(PREPARE, "the prepare command names a config file with a syntax error",
             "--config=broken.py", "--out=tokens",
             files={"broken.py": "def get_config(:\n    pass\n"}, names=["broken.py", "line 1"],
             cli=True),
    launcher(SUPERVISE, "the supervise command needs a command", names=["command", "--"],
             cli=True),
    launcher(SAMPLE, "the sample command names a workdir without a checkpoint",
             "--workdir=started", "--prompt=def", files={"started/config.json": "{}\n"},
             names=["started", "no checkpoint"], cli=True),
    launcher(LOCAL, "the launch.local command suggests -- for a training flag",
             "--processes=2", "--config.train.steps=3", names=["--config.train.steps=3", " -- "],
             cli=True),
]


# --- every path by its kind -----------------------------------------------------------------------
# Each path an entry point takes (a flag, or a config key that names a file or folder) has a kind,
# and each kind its wrong inputs: (what it is, the path given, the files that make it so). Every
# path is given every wrong input of its kind; the error line must name the path given.
PLAN = "jaxscale.plan.__main__"  # a package: its command line is in __main__
NOT_TEXT = HF_TIED["model/model.safetensors"]  # binary: no format that reads text reads it
PATH_KINDS = {
    "config file": [
        ("a folder", "cfgs", {"cfgs/small.py": config_file()}),
        ("a JSON file", "c.json", {"c.json": '{"train": {"steps": 4}}\n'}),
        ("a YAML file", "c.yaml", {"c.yaml": "train:\n  steps: 4\n"}),
        ("Python in a .txt file", "c.txt", {"c.txt": config_file()}),
        ("a missing file", "nope.py", {}),
    ],
    "folder to write": [("a file", "notes.txt", NOTES),
                        ("a folder under a file", "notes.txt/sub", NOTES)],
    "folder to read": [("a file", "notes.txt", NOTES), ("a missing folder", "nowhere", {})],
    "tokenizer file": [("a folder", "tok", {"tok/tokenizer.json": HF_TIED["model/tokenizer.json"]}),
                       ("a missing file", "tok/missing.model", {}),
                       ("a file of another format", "vocab.bin", {"vocab.bin": b"\x00\x01\x02"})],
    **{f"{kind} data file": [
        ("a folder", "docs", {"docs/docs.jsonl": GOOD_JSONL}),
        ("a missing file", "missing.jsonl", {}),
        ("a file of another format", *(("docs.bin", {"docs.bin": NOT_TEXT}) if kind == "jsonl"
                                       else ("docs.jsonl", {"docs.jsonl": GOOD_JSONL}))),
    ] for kind in ("jsonl", "parquet", "array_record", "tokens")},
}
# (entry point, the path's argument with {path}, its kind, the other arguments, workdirs)
TRAIN_ARGS = ("--config={cfg}", "--workdir={workdir}")
PATHS = [
    ("jaxscale.train", "--config={path}", "config file", ("--workdir={workdir}",), BOTH),
    (PREPARE, "--config={path}", "config file", ("--out=tokens",), ()),
    (PLAN, "--config={path}", "config file", (), ()),
    ("jaxscale.train", "--workdir={path}", "folder to write", ("--config={cfg}",), ()),
    ("jaxscale.train", "--config.checkpoint.dir={path}", "folder to write", TRAIN_ARGS, BOTH),
    ("jaxscale.train", "--config.checkpoint.compilation_cache_dir={path}", "folder to write",
     (*TRAIN_ARGS, "--config.checkpoint.compilation_cache=True"), FRESH),
    (PREPARE, "--out={path}", "folder to write", ("--config={cfg}",), ()),
    (EXPORT, "--out={path}", "folder to write", ("--workdir={workdir}",), EXISTING),
    (SAMPLE, "--workdir={path}", "folder to read", ("--prompt=def",), ()),
    (SAMPLE, "--hf={path}", "folder to read", ("--prompt=def",), ()),
    (EXPORT, "--workdir={path}", "folder to read", ("--out=exported",), ()),
    ("jaxscale.train", "--config.checkpoint.restore_from={path}", "folder to read", TRAIN_ARGS,
     FRESH),
    ("jaxscale.train", "--config.data.tokenizer={path}", "tokenizer file", TRAIN_ARGS, FRESH),
    *[("jaxscale.train", f"--config.data.sources=(dict(format='{kind}', path='{{path}}'),)",
       f"{kind} data file", TRAIN_ARGS, FRESH)
      for kind in ("jsonl", "parquet", "array_record", "tokens")],
]
CASES += [Case(f"{module} {argument.split('=')[0]} ({kind}) given {what}", module,
               (argument.replace("{path}", path), *others), (path,), files, workdirs)
          for module, argument, kind, others, workdirs in PATHS
          for what, path, files in PATH_KINDS[kind]]


# --- the existing workdir ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_config(tmp_path_factory) -> str:
    """The small config's file, outside every case's folder."""
    path = tmp_path_factory.mktemp("config") / "small.py"
    path.write_text(config_file())
    return str(path)


@pytest.fixture(scope="module")
def existing_workdir(tmp_path_factory, small_config) -> str:
    """A real run's workdir: the small config trained 2 steps, with a checkpoint at step 2."""
    workdir = str(tmp_path_factory.mktemp("existing") / "run")
    status, out, err = run_in_process(
        "jaxscale.train", [f"--config={small_config}", f"--workdir={workdir}",
                           "--config.train.steps=2"])
    assert status == 0, out + err
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"], err
    return workdir


# --- running an entry point --------------------------------------------------------------------

def _main_call(module) -> str:
    """How the module's `__main__` block calls main: 'argv' (sys.argv), 'args' (sys.argv[1:]) or
    'none' (main() reads sys.argv itself)."""
    block = inspect.getsource(module).split("if __name__ == ", 1)[-1]
    if re.search(r"\bmain\(\s*sys\.argv\s*\)", block):
        return "argv"
    if re.search(r"\bmain\(\s*sys\.argv\[1:\]\s*\)", block):
        return "args"
    return "none"


def _compilation_cache_dir() -> str | None:
    jax = sys.modules.get("jax")
    return jax.config.jax_compilation_cache_dir if jax is not None else None


def run_in_process(module_name: str, args: list[str], capfd=None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m module_name *args`, run as its `__main__`
    block runs it, in this process. An exception that would end the process is formatted into
    stderr as Python would print it (status 1)."""
    from absl import flags

    module = importlib.import_module(module_name)
    argv = [module.__file__, *args]
    saved_argv, saved_handlers = sys.argv, {s: signal.getsignal(s)
                                            for s in (signal.SIGINT, signal.SIGTERM)}
    absl_flags = set(flags.FLAGS)
    cache_dir = _compilation_cache_dir()
    extra_err = ""
    sys.argv = list(argv)
    try:
        call = _main_call(module)
        result = module.main(argv if call == "argv" else args if call == "args" else None) \
            if call != "none" else module.main()
        status = result if isinstance(result, int) else 0  # as sys.exit(main(...)) would
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            status, extra_err = 1, f"{e.code}\n"
    except BaseException:  # noqa: BLE001 - what would end the process with a traceback
        status, extra_err = 1, traceback.format_exc()
    finally:
        sys.argv = saved_argv
        for s, handler in saved_handlers.items():
            signal.signal(s, handler)
        from jaxscale.observe.run_log import close_active

        close_active()  # the entry point's log split lasts to the end of its process
        # Flags the entry point itself defined in absl's global FLAGS (not those of libraries
        # imported meanwhile, e.g. grain's): the next call defines them again.
        for name in set(flags.FLAGS) - absl_flags:
            if flags.FLAGS.find_module_defining_flag(name) == module_name:
                delattr(flags.FLAGS, name)
        if _compilation_cache_dir() != cache_dir:  # a run that went ahead set it for the process
            from jax.experimental.compilation_cache import compilation_cache

            compilation_cache.set_cache_dir(cache_dir)
            compilation_cache.reset_cache()
    out, err = capfd.readouterr() if capfd is not None else ("", "")
    return status, out, err + extra_err


def run_cli(module_name: str, args: list[str], cwd: str) -> tuple[int, str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-m", module_name, *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout, result.stderr


# --- what a folder holds -----------------------------------------------------------------------

def listing(root: str) -> dict[str, tuple]:
    """{relative path: ('folder',), ('link', target) or ('file', size, sha256)} of everything
    under `root` (links are not followed)."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != "__pycache__"]  # Python's, not the run's
        for name in subfolders + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):  # a dangling one can be neither read nor walked
                found[os.path.relpath(path, root)] = ("link", os.readlink(path))
            elif name in subfolders:
                found[os.path.relpath(path, root)] = ("folder",)
            else:
                with open(path, "rb") as f:
                    data = f.read()
                found[os.path.relpath(path, root)] = ("file", len(data),
                                                      hashlib.sha256(data).hexdigest())
    return found


def changes(before: dict, after: dict) -> list[str]:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    return ([f"added {p}" for p in added] + [f"removed {p}" for p in removed]
            + [f"changed {p}" for p in changed])


def make_files(root: str, files: dict) -> None:
    for name, content in files.items():
        path = os.path.join(root, name)
        if content is None:
            os.makedirs(path, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, Link):
            os.symlink(content.target, path)
            continue
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())


def named(name, line: str) -> bool:
    """Whether `line` names `name`: a substring, or a compiled regex that matches somewhere."""
    return bool(name.search(line)) if isinstance(name, re.Pattern) else name in line


# --- the test ----------------------------------------------------------------------------------

def check_run(case: Case, folder: str, workdir_kind: str | None, small_config: str,
              existing_workdir: str, capfd) -> list[str]:
    """Runs `case` in `folder` (made here); returns what went wrong, [] when all is right."""
    os.makedirs(os.path.join(folder, "fresh"))
    shutil.copytree(existing_workdir, os.path.join(folder, "existing"))
    make_files(folder, case.files)
    values = dict(tmp=folder, cfg=small_config, python=sys.executable,
                  workdir=os.path.join(folder, workdir_kind or "fresh"))
    args = [a.format(**values) for a in case.args]
    before = listing(folder)
    if case.cli:
        status, out, err = run_cli(case.module, args, folder)
    else:
        capfd.readouterr()  # what earlier runs left
        cwd = os.getcwd()
        os.chdir(folder)  # relative paths are the case's folder's, as for the real command
        try:
            status, out, err = run_in_process(case.module, args, capfd)
        finally:
            os.chdir(cwd)
    after = listing(folder)

    problems = []
    if status != 2:
        problems.append(f"exit status {status}, not 2")
    if "Traceback" in out + err:
        problems.append("a traceback")
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    if len(errors) != 1 or len(lines) != 1:
        problems.append(f"stderr has {len(lines)} lines, {len(errors)} of them `error: ` lines; "
                        "wanted exactly one, the `error: ` line")
    if errors:
        # The case's folder is in many messages; a bad value must be named outside it.
        line = errors[0].replace(folder, "<folder>")
        missing = [name for name in case.names if not named(name, line)]
        if missing:
            problems.append(f"the error line does not name {missing}")
    damage = changes(before, after)
    if damage:
        problems.append(f"it wrote: {damage[:12]}")
    if not problems:
        return []
    where = f" (workdir: {workdir_kind})" if workdir_kind else ""
    return [f"{case.module} {' '.join(args)}{where}: " + "; ".join(problems)
            + f"\n--- stderr ---\n{err[-3000:]}\n--- stdout ---\n{out[-1500:]}"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_one_error_line_and_writes_nothing(case, tmp_path, capfd, small_config,
                                                          existing_workdir):
    problems = []
    for kind in case.workdirs or (None,):
        problems += check_run(case, str(tmp_path / f"with-{kind or 'no'}-workdir"), kind,
                              small_config, existing_workdir, capfd)
    assert not problems, "\n\n".join(problems)


def test_the_table_covers_every_entry_point_and_enough_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 45
    assert {c.module for c in CASES} == {"jaxscale.train", LOCAL, FIT, GKE, CHECK, SUPERVISE,
                                         PREPARE, EXPORT, SAMPLE, PLAN}
    assert {kind for _, _, kind, _, _ in PATHS} == set(PATH_KINDS)
    assert any(c.cli for c in CASES)
    assert {"fresh", "existing"} <= {kind for c in CASES for kind in c.workdirs}
