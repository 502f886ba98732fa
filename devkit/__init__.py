"""Development and test helpers: never imported by `kvstore`, `workers` or `kernels` at runtime.

Tests and benchmarks use it (a throwaway PKI, the policy simulator, the transformers oracle); it is
installed with the project (editable) only so that benchmark scripts run from any directory can import it.
"""
