"""The megatron-core version table, from the JUnit XML files CI writes (one per job).

    python scripts/version_table.py ci-results/*.xml [--write docs/megatron-versions.md]

Each file is one ``pytest --junitxml`` run; ``tests/conftest.py`` records the Python, torch
and megatron-core versions in it. Prints the Markdown table; ``--write`` replaces the table
between the markers in the given file. Standard library only.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import xml.etree.ElementTree as ET

BEGIN, END = "<!-- version-table:begin -->", "<!-- version-table:end -->"
COLUMNS = (
    "job",
    "Python",
    "megatron-core",
    "torch",
    "tests",
    "passed",
    "failed",
    "errors",
    "skipped",
    "retried",
    "minutes",
)
# the property tests/conftest.py gives a test whose launch was retried after a lost rank
RETRIED = "retried after a lost rank"


def job_row(path: pathlib.Path) -> dict:
    """One job's versions and counts from its JUnit XML."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise SystemExit(f"{path}: no <testsuite> (pass files written by pytest --junitxml)")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    missing = [k for k in ("python", "torch", "megatron-core") if k not in props]
    if missing:
        raise SystemExit(
            f"{path}: no {', '.join(missing)} property (tests/conftest.py records them)"
        )
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {
        "job": path.stem,
        "Python": props["python"],
        "megatron-core": props["megatron-core"],
        "torch": props["torch"],
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "retried": sum(
            any(p.get("name") == RETRIED for p in case.iter("property"))
            for case in suite.iter("testcase")
        ),
        "minutes": f"{float(suite.get('time', 0)) / 60:.1f}",
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def write_between_markers(path: pathlib.Path, table: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: add the lines {BEGIN} and {END} where the table goes")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "results", nargs="+", type=pathlib.Path, help="JUnit XML files, one per CI job"
    )
    parser.add_argument(
        "--write", type=pathlib.Path, help="Markdown file whose marked table is replaced"
    )
    args = parser.parse_args(argv)
    table = markdown([job_row(path) for path in args.results])
    print(table)
    if args.write:
        write_between_markers(args.write, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
