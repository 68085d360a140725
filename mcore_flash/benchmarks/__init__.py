"""Benchmarks behind the ``mcore-flash bench-*`` commands, one module each: ``bench-attention``
(:mod:`.attention`), ``bench-recompute`` (:mod:`.recompute`), ``bench-cp``
(:mod:`.context_parallel`), ``bench-convert`` (:mod:`.convert`), ``bench-packed``
(:mod:`.packed`), ``bench-window`` (:mod:`.window`), ``bench-generate`` (:mod:`.generate`)
and ``bench-cuda`` (:mod:`.cuda_kernels`);
what they share is in :mod:`.common`.

Each module has a ``main(argv)``, prints progress to stderr and its results to stdout (a
markdown table, or one JSON object where it takes ``--json``); results and the commands that
produced them are in docs/benchmarks.md. Saved-for-backward bytes come from
:func:`mcore_flash.measured_memory.measure_saved_bytes`.
"""
