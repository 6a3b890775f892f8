"""Micro-benchmarks of the library's own pieces (drafter cost against context length).
Each exposes `run(...) -> dict` and `main(out_path, ...)` writing one JSON report."""
