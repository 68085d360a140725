#!/usr/bin/env bash
# Creates .venv with the CPU build of torch 2.13.0, megatron-core and mcore-flash (editable).
# An unpinned torch would pull a multi-GB CUDA build; torch_npu is never installed here
# (it needs Ascend CANN: `pip install 'mcore-flash[npu]'` on an Ascend host).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[test]'
.venv/bin/python -c "import torch, megatron.core, mcore_flash; print('mcore-flash ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
