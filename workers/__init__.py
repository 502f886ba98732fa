"""Prefill and decode workers on Ray (issue: workers). Not built yet: this package is empty on purpose,
it exists so the distribution layout (kvstore, workers, kernels) is fixed from the first release."""
