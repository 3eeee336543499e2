"""The benchmarks, one module a study: run each from the repository's root as ``python -m benchmarks.<name>``
(benchmarks/README.md)."""
