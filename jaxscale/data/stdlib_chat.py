"""A chat data set that needs no download: questions about the Python standard library, answered
from its own source.

    python -m jaxscale.data.stdlib_chat --out=runs/stdlib_chat.jsonl [--seed=0] [--pairs=N]

writes a `chat` source (docs/data.md), one conversation a line, two kinds of question about each
public, documented function or class of a public standard-library module (read with `ast`; nothing
is imported or run):

    {"messages": [{"role": "user", "content": "What does json.dumps do?"},
                  {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."}]}
    {"messages": [{"role": "user", "content": "How do I call shutil.copyfile?"},
                  {"role": "assistant", "content": "shutil.copyfile(src, dst, *, follow_symlinks=True)"}]}

The first answer is the docstring's first paragraph; the second is the signature (a class's is its
`__init__`'s, less `self`). Answers over MAX_ANSWER_CHARS are left out (json.dumps's signature,
167 characters, is one). The tiny model learns the signature's shape (a dotted name, then an
argument list with defaults, then the end of the turn) within 100-150 steps (docs/finetuning.md).
`--seed` picks and orders the pairs (`--pairs`, default all: 3,497 with Python 3.11.7). The same
seed writes the same bytes wherever this Python version's standard library is the same (another
version documents other functions, so it writes other pairs).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import random
import sys

from jaxscale.cli import ArgumentParser, fail_with, number_flag
from jaxscale.data.sources import stdlib_files
from jaxscale.errors import JaxscaleError
from jaxscale.kinds import whole

# Answers longer than this are left out: with the built-in template's headers and a question,
# every conversation then fits a row of 256 byte tokens (configs/tiny_chat.py), so none is skipped.
MAX_ANSWER_CHARS = 150
# Tests and demos, not the library's API.
_SKIPPED_PACKAGES = ("test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo")
QUESTIONS = {"doc": "What does {} do?", "call": "How do I call {}?"}


def module_name(relative_path: str) -> str | None:
    """'email/mime/text.py' -> 'email.mime.text', 'json/__init__.py' -> 'json'; None for a
    private module (a part starting with '_') or one of the test and demo packages."""
    parts = relative_path[:-len(".py")].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    # Not an identifier: no importable module (the config-3.11-x86_64-linux-gnu folder).
    if not parts or any(p.startswith("_") or p in _SKIPPED_PACKAGES or not p.isidentifier()
                        for p in parts):
        return None
    return ".".join(parts)


def _first_paragraph(node: ast.AST) -> str:
    docstring = ast.get_docstring(node) or ""
    return " ".join(docstring.split("\n\n")[0].split())


def _signature(node: ast.FunctionDef | ast.ClassDef) -> str | None:
    """The argument list as written (`obj, *, skipkeys=False`), without annotations; a class's
    is its `__init__`'s without `self`; None for a class that defines no `__init__`."""
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == "__init__"), None)
        if init is None:
            return None
        a = init.args  # `self` is the first positional argument, positional-only or not
        posonly, args = (a.posonlyargs[1:], a.args) if a.posonlyargs else ([], a.args[1:])
        arguments = ast.arguments(posonlyargs=posonly, args=args, vararg=a.vararg,
                                  kwonlyargs=a.kwonlyargs, kw_defaults=a.kw_defaults,
                                  kwarg=a.kwarg, defaults=a.defaults)
    else:
        arguments = node.args
    for argument in ast.walk(arguments):  # the parsed tree is thrown away after this file
        if isinstance(argument, ast.arg):
            argument.annotation = None
    return ast.unparse(arguments)


def _answers(qualified: str, node: ast.FunctionDef | ast.ClassDef) -> dict[str, str]:
    """{question kind: answer} for one definition, leaving out answers that are empty or long."""
    answers = {"doc": _first_paragraph(node)}
    signature = _signature(node)
    if signature is not None:
        answers["call"] = f"{qualified}({signature})"
    return {kind: a for kind, a in answers.items() if a and len(a) <= MAX_ANSWER_CHARS}


@functools.cache  # parsing the library takes seconds; what it gives cannot change in a process
def all_pairs() -> tuple[tuple[str, str], ...]:
    """Every (question, answer) of this Python's standard library, in a fixed order: its files
    sorted, then definitions in file order."""
    root, paths = stdlib_files()
    pairs = []
    for path in paths:
        module = module_name(path)
        if module is None:
            continue
        try:
            with open(os.path.join(root, path), "rb") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, ValueError, OSError):  # a file this Python cannot parse or read
            continue
        for node in tree.body:
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef))
                    and not node.name.startswith("_") and ast.get_docstring(node)):
                qualified = f"{module}.{node.name}"
                for kind, answer in _answers(qualified, node).items():
                    pairs.append((QUESTIONS[kind].format(qualified), answer))
    return tuple(pairs)


def conversations(seed: int, count: int = 0) -> list[dict]:
    """`count` conversations (0: all), picked and ordered by `seed`; JaxscaleError when the
    library has fewer pairs."""
    pairs = list(all_pairs())
    count = count or len(pairs)
    if count > len(pairs):
        raise JaxscaleError(f"--pairs={count}: this Python's standard library gives "
                            f"{len(pairs)} pairs; ask for at most {len(pairs)}, or --pairs=0 "
                            "for all")
    random.Random(seed).shuffle(pairs)
    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": answer}]}
            for question, answer in pairs[:count]]


def write(out: str, seed: int, count: int) -> str:
    """Writes the conversations to `out` (its folder is created); returns a line saying so."""
    if os.path.isdir(out):
        raise JaxscaleError(f"--out={out!r} is a folder; give a file name, e.g. "
                            f"--out={os.path.join(out, 'stdlib_chat.jsonl')}")
    records = conversations(seed, count)
    try:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    except OSError as e:
        raise JaxscaleError(f"--out={out!r} cannot be written ({e.strerror or e}); give a file "
                            "in a folder you can write to") from None
    return f"wrote {len(records)} conversations (seed {seed}) to {out}"


def main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="python -m jaxscale.data.stdlib_chat",
                             description="Write a chat JSONL of questions about the Python "
                                         "standard library (docs/finetuning.md).")
    parser.add_argument("--out", required=True, help="The JSONL file to write.")
    parser.add_argument("--seed", type=number_flag(whole("[0, inf)")), default=0,
                        help="Picks and orders the pairs (default 0).")
    parser.add_argument("--pairs", type=number_flag(whole("[0, inf)", {0: "all"})), default=0,
                        help="How many conversations (default 0: every pair there is).")
    args = parser.parse_args(argv)
    try:
        print(write(args.out, args.seed, args.pairs), flush=True)
    except JaxscaleError as e:
        fail_with(e)


if __name__ == "__main__":
    main(sys.argv[1:])
