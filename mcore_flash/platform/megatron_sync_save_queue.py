"""All devices: a synchronous torch_dist save collects its write results in this process.

Answers ``dist_checkpointing/strategies/filesystem_async.py: _get_write_results_queue``
(megatron-core 0.16.1-0.19): the torch_dist writer hands its results over through a
``multiprocessing`` Manager queue, made on a process's first save by a *spawned* server
process: a new interpreter that imports the launching module (about 3 s of every launch's
first save on the CPU) and that outlives a rank killed by SIGKILL. A synchronous save
(``execute_sync``) writes with forked workers and collects their results in this process, so
an in-process ``queue.Queue`` serves it; a background save (``--async-save``) keeps
megatron's queue, which its forked writer reaches.
"""

from __future__ import annotations

import contextlib
import queue


@contextlib.contextmanager
def in_process_write_results():
    """Within the block, megatron's torch_dist writer puts its results in a ``queue.Queue``
    of this process (its module's ``_results_queue``); restored after it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as writer

    saved = writer._results_queue
    writer._results_queue = queue.Queue()
    try:
        yield
    finally:
        writer._results_queue = saved
