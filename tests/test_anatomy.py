"""The package's imports go one way: each module imports only modules of its own layer or below,
and no imports form a cycle. Imports inside functions count too: a lazy import hides a cycle from
Python, not from a reader. README's Layout section describes the same layers."""

import ast
import pathlib
import re
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxscale"

# Lowest first. A module belongs to the first layer one of whose prefixes it starts with.
LAYERS = (
    ("foundation", ("jaxscale.errors", "jaxscale.kinds", "jaxscale.config", "jaxscale.cli")),
    ("runtime", ("jaxscale.runtime",)),
    ("models and parallelism", ("jaxscale.models", "jaxscale.parallel")),
    ("components", ("jaxscale.data", "jaxscale.checkpoint", "jaxscale.training",
                    "jaxscale.observe", "jaxscale.hf", "jaxscale.inference")),
    ("orchestration", ("jaxscale.checks", "jaxscale.trainer", "jaxscale.plan")),
    ("entry points", ("jaxscale.train", "jaxscale.sample", "jaxscale.export_hf",
                      "jaxscale.supervise", "jaxscale.launch", "jaxscale.plan.__main__",
                      "jaxscale")),
)


def module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of `module`: its longest matching prefix decides (jaxscale.plan.__main__ is an
    entry point, the rest of jaxscale.plan orchestration)."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS)
               for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS (and to README's Layout)"
    return max(matches)[1]


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its file (`from jaxscale.x import
    y` counts as jaxscale.x.y when that is a module, else as jaxscale.x)."""
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files
                         else node.module for alias in node.names]
            else:
                continue
            imported |= {name for name in names if name in files and name != module}
        graph[module] = imported
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
            f"({LAYERS[layer_of(target)][0]})"
            for module, targets in sorted(graph.items()) for target in sorted(targets)
            if layer_of(target) > layer_of(module)]


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import cycle a depth-first walk meets, as [a, b, ..., a]; None when acyclic."""
    visiting, done = [], set()

    def visit(module):
        if module in visiting:
            return visiting[visiting.index(module):] + [module]
        if module in done:
            return None
        visiting.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    return next(filter(None, map(visit, sorted(graph))), None)


def test_every_import_goes_down_the_layers_or_stays_in_its_own():
    assert not upward_imports(import_graph()), "\n".join(upward_imports(import_graph()))


def test_no_import_cycle():
    cycle = first_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_guard_sees_a_cycle_and_an_upward_import(tmp_path):
    """A package whose config imports the mesh inside a function, and the mesh the config."""
    package = tmp_path / "jaxscale"
    (package / "parallel").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "parallel" / "__init__.py").write_text("")
    (package / "config.py").write_text("def f():\n    from jaxscale.parallel import mesh\n")
    (package / "parallel" / "mesh.py").write_text("from jaxscale import config\n")
    graph = import_graph(package)
    assert first_cycle(graph) == ["jaxscale.config", "jaxscale.parallel.mesh", "jaxscale.config"]
    assert upward_imports(graph) == [
        "jaxscale.config (foundation) imports jaxscale.parallel.mesh (models and parallelism)"]


# The calls that exchange host values between processes. Processes agree in one module
# (jaxscale/runtime/agreement.py): elsewhere these are agreements that nobody can review together.
CROSS_PROCESS_CALLS = ("process_allgather", "broadcast_one_to_all", "sync_global_devices")
# Where a gather moves data, not an answer: an exported weight's shards onto every host.
GATHERS_OF_DATA = {"jaxscale.hf.weights"}


