"""Shared pytest fixtures."""

import sys

import pytest


@pytest.fixture
def npu_double(monkeypatch):
    """Install a fresh ``torch_npu`` of operator doubles (``mcore_flash.emulation.op_double``)
    and yield it. ``npu_double.calls`` records every op call; the module is removed afterwards."""
    from mcore_flash.emulation import op_double

    module = op_double()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    yield module
