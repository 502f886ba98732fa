"""CUDA-only tests: skipped with a reason where CUDA or CuPy is absent."""
