"""scripts/version_table.py: the megatron-core version table from pytest's JUnit XML.

A real ``pytest --junitxml`` run (with this suite's conftest, which records the versions)
on a file of 3 passing (one of them retried after a lost rank), 1 failing and 1 skipped test
is turned into the table.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "version_table.py"

SAMPLE = f"""
import sys

import pytest

sys.path.insert(0, {str(ROOT / "tests")!r})
from _support.dist_utils import LaunchFailed, RankFate, retried_after_a_lost_rank

def test_a(): pass
def test_b(): pass
def test_c(): assert False
@pytest.mark.skip(reason="sample")
def test_d(): pass

def test_e(tmp_path):  # a launch that lost rank 1 to SIGKILL, then passed
    def launch(root):
        if root.endswith("retry"):
            return "passed"
        peer = RankFate(0, "raised", error="RuntimeError: [pair.cc:534] Connection closed by peer")
        raise LaunchFailed("w", [peer, RankFate(1, "exited", exitcode=-9)], [1])

    assert retried_after_a_lost_rank(launch, str(tmp_path))[0] == "passed"
"""


@pytest.fixture(scope="module")
def junit(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    shutil.copy(ROOT / "tests" / "conftest.py", root / "conftest.py")
    (root / "test_sample.py").write_text(SAMPLE)
    xml = root / "py3x.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(root),
            f"--junitxml={xml}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # test_c fails
    return xml


def _table(*argv):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=60
    )


def test_table_row_has_versions_and_counts(junit):
    run = _table(junit)
    assert run.returncode == 0, run.stderr
    header, rule, row = run.stdout.strip().splitlines()
    cells = dict(
        zip(
            [c.strip() for c in header.strip("|").split("|")],
            [c.strip() for c in row.strip("|").split("|")],
        )
    )
    python = ".".join(map(str, sys.version_info[:3]))
    assert cells == {
        "job": "py3x",
        "Python": python,
        "megatron-core": version("megatron-core"),
        "torch": version("torch"),
        "tests": "5",
        "passed": "3",
        "failed": "1",
        "errors": "0",
        "skipped": "1",
        "retried": "1",
        "minutes": cells["minutes"],
    }


def test_write_replaces_only_the_marked_table(junit, tmp_path):
    doc = tmp_path / "versions.md"
    doc.write_text(
        "intro\n<!-- version-table:begin -->\nold table\n<!-- version-table:end -->\noutro\n"
    )
    assert _table(junit, "--write", doc).returncode == 0
    text = doc.read_text()
    assert text.startswith("intro\n<!-- version-table:begin -->\n| job |") and text.endswith(
        "<!-- version-table:end -->\noutro\n"
    )
    assert "old table" not in text and "| py3x |" in text


def test_bad_inputs_name_the_fix(junit, tmp_path):
    unmarked = tmp_path / "plain.md"
    unmarked.write_text("no markers\n")
    run = _table(junit, "--write", unmarked)
    assert run.returncode != 0 and "<!-- version-table:begin -->" in run.stderr
    bare = tmp_path / "bare.xml"
    bare.write_text('<testsuites><testsuite name="pytest" tests="0"></testsuite></testsuites>')
    run = _table(bare)
    assert run.returncode != 0 and "conftest.py records them" in run.stderr
