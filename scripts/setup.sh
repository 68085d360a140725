#!/usr/bin/env bash
# Creates .venv with torch 2.13.0, megatron-core and mcore-flash (editable, with the test extras).
#
# Defaults: python3 (3.11 here: the CPU build of torch from local disk, megatron-core 0.16.1,
# the newest for 3.11). CI's second job reuses this script for Python 3.12 with the newest
# megatron-core (torch 2.13.0 then comes as the multi-GB CUDA build, which runs on the CPU):
#   PYTHON="env PYENV_VERSION=3.12.1 python3.12" VENV=~/.cache/mcore-flash-ci/py312 bash scripts/setup.sh
# A venv whose dependencies are already installed for the same pyproject.toml, Python and
# pins is reused: only mcore-flash itself is re-installed (editable, from this checkout).
# torch_npu is never installed here (it needs Ascend CANN: `pip install 'mcore-flash[npu]'`
# on an Ascend host).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
MEGATRON_CORE=${MEGATRON_CORE:-}  # e.g. "==0.19.2"; empty: the newest pyproject.toml allows
pip=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
stamp="$(sha256sum pyproject.toml | cut -c1-16) $($PYTHON --version 2>&1) torch==2.13.0 megatron-core$MEGATRON_CORE"
if [[ -f "$VENV/.mcore-flash-deps" && "$(cat "$VENV/.mcore-flash-deps")" == "$stamp" ]]; then
    echo "reusing $VENV (dependencies unchanged)"
    "${pip[@]}" --no-deps -e .
else
    $PYTHON -m venv "$VENV"
    "${pip[@]}" torch==2.13.0 "megatron-core$MEGATRON_CORE" -e '.[test]'
    echo "$stamp" > "$VENV/.mcore-flash-deps"
fi
"$VENV/bin/python" -c "import sys, torch, megatron.core, mcore_flash; print('mcore-flash ready: python', sys.version.split()[0], '| torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
