"""Shared pytest fixtures."""

import sys

import pytest


@pytest.fixture
def npu_double(monkeypatch):
    """Install a fresh pure-PyTorch ``torch_npu`` double (tests/npu_double.py) and yield it.

    ``npu_double.calls`` records every op call; the module is removed again afterwards.
    """
    import npu_double as double_mod

    module = double_mod.make_module()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    yield module

