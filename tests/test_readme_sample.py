"""The README's sample is one a fresh clone reproduces (issue 45, item 8): its first command
trains the default run, its sample command continues the prompt, and the same seed gives the
same text every time. Where jax and Python are the versions the README names, the text is the
README's, character for character (the default run trains on this Python's own standard library,
so another Python trains on other text, and another jax may round otherwise)."""

import os
import platform
import re
import shlex
import subprocess
import sys

import jax
import pytest

from tests.helpers import REPO


def readme_sample() -> tuple[list[str], str, tuple[str, str]]:
    """(the sample command's arguments, the text the README shows, (jax, Python) versions it
    names)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## Sampling", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(python -m jaxscale\.sample .*?)\n```", section, re.S)[1]
    text = re.search(r"```bash\n.*?\n```\n```\n(.*?)```", section, re.S)[1]
    versions = re.search(r"jax ([\d.]+), Python ([\d.]+)", section)
    return shlex.split(command.replace("\\\n", " ")), text, (versions[1], versions[2])


def test_the_readme_names_its_sample_command_text_and_versions():
    args, text, versions = readme_sample()
    assert args[:3] == ["python", "-m", "jaxscale.sample"] and "--seed=0" in args
    assert "--workdir=runs/default" in args and text.strip()
    assert all(versions)


@pytest.mark.slow
def test_the_readme_sample_is_reproduced_by_its_commands(tmp_path):
    """The README's two commands, run from a folder of their own with one CPU device, as a
    newcomer runs them (the default training: about 1 to 6 minutes on 2 cores)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a newcomer's laptop
    trained = subprocess.run([sys.executable, "-m", "jaxscale.train"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=1800)
    assert trained.returncode == 0, trained.stderr[-3000:]
    args, text, versions = readme_sample()

    def sample() -> str:
        result = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    first = sample()
    assert first.strip() and sample() == first  # the same seed, the same text
    if (jax.__version__, platform.python_version()) == versions:
        assert first == text, f"the README shows {text!r}; the commands gave {first!r}"
