"""The command line: flags, config files and `fail`, for every jaxscale entry point that reads a
config (`jaxscale.train`, `jaxscale.data.prepare`, the launchers' pre-checks).

    config, values = parse_config_flags(sys.argv, prog="python -m jaxscale.train", about=__doc__,
                                        options=[Option("workdir", "runs/default", "Folder ...")])

A mistake the user can fix (a bad flag, a config file that does not load, a bad override, a key
or number not of the schema) ends the process with one `error: <what, the bad value, the fix>`
line and exit status 2, before JAX is imported or anything is written. `--help` prints every flag
with a sentence and exits 0. The argparse entry points type their flags with `number_flag` and
`folder_flag`, so that their numbers and folders are checked the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import traceback
from typing import NoReturn

import ml_collections
from absl import flags
from ml_collections import config_flags

from jaxscale.config import check_schema
from jaxscale.errors import (
    TRANSIENT_EXIT_CODE,
    USAGE_EXIT_CODE,
    ConfigError,
    JaxscaleError,
    TransientError,
)
from jaxscale.kinds import Number

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(_REPO, "configs", "tiny.py")
_HELP_FLAGS = ("--help", "-h", "-help", "--helpfull", "--helpshort")


def fail(message: str, exit_code: int = USAGE_EXIT_CODE, exit=sys.exit) -> NoReturn:
    """Ends the process the way every user mistake ends it: one line, exit status 2 (or
    `exit_code`: 75 for a transient failure); `exit=os._exit` skips the clean-up.

    The line is one write: `print` writes the text and its newline separately, and a library's
    thread still printing (Orbax and TensorStore report a failed save from several) could land
    between them. A transient failure starts on a line of its own for the same reason: such a
    thread may have left its last line unfinished."""
    fresh_line = "\n" if exit_code == TRANSIENT_EXIT_CODE else ""
    sys.stderr.write(f"{fresh_line}error: {message}\n")
    sys.stderr.flush()
    exit(exit_code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error: ...` line and exit status 2."""

    def error(self, message: str) -> None:
        fail(f"{message} (see {self.prog} --help)")


def fail_with(error: JaxscaleError | TransientError, exit=sys.exit) -> NoReturn:
    """One `error: ...` line, and the exit status that says what to do next: 2 for the user's
    mistake, 75 for a transient failure of the infrastructure (`exit`: as `fail`'s)."""
    if isinstance(error, TransientError):
        fail(f"{error} (transient: exit {TRANSIENT_EXIT_CODE}, retry with backoff)",
             TRANSIENT_EXIT_CODE, exit)
    fail(str(error), exit=exit)


@dataclasses.dataclass(frozen=True)
class Option:
    """A plain flag next to --config: `--NAME=VALUE`, a string (or an int when `default` is, of
    `kind` when given; a switch, `--NAME` or `--noNAME`, when `default` is a bool)."""
    name: str
    default: str | int | bool | None
    help: str
    metavar: str = "VALUE"
    kind: Number | None = None

    @property
    def usage(self) -> str:
        """The flag as --help shows it: a switch bare (`--json`), else `--NAME=METAVAR`."""
        return f"--{self.name}" if isinstance(self.default, bool) else \
            f"--{self.name}={self.metavar}"


def number_flag(kind: Number):
    """An argparse `type`: the flag's text as a number of `kind` (jaxscale.config.Number), or
    argparse's error naming the value and what the flag takes."""
    def parse(text: str):
        try:
            value = int(text) if kind.whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind.whole else 'a number'}; pass one "
                f"{kind.allowed()}") from None
        problem = kind.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{text} {problem}")
        return value
    return parse


