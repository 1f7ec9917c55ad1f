#!/usr/bin/env bash
# A Python 3.12 venv that runs both MaxText 0.2.5 and this repo with the same jax and libtpu, for
# benchmarks/memory.py --maxtext (MaxText's train_compile next to jaxscale's compiled step).
#
#   benchmarks/maxtext/setup.sh /tmp/maxtext-venv
#   /tmp/maxtext-venv/bin/python benchmarks/memory.py --maxtext
#
# Installs maxtext[tpu]==0.2.5 with jax[tpu]==$JAX_VERSION (default 0.12.0.1: the newest jax that
# both maxtext 0.2.5's tpu extra (jax>=0.11.1, libtpu>=0.0.46) and jaxscale (jax<0.13) admit;
# jax[tpu] pins the libtpu made for it, 0.0.50.* for 0.12.0.1), then this repo, editable, into
# the same venv. MaxText is run from the installed package; none of its code is copied here.
# Idempotent: a second run reuses the venv and pip finds everything installed. Prints the
# versions it ended with. $PYTHON312 is the interpreter the venv is made from (default:
# python3.12 if it runs, else pyenv's 3.12.1). The venv takes ~3 GB (~235 packages:
# transformers, datasets, google-cloud clients, ...): keep it out of the repo, which the script
# refuses.
set -euo pipefail

if [[ $# -ne 1 || "$1" == -* ]]; then
  echo "usage: $0 VENV_DIR   (e.g. /tmp/maxtext-venv)" >&2
  exit 2
fi
venv=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
jax_version=${JAX_VERSION:-0.12.0.1}
maxtext_version=0.2.5

case "$(cd "$(dirname "$venv")" 2>/dev/null && pwd)/" in
  "$repo"/*) echo "error: put the venv outside the repo ($repo), e.g. /tmp/maxtext-venv" >&2
             exit 2 ;;
esac

python312=${PYTHON312:-}
if [[ -z "$python312" ]]; then
  if python3.12 -c '' 2>/dev/null; then python312=$(command -v python3.12)
  elif [[ -x /root/.pyenv/versions/3.12.1/bin/python ]]; then
    python312=/root/.pyenv/versions/3.12.1/bin/python
  else
    echo "error: no Python 3.12 found (maxtext $maxtext_version needs >= 3.12); set PYTHON312" >&2
    exit 2
  fi
fi

if [[ ! -x "$venv/bin/python" ]]; then
  "$python312" -m venv "$venv"
fi
"$venv/bin/python" -c 'import sys; assert sys.version_info[:2] >= (3, 12), sys.version' || {
  echo "error: $venv is not a Python >= 3.12 venv; remove it or pick another path" >&2; exit 2; }

pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
# One resolve, so MaxText's requirements and the pinned jax agree.
"${pip[@]}" install "maxtext[tpu]==$maxtext_version" "jax[tpu]==$jax_version"
# This repo, without letting it move jax: its range (jax<0.13) admits the version above.
"${pip[@]}" install -e "$repo" "jax[tpu]==$jax_version"

"$venv/bin/python" - <<'PY'
from importlib.metadata import version, PackageNotFoundError
for name in ("jax", "jaxlib", "libtpu", "maxtext", "flax", "jaxscale"):
    try:
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        print(f"{name} not installed")
PY
