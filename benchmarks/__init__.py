"""Benchmarks: one module per experiment, each runnable as `python -m benchmarks.NAME`."""
