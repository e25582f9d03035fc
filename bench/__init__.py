"""Benchmarks run by `make bench` (`python -m bench.run_all`); results in docs/RESULTS.md."""
