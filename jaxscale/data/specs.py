"""The `data.sources` entries as checked specs: each a dict of its format's keys, defaults filled
in, every mistake one ConfigError naming `data.sources[i]` (`source_specs`). Entries may come as
Python literals from the command line (`literal` reads them, evaluating nothing). What a spec's
documents are is sources.py's."""

from __future__ import annotations

import ast
from collections.abc import Sequence

import ml_collections

from jaxscale.errors import ConfigError
from jaxscale.kinds import real

# Keys every source takes, with defaults; then the keys of each format (None: required).
_COMMON = dict(weight=1.0, eval_fraction=0.02, eval_path="")
FORMATS = {
    "stdlib": {},
    "synthetic": {},
    "text": dict(path=None, document="file"),
    "jsonl": dict(path=None, text_field="text"),
    "parquet": dict(path=None, text_field="text"),
    "array_record": dict(path=None),
    "tokens": dict(path=None),
    "chat": dict(path=None, template=""),
}
_TEXT_DOCUMENTS = ("file", "line")


def source_specs(config: ml_collections.ConfigDict) -> list[dict]:
    """`config.data.sources` checked and completed with defaults; ConfigError on any mistake.

    Entries may also be strings of Python literals and `dict(key=value, ...)` calls, which is
    what a command-line override such as
    `--config.data.sources="(dict(format='jsonl', path='x.jsonl'),)"` delivers: ml_collections
    passes it on as a tuple holding that one string. A string holding a tuple adds each of its
    entries.
    """
    entries = config.data.sources
    if isinstance(entries, str):
        entries = (entries,)
    if not isinstance(entries, (tuple, list)) or not entries:
        raise ConfigError(f"data.sources={entries!r} must be a non-empty tuple of dicts, e.g. "
                          "(dict(format='jsonl', path='data/*.jsonl'),)")
    parsed = []
    for entry in entries:
        if isinstance(entry, str):
            value = _parse_source_text(len(parsed), entry)
            parsed += list(value) if isinstance(value, (tuple, list)) else [value]
        else:
            parsed.append(entry)
    if not parsed:
        raise ConfigError(f"data.sources={entries!r} must be a non-empty tuple of dicts, e.g. "
                          "(dict(format='jsonl', path='data/*.jsonl'),)")
    return [_source_spec(i, entry) for i, entry in enumerate(parsed)]


_EXAMPLE_OVERRIDE = "--config.data.sources=\"(dict(format='jsonl', path='data/*.jsonl'),)\""


def _parse_source_text(i: int, text: str):
    try:
        return literal(text)
    except ValueError as e:
        raise ConfigError(f"data.sources[{i}]={text!r} cannot be read: {e}; write sources as "
                          f"Python literals, e.g. {_EXAMPLE_OVERRIDE}") from None


def literal(text: str):
    """The value of `text` if it is made only of Python literals (strings, numbers, booleans,
    None), tuples, lists, `{...}` dicts and `dict(key=value, ...)` calls; ValueError naming the
    first other part. Nothing is evaluated: names, calls and operators are refused."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"it is not a Python expression ({e.msg})") from None
    return _literal_node(tree.body)


def _literal_node(node: ast.AST):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_literal_node(n) for n in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal_node(v) for k, v in zip(node.keys, node.values)}
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "dict" and not node.args
            and all(k.arg is not None for k in node.keywords)):
        return {k.arg: _literal_node(k.value) for k in node.keywords}
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name):
        raise ValueError(f"{node.id} is a name, not a value (quote strings: '{node.id}')")
    raise ValueError(f"{ast.unparse(node)} is not a literal or dict(key=value, ...)")


def _source_spec(i: int, entry) -> dict:
    where = f"data.sources[{i}]"
    if not isinstance(entry, (dict, ml_collections.ConfigDict)) or "format" not in entry:
        raise ConfigError(f"{where}={entry!r} must be a dict with a 'format' key, e.g. "
                          "dict(format='jsonl', path='data/*.jsonl')")
    entry = dict(entry)
    kind = entry.pop("format")
    if kind not in FORMATS:
        raise ConfigError(f"{where}.format={kind!r} is unknown; use one of {tuple(FORMATS)}")
    allowed = {**_COMMON, **FORMATS[kind]}
    for key in entry:
        if key not in allowed:
            raise ConfigError(f"{where} has unknown key {key!r}; a {kind} source takes "
                              f"{sorted(allowed)}")
    spec = {**allowed, **entry, "format": kind, "name": where}
    for key, default in allowed.items():
        if default is None and not spec[key]:
            raise ConfigError(f"{where} ({kind}) needs {key!r}: a file path or glob")
    for key, number, meaning in (("weight", real("(0, inf)"), "weights are relative shares of "
                                  "documents"),
                                 ("eval_fraction", real("(0, 1)"), "the share of its documents "
                                  "held out for eval")):
        if problem := number.problem(spec[key]):
            raise ConfigError(f"{where}.{key}={spec[key]!r} {problem} ({meaning})")
    for key in ("path", "eval_path", "text_field", "document", "template"):
        if key in spec and not isinstance(spec[key], str):
            raise ConfigError(f"{where}.{key}={spec[key]!r} must be a string")
    if spec["eval_path"] and kind in ("stdlib", "synthetic"):
        raise ConfigError(f"{where}.eval_path={spec['eval_path']!r} is for file sources; a "
                          f"{kind} source holds out its own eval documents: leave eval_path out")
    if kind == "text" and spec["document"] not in _TEXT_DOCUMENTS:
        raise ConfigError(f"{where}.document={spec['document']!r} must be one of "
                          f"{_TEXT_DOCUMENTS} (one document per file or per line)")
    return spec


def has_chat(specs: Sequence[dict]) -> bool:
    """Whether some source is chat data, whose documents carry their own loss mask."""
    return any(spec["format"] == "chat" for spec in specs)


def describe(spec: dict) -> str:
    """"data.sources[i] (FORMAT 'PATH')": a source as messages name it."""
    path = f" {spec['path']!r}" if spec.get("path") else ""
    return f"{spec['name']} ({spec['format']}{path})"
