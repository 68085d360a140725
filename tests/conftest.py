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


@pytest.fixture(scope="session", autouse=True)
def _record_versions(record_testsuite_property):
    """Python, torch and megatron-core versions into the JUnit XML (``--junitxml``), which
    ``scripts/version_table.py`` turns into docs/megatron-versions.md."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    record_testsuite_property("python", platform.python_version())
    for package in ("torch", "megatron-core"):
        try:
            record_testsuite_property(package, version(package))
        except PackageNotFoundError:  # a GPU machine running only tests/ops/test_cuda_backend.py
            record_testsuite_property(package, "absent")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A launch retried after a lost rank (``_support.dist_utils.retried_after_a_lost_rank``)
    in any phase of a test (a fixture's too) becomes a property of that test in the JUnit XML,
    which junitxml writes from the item's properties at its teardown and
    ``scripts/version_table.py`` counts; the retry's warning is in pytest's summary."""
    yield
    launcher = sys.modules.get("_support.dist_utils")  # loaded by the tests that launch ranks
    if launcher is not None:
        item.user_properties += [("retried after a lost rank", text) for text in launcher.RETRIES]
        launcher.RETRIES.clear()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: minutes long; CI runs it in the Python 3.11 job only (the megatron calls it makes run on "
        "the newest megatron-core in faster tests; docs/megatron-versions.md)",
    )
    config.addinivalue_line(
        "markers",
        "planner: the pure-Python planner alone (every test under tests/planning/, and the searches of "
        "others), which calls neither torch nor megatron-core: CI runs it in the Python 3.11 job only",
    )


def pytest_collection_modifyitems(config, items):
    """Every test under ``tests/planning/`` is marked ``planner``."""
    for item in items:
        if "planning" in item.path.parts[-2:-1]:
            item.add_marker(pytest.mark.planner)
