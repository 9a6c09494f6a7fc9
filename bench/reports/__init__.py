"""BENCHMARKS.md and the PNG figures, rendered from the results JSON by ``python -m
bench.reports.report``; nothing here measures."""
