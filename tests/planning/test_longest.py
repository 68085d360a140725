"""``plan --longest``: the longest multiple of the step that the search fits, and the next
multiple tried does not fit."""

from __future__ import annotations

import json

import pytest

from mcore_flash.planning.cli import main
from mcore_flash.planning.longest import longest_sequence


@pytest.mark.parametrize(
    "fits_up_to,limit,expected",
    [
        (100_000, 1 << 24, (98_304, 106_496)),  # 12 x 8192 fits, 13 x 8192 does not
        (8_192, 1 << 24, (8_192, 16_384)),
        (5_000, 1 << 24, (0, 8_192)),  # not even one step
        (10**9, 65_536, (65_536, None)),  # the limit reached
    ],
)
def test_the_longest_multiple_of_the_step_that_fits(fits_up_to, limit, expected):
    tried = []

    def search(seq_length):
        return ["a layout"] if seq_length <= fits_up_to else []

    found = longest_sequence(search, 8192, limit, progress=lambda s, n: tried.append((s, n)))
    assert (found.seq_length, found.beyond) == expected
    assert all(s % 8192 == 0 and s <= limit for s, _ in tried)
    assert len(tried) <= 2 * 12  # doubling, then bisection: logarithmic in the answer


def _json(argv, capsys):
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_cli_longest_fits_and_one_step_more_does_not(capsys):
    """The answer, checked with --search at that length and one step beyond."""
    base = ["--model", "llama2-7b", "--num-devices", "1"]
    code, out, progress = _json([*base, "--longest"], capsys)
    assert code == 0 and out["seq_length"] % 8192 == 0 and out["beyond"] == out["seq_length"] + 8192
    longest = str(out["seq_length"])
    assert main([*base, "--search", "--seq-length", longest, "--top", "1"]) == 0
    assert main([*base, "--search", "--seq-length", str(out["beyond"])]) == 1
    assert out["layout"]["seq_length"] == out["seq_length"]
    assert "[plan --longest] 8,192 tokens: " in progress


def test_cli_longest_needs_the_devices(capsys):
    with pytest.raises(SystemExit) as error:
        main(["--longest", "--model", "llama2-7b"])
    assert error.value.code == 2 and "--longest needs --num-devices" in capsys.readouterr().err
