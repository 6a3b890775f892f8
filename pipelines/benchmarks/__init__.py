"""Benchmarks behind `python -m jobs.benchmark`: collection, training, quality, ablations."""