def cross_process_calls(package: pathlib.Path = PACKAGE) -> list[str]:
    """`module: call` for each call of CROSS_PROCESS_CALLS outside runtime/agreement.py."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        if module in ("jaxscale.runtime.agreement", *GATHERS_OF_DATA):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (node.func.attr if isinstance(node, ast.Call) and isinstance(node.func,
                                                                                ast.Attribute)
                    else node.func.id if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name) else None)
            if name in CROSS_PROCESS_CALLS:
                found.append(f"{module}:{node.lineno}: {name}")
    return found


def test_processes_agree_only_through_runtime_agreement():
    assert not cross_process_calls(), "\n".join(cross_process_calls())


def test_the_agreement_guard_sees_a_gather_elsewhere(tmp_path):
    package = tmp_path / "jaxscale"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data.py").write_text(
        "from jax.experimental import multihost_utils\n"
        "def f(x):\n    return multihost_utils.process_allgather(x)\n")
    assert cross_process_calls(package) == ["jaxscale.data:3: process_allgather"]


# They read the model (its families, its abstract form, its parameters on a mesh) from models/,
# not from training/, which builds the train step on it; the checkpoint saves any train state.
MODEL_READERS = ("jaxscale.hf", "jaxscale.checkpoint", "jaxscale.inference", "jaxscale.export_hf")


def test_the_model_readers_import_nothing_from_training():
    graph = import_graph()
    found = [f"{module} imports {target}" for module, targets in sorted(graph.items())
             for target in sorted(targets) if target.startswith("jaxscale.training")
             and any(module == r or module.startswith(r + ".") for r in MODEL_READERS)]
    assert not found, "\n".join(found)


def test_the_family_table_and_hf_config_import_no_jax():
    """configs/hf.py reads a Hugging Face config.json through them before JAX starts."""
    code = ("import sys, jaxscale.models, jaxscale.hf.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent,
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_readmes_layout_names_every_package_module_and_config():
    """README's Layout section is the tree's map: each of jaxscale's packages and top-level
    modules, and each shipped config, is named there."""
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    names = [f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    names += [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in (PACKAGE.parent / "configs").glob("*.py")]
    missing = sorted(name for name in names if name not in layout)
    assert not missing, f"README's Layout does not name {missing}"


def keys_named_in(cell: str) -> set[str]:
    """The keys a README table cell names: `steps`, `rope_scaling.{type,factor}` (both),
    `dcn.<axis>` (a group, every key of it)."""
    named = set()
    for token in re.findall(r"`([a-z_][a-z0-9_.{},<> ]*)`", cell):
        braces = re.fullmatch(r"([a-z0-9_.]*)\{([a-z0-9_, ]+)\}", token)
        if braces:
            named |= {braces[1] + name.strip() for name in braces[2].split(",")}
        else:
            named.add(re.sub(r"\.<[a-z ]+>$", ".*", token))
    return named


def test_the_readmes_table_names_every_config_key():
    """README's table of config keys, row by group, names each key of jaxscale/config.py's
    SCHEMA (a group of keys by `group.<...>`)."""
    from jaxscale.config import declared_keys

    readme = (PACKAGE.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.+) \|$", readme, re.M))
    missing = []
    for path in declared_keys():
        group, key = path.split(".", 1)
        named = keys_named_in(rows.get(group, ""))
        if key not in named and not any(n.endswith(".*") and key.startswith(n[:-1])
                                        for n in named):
            missing.append(path)
    assert not missing, f"README's table of config keys lacks {missing}"



def family_mentions(package: pathlib.Path = PACKAGE) -> list[str]:
    """Where a package file outside models/ names a family in code, as 'FILE names NAME': a
    string that is a family's `model.name`, Hugging Face architecture or model_type, a name that
    is its config class, or an import of its module. Prose (docstrings, comments, help text) may
    give families as examples."""
    from jaxscale.models import FAMILIES
    from jaxscale.models.spec import family_module
    strings = {s for f in FAMILIES.values() for s in (f.name, f.hf_architecture, f.hf_model_type)}
    classes = {family_module(name).Config.__name__ for name in FAMILIES}
    modules = {f.module for f in FAMILIES.values()}

    def named(node) -> str | None:
        if isinstance(node, ast.Constant) and node.value in strings:
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            return name if name in classes else None
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            prefix = f"{node.module}." if isinstance(node, ast.ImportFrom) else ""
            return next((prefix + a.name for a in node.names if prefix + a.name in modules
                         or getattr(node, "module", None) in modules), None)
        return None

    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (name := named(node)) is not None:
                found.append(f"{path.relative_to(package.parent)} names {name!r}")
    return found


def test_no_package_file_outside_models_names_a_family():
    """Adding a family is its file in models/, its row, its config and its tests: nothing else in
    the package tells one family from another, the schema's default `model.name` included (it is
    "", which models/ reads as its DEFAULT_FAMILY)."""
    assert family_mentions() == []


def test_the_family_search_finds_a_family_named_in_code(tmp_path):
    """It can fail: a module outside models/ that imports a family's module or config class, or
    compares a name to a family's, is found."""
    package = tmp_path / "jaxscale"
    package.mkdir()
    (package / "hf.py").write_text("from jaxscale.models.llama import LlamaConfig\n"
                                   "import jaxscale.models.qwen3\n"
                                   "def f(name):\n    return name == 'mistral'\n"
                                   "def g(cfg):\n    return isinstance(cfg, LlamaConfig)\n")
    assert sorted(family_mentions(package)) == sorted([
        "jaxscale/hf.py names 'jaxscale.models.llama.LlamaConfig'",
        "jaxscale/hf.py names 'LlamaConfig'", "jaxscale/hf.py names 'jaxscale.models.qwen3'",
        "jaxscale/hf.py names 'mistral'"])


def test_the_tree_is_clean_under_the_linter_ci_runs():
    """.ci/run runs ruff (configured in pyproject.toml) before the tests; a finding here is one
    CI would fail on."""
    assert "ruff check" in (PACKAGE.parent / ".ci" / "run").read_text()
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."],
                            cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
