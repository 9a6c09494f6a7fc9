"""ringtrain's benchmark suite: ``python -m bench [--quick]`` (see bench/README.md).

Every comparison runs both sides in one invocation, on one machine, with the same model and the
same per-rank batch, so the ratios mean something even on a noisy machine.  Results are JSON;
``BENCHMARKS.md`` and the PNG plots are rendered from that JSON by :mod:`bench.reports.report`.

Layout: :mod:`bench.parts` (what ``--only`` runs), :mod:`bench.workers` (the programs the parts
launch, one rank each), :mod:`bench.reports` (BENCHMARKS.md and the figures), :mod:`bench.common`
(what more than one of them imports).  No module here shares its name with one of ringtrain,
launch, torch_models or tf_models (``tests/test_bench.py`` checks it).
"""
