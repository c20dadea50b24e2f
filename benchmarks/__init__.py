"""pipework's benchmarks: each ``bench_*.py`` module compares against a baseline measured in
the same run. ``python -m benchmarks`` (``make bench``) runs them all."""
