"""CUDA kernels with torch references (issue: kernels). Not built yet: this package is empty on purpose,
it exists so the distribution layout (kvstore, workers, kernels) is fixed from the first release."""
