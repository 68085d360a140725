"""The ``mcore-flash`` command line's edges: what every subcommand prints before it does anything."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from mcore_flash import quiet_imports

from _support.hf_models import make_hf_llama

COMMANDS = ["convert", "generate", "pretrain", "evaluate", "plan"]


def _cli(*argv, python_flags=()):
    """``mcore-flash ARGV`` in a fresh process, without the caller's PYTHONWARNINGS."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run(
        [sys.executable, *python_flags, "-m", "mcore_flash.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


def _help(command, *python_flags):
    return _cli(command, "--help", python_flags=python_flags)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_prints_nothing_on_stderr(command):
    """megatron-core's import-time warnings (Transformer Engine / apex missing) and, with torch's
    CUDA build, the import-time log record of torch's cpp_extension (no CUDA runtime) are
    silenced: ``--help`` prints its usage and nothing on stderr."""
    run = _help(command)
    assert run.returncode == 0 and "usage:" in run.stdout
    assert run.stderr == ""


_HEAVY_IMPORTS = """
import sys
from mcore_flash.pretrain import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "megatron"})
print("exit", code, "heavy", ",".join(heavy) or "none", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["--tensor-model-parallel-size", "0"], 2),  # a flag error
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"], 2),  # a deep check
    ],
)
def test_pretrain_help_and_flag_errors_import_neither_torch_nor_megatron(argv, code):
    """The flags are parsed and checked in pure Python: ``--help`` and a refused flag load
    neither torch nor megatron-core (``sys.modules`` after ``main`` returns)."""
    result = subprocess.run(
        [sys.executable, "-c", _HEAVY_IMPORTS, *argv], capture_output=True, text=True, timeout=120
    )
    assert result.stderr.splitlines()[-1] == f"exit {code} heavy none", result.stderr


def test_the_users_warning_options_win():
    """With ``-W default`` (the user's choice) silence() steps aside: the same ``--help`` shows
    megatron's warnings, so the test above sees a real silencing, not a quiet import."""
    run = _help("generate", "-W", "default")
    assert run.returncode == 0
    assert "Transformer Engine and Apex are not installed" in run.stderr


def test_silence_filters_only_the_listed_warnings_of_their_module():
    """The exact message from its own module is dropped; the same message from another module
    and any other warning of that module still print (no blanket ignore)."""
    message = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."

    def shown(text, module, category=UserWarning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            quiet_imports.silence()
            warnings.warn_explicit(text, category, f"/{module}.py", 1, module=module)
        return len(caught)

    saved = sys.warnoptions[:]
    sys.warnoptions.clear()
    try:
        assert shown(message, "megatron.core.optimizer") == 0
        assert shown(message, "megatron.core.optimizer.distrib_optimizer") == 1
        assert shown(message, "mcore_flash.training.loop") == 1
        assert shown(message + " (and more)", "megatron.core.optimizer") == 1
        assert shown("another UserWarning", "megatron.core.optimizer") == 1
        assert shown(message, "megatron.core.optimizer", DeprecationWarning) == 1
    finally:
        sys.warnoptions[:] = saved


def test_silence_drops_only_the_listed_log_records_of_their_logger():
    """A listed log record (its level, its whole message, its logger) is dropped; any other record
    of that logger, the same message at another level or on another logger still print; and
    with the user's warning options (``-W``) silence() adds no log filter either."""
    no_cuda = "No CUDA runtime is found, using CUDA_HOME='%s'"
    gpt_deprecated = (
        "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features. "
        "Please reference the migration guide `docs/user-guide/hybrid-model-migration.md` for "
        "details on how to use `HybridModel`"
    )
    cuda, gpt = "torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model"
    loggers = {name: logging.getLogger(name) for name in (cuda, gpt, "torch.utils")}
    saved = {name: logger.filters[:] for name, logger in loggers.items()}
    # what the loggers had before any silence() in this process (a test may have called one)
    bare = {
        name: [f for f in filters if not isinstance(f, quiet_imports._DropRecord)]
        for name, filters in saved.items()
    }
    saved_options = sys.warnoptions[:]

    def shown(name, level, message, *args, warnoptions=()):
        """How many records ``message % args`` at ``level`` on logger ``name`` makes, after
        silence() on loggers without its filters (with ``warnoptions`` as the user's -W)."""
        for other, filters in bare.items():
            loggers[other].filters[:] = filters
        sys.warnoptions[:] = warnoptions
        quiet_imports.silence()
        logger, kept = loggers[name], []
        handler = logging.Handler()
        handler.emit = kept.append
        state = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        try:
            logger.log(level, message, *args)
        finally:
            logger.removeHandler(handler)
            logger.level, logger.propagate = state
        return len(kept)

    try:
        assert shown(cuda, logging.WARNING, no_cuda, "/usr/local") == 0
        assert shown(cuda, logging.WARNING, no_cuda, "/opt/cuda-13.0") == 0
        assert shown(cuda, logging.WARNING, no_cuda + " (and more)", "/usr/local") == 1
        assert shown(cuda, logging.WARNING, "CUDA_HOME: " + no_cuda, "/usr/local") == 1
        assert shown(cuda, logging.WARNING, "another cpp_extension warning") == 1
        assert shown(cuda, logging.ERROR, no_cuda, "/usr/local") == 1
        assert shown("torch.utils", logging.WARNING, no_cuda, "/usr/local") == 1
        assert shown(gpt, logging.WARNING, gpt_deprecated) == 0
        assert shown(gpt, logging.WARNING, "another GPTModel warning") == 1
        assert shown(cuda, logging.WARNING, no_cuda, "/usr/local", warnoptions=["default"]) == 1
        assert shown(gpt, logging.WARNING, gpt_deprecated, warnoptions=["default"]) == 1
    finally:
        for name, filters in saved.items():
            loggers[name].filters[:] = filters
        sys.warnoptions[:] = saved_options


def test_a_conversion_and_generate_print_nothing_on_stderr(tmp_path):
    """The warnings and log records that come later (megatron's own cuda_graph_scope /
    cuda_graph_modules default and its GPTModel deprecation, torch on megatron's use of its
    checkpoint API when a checkpoint loads, megatron on its load_common reading the converter's
    common.pt) are silenced too: a conversion, its export and a generate from it print nothing
    on stderr."""
    src = make_hf_llama(tmp_path / "hf")
    runs = [
        _cli("convert", "hf-to-mcore", "--hf-dir", src, "--save", tmp_path / "mc"),
        _cli("convert", "mcore-to-hf", "--load", tmp_path / "mc", "--save-hf", tmp_path / "out"),
        _cli("generate", "--load", tmp_path / "mc", "--prompt-ids", "1,2,3", "--max-new-tokens", 2),
    ]
    assert [(run.returncode, run.stderr) for run in runs] == [(0, "")] * 3


@pytest.mark.parametrize(
    "module",
    ["mcore_flash.runtime.arguments", "mcore_flash.generate", "mcore_flash.evaluation.cli"],
)
def test_help_shows_each_default_once(module):
    """A flag whose help names its default does not get argparse's "(default: ...)" again, and
    no flag shows a default of None or False (the preset, the device or a switch decides)."""
    import importlib
    import re

    text = importlib.import_module(module).build_parser().format_help()
    flags = re.split(r"\n  (?=-)", text)
    assert len(flags) > 20
    for flag in flags:
        assert len(re.findall(r"\(default", flag)) <= 1, flag
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 10)" in text  # a default the help does not name still shows (the timeout)


def test_version_names_the_package_and_what_it_runs_on():
    """``mcore-flash --version``: this package's version and those of Python, torch and
    megatron-core as installed (their metadata, nothing imported)."""
    from importlib.metadata import version

    import mcore_flash

    run = _cli("--version")
    assert run.returncode == 0 and not run.stderr, run.stderr
    assert run.stdout.startswith(
        f"mcore-flash {mcore_flash.__version__} (python {sys.version.split()[0]}, "
    )
    assert f"torch {version('torch')}" in run.stdout
    assert f"megatron-core {version('megatron-core')}" in run.stdout
