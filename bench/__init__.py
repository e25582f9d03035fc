"""Developer tools that are not part of the package: ``python -m bench.mutation``.

The benchmarks live in :mod:`xcosd.bench` (``make bench`` runs
``python -m xcosd.bench.run_all``); their JSON goes to ``bench/out/``."""
