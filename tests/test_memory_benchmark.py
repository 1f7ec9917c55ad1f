"""benchmarks/memory.py's MaxText options, without MaxText or a compile: the values of
num_vocab_tiling it compiles MaxText with, and its bad inputs (one `error:` line, exit status 2,
before anything is compiled or MaxText is looked for)."""

import os

import pytest

from jaxscale.errors import ConfigError
from tests.helpers import REPO, benchmark_module


def test_maxtext_tilings_are_the_divisors_of_a_chips_tokens_it_is_given():
    memory = benchmark_module("memory")
    assert memory.maxtext_tilings("2,4,8,16", 4096.0) == [2, 4, 8, 16]
    assert memory.maxtext_tilings("", 4096.0) == []  # MaxText's defaults alone
    for bad in ("3", "1", "0", "-2", "8192", "x"):
        with pytest.raises(ConfigError, match=f"'{bad}'.*4096 tokens per chip"):
            memory.maxtext_tilings(f"2,{bad}", 4096.0)
    # The default is one MaxText compiles for memory.py's comparison (2 x 2048 tokens per chip).
    assert memory.maxtext_tilings(str(memory.MAXTEXT_TILING), 2 * 2048.0) == [
        memory.MAXTEXT_TILING]


@pytest.mark.parametrize("args, named", [
    (["--maxtext_tiling=4"], "--maxtext_tiling needs --maxtext"),
    (["--maxtext_set=remat_policy=full"], "--maxtext_set needs --maxtext"),
    (["--maxtext", "--maxtext_tiling=2,3"], "'3' is no num_vocab_tiling"),
    (["--maxtext", "--per_chip_batch=1", "--maxtext_tiling=4096"], "the 2048 tokens per chip"),
    (["--maxtext", "--maxtext_set=num_vocab_tiling=2"], "--maxtext_tiling=2"),
    (["--maxtext", "--maxtext_set=remat_policy"], "'remat_policy' is not KEY=VALUE"),
])
def test_a_bad_maxtext_option_is_one_error_line(args, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing written: the folder stays empty
    memory = benchmark_module("memory")
    with pytest.raises(SystemExit) as exit:
        memory.main(["memory.py", f"--config={REPO}/configs/llama3_8b.py", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert not os.listdir(tmp_path)