def folder_flag(text: str) -> str:
    """An argparse `type`: a folder that exists (a run's workdir, a model folder)."""
    if os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; this flag takes a folder")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"folder {text!r} does not exist; check the path")
    return text


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Imports the config file and returns its `get_config()`, or `get_config(ARG)` for
    `spec` = FILE:ARG (as ml_collections' config_flags: configs/hf.py:/path/to/model); ConfigError
    naming the file, the line and the fix when it does not load or does not return a
    ConfigDict."""
    path, arg = spec, None
    if not os.path.isfile(spec) and ":" in spec:
        path, arg = spec.split(":", 1)
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".py"))
        holds = f" (it holds {', '.join(found[:4])}{', ...' if found[4:] else ''})" if found else ""
        raise ConfigError(f"config file {path!r} is a folder; pass a Python file with "
                          f"get_config(), e.g. --config={os.path.join(path, 'NAME.py')}{holds}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist; pass --config=configs/NAME.py "
                          "(a Python file with get_config())")
    if not path.endswith(".py"):
        raise ConfigError(f"config file {path!r} is not a Python file (.py); --config takes a "
                          "Python file whose get_config() returns the config (JSON and YAML "
                          "are not read), e.g. --config=configs/tiny.py")
    module_spec = importlib.util.spec_from_file_location("jaxscale_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(f"config file {path!r} line {e.lineno}: syntax error ({e.msg}); fix "
                          "the Python in that line") from None
    except SystemExit as e:  # sys.exit() in the file would end the run silently, with its status
        raise ConfigError(_exited(path, e)) from None
    except Exception as e:  # noqa: BLE001 - whatever the file raises is the user's to fix
        raise ConfigError(_raised_in(path, e, "failed to load")) from None
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"config file {path!r} has no get_config() function; define one that "
                          "returns jaxscale.config.default_config() with your changes")
    try:
        config = get_config() if arg is None else get_config(arg)
    except JaxscaleError as e:  # the file's own check of its argument, already worded
        raise ConfigError(f"config file {spec!r}: {e}") from None
    except SystemExit as e:
        raise ConfigError(_exited(path, e)) from None
    except Exception as e:  # noqa: BLE001 - e.g. a str assigned to an int key
        raise ConfigError(_raised_in(path, e, "get_config() failed")) from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path!r}: get_config() returned a "
                          f"{type(config).__name__}, not an ml_collections.ConfigDict; start from "
                          "`config = jaxscale.config.default_config()` and return it")
    return config


def _line_in(path: str, error: BaseException) -> str:
    """' line N', the deepest line of `path` in the error's traceback, so the user sees where in
    their file it went wrong; '' when the file is not in it."""
    line = None
    for frame in traceback.extract_tb(error.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(path):
            line = frame.lineno
    return f" line {line}" if line else ""


def _raised_in(path: str, error: Exception, what: str) -> str:
    """'config file X line N: <what> (TypeError: ...)'."""
    return (f"config file {path!r}{_line_in(path, error)}: {what} ({type(error).__name__}: "
            f"{_one_line(_message(error))}); fix that line, e.g. give each key a value of its "
            "default's type (see jaxscale/config.py:default_config())")


def _exited(path: str, error: SystemExit) -> str:
    """'config file X line N exited with status S ...', for a file that called sys.exit()."""
    # sys.exit's argument as Python's exit status: None is 0, a message is 1 (printed).
    code = error.code
    status = (f"status {code or 0}" if code is None or isinstance(code, int)
              else f"status 1: {_one_line(str(code))}")
    return (f"config file {path!r}{_line_in(path, error)} exited (sys.exit) with {status}; a "
            "config file returns its config: raise an exception that says what is wrong "
            "instead, or remove the exit")


def _message(error: Exception) -> str:
    """An exception's text without the quoting KeyError adds (`'\\'steps\\'\\nDid you...'`),
    also when wrapped in another exception (ml_collections raises AttributeError(KeyError))."""
    while len(error.args) == 1 and isinstance(error.args[0], Exception):
        error = error.args[0]
    return str(error.args[0]) if len(error.args) == 1 else str(error)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def config_path(argv: list[str], default: str = DEFAULT_CONFIG) -> str:
    """The value of `--config=PATH` (or `--config PATH`) in `argv`, else `default`."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config":
            if i + 1 == len(argv):
                fail("--config needs a FILE: --config=configs/NAME.py")
            return argv[i + 1]
    return default


def _without_config_path(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--config":
            skip = True
        elif not arg.startswith("--config="):
            out.append(arg)
    return out


def print_help(prog: str, about: str, options: list[Option], config_help: str) -> None:
    lines = [f"usage: {prog} [--config=FILE] "
             + " ".join(f"[{o.usage}]" for o in options)
             + " [--config.KEY=VALUE ...]", "", about.strip(), "", "flags:",
             f"  --config=FILE  {config_help} (default: {os.path.relpath(DEFAULT_CONFIG)})"]
    for o in options:
        default = f" (default: {o.default})" if o.default not in (None, "") else ""
        lines.append(f"  {o.usage}  {o.help}{default}")
    lines.append("  --config.KEY=VALUE  override one key of the config, e.g. "
                 "--config.train.steps=100 or --config.mesh.fsdp=4; every key and its default is "
                 "in jaxscale/config.py:default_config() (README: Config keys)")
    lines.append("  --help  show this message and exit")
    print("\n".join(lines))


DEFAULT_WORKDIR = os.path.join("runs", "default")
TRAIN_OPTIONS = [Option("workdir", DEFAULT_WORKDIR, "folder for metrics, TensorBoard files and "
                        "checkpoints; a workdir with checkpoints resumes from the newest", "DIR"),
                 Option("verbose", False, "show what libraries log (Orbax, JAX, absl, their "
                        "tracebacks) on the terminal too; it always goes to <workdir>/train.log")]


def parse_train_command(argv: list[str], about: str = "") -> tuple[ml_collections.ConfigDict,
                                                                   dict]:
    """(config, {"workdir": ..., "verbose": ...}) from a `python -m jaxscale.train` command
    line."""
    return parse_config_flags(argv, prog="python -m jaxscale.train", about=about,
                              options=TRAIN_OPTIONS)


def parse_train_flags(argv: list[str], about: str = "") -> tuple[ml_collections.ConfigDict, str]:
    """(config, workdir) from a `python -m jaxscale.train` command line; the launchers' pre-checks
    parse a training command with it too, so they accept exactly what training accepts."""
    config, values = parse_train_command(argv, about)
    return config, values["workdir"]


def parse_config_flags(argv: list[str], *, prog: str, about: str, options: list[Option],
                       config_help: str = "the config: a Python file whose get_config() returns "
                                          "an ml_collections.ConfigDict; FILE:ARG calls "
                                          "get_config(ARG), e.g. configs/hf.py:/path/to/model",
                       ) -> tuple[ml_collections.ConfigDict, dict]:
    """(config with overrides applied, {option name: value}) from `argv` (argv[0] is the
    program). Exits with `error: ...` on any mistake and with status 0 after `--help`."""
    args = argv[1:]
    if any(a in _HELP_FLAGS for a in args):
        print_help(prog, about, options, config_help)
        sys.exit(0)
    try:
        config = load_config_file(config_path(args))
    except ConfigError as e:
        fail(str(e))
    flag_values = flags.FlagValues()
    stripped = [argv[0], *_without_config_path(args)]
    overrides = [a for a in stripped if a.startswith("--config.")]
    try:
        # Overrides are applied here, while the flag is defined (ml_collections reads sys_argv).
        config_flags.DEFINE_config_dict("config", config, flag_values=flag_values,
                                        lock_config=True, sys_argv=stripped)
        holders = {}
        for o in options:
            define = (flags.DEFINE_bool if isinstance(o.default, bool) else
                      flags.DEFINE_integer if isinstance(o.default, int) else flags.DEFINE_string)
            holders[o.name] = define(o.name, o.default, o.help, flag_values=flag_values)
        rest = flag_values(stripped)
    except flags.Error as e:
        fail(f"{_one_line(_message(e))}; see {prog} --help")
    except (KeyError, AttributeError, ValueError, TypeError) as e:  # a bad --config.KEY override
        fail(f"bad override among {overrides} ({_one_line(_message(e))}); the keys and their "
             "types are those of jaxscale/config.py:default_config()")
    if len(rest) > 1:
        fail(f"unexpected arguments {rest[1:]}; flags look like --config.KEY=VALUE"
             + "".join(f" {o.usage}" for o in options))
    values = {name: holder.value for name, holder in holders.items()}
    for o in options:
        problem = o.kind and o.kind.problem(values[o.name])
        if problem:
            fail(f"--{o.name}={values[o.name]} {problem}")
    try:
        check_schema(config)
    except ConfigError as e:
        fail(str(e))
    return config, values
