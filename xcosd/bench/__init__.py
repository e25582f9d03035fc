"""Benchmarks behind ``xcosd bench``: ``load`` (many devices against one cloud) and
``methods`` (every resampling method and codec on real model rows). Each returns a
plain JSON-able report; :mod:`xcosd.bench.results` turns the saved reports into
``docs/RESULTS.md``."""
