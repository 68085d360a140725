"""Benchmarks behind ``mcore-flash bench-attention | bench-recompute | bench-cp``.

Each module has a ``main(argv)``, prints progress to stderr and markdown tables to stdout;
results and the commands that produced them are in docs/benchmarks.md. Saved-for-backward
bytes come from :func:`mcore_flash.memory.measure_saved_bytes`.
"""
