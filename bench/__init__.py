"""ringtrain's benchmark suite: ``python -m bench [--quick]`` (see bench/README.md).

Every comparison runs both sides in one invocation, on one machine, with the same model and the
same per-rank batch, so the ratios mean something even on a noisy machine.  Results are JSON;
``BENCHMARKS.md`` and the PNG plots are rendered from that JSON by :mod:`bench.report`.
"""
