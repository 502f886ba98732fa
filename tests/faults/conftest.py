"""Fault-suite fixtures. Smoke sizes run in CI (`./dev test`); `benchmarks/faults.py` runs the full sizes."""
