"""Benchmarks of sagejax: speed (TOPS), accuracy vs exact, memory.

Run ``python -m sagejax.bench --quick`` (or ``sagejax-bench``); see
:mod:`sagejax.bench.cli`. Modules: :mod:`~sagejax.bench.methods` (what is
compared, and the kernel-only hook of a backend), :mod:`~sagejax.bench.timing`,
:mod:`~sagejax.bench.speed`, :mod:`~sagejax.bench.accuracy`,
:mod:`~sagejax.bench.memory`, :mod:`~sagejax.bench.report`.
"""
