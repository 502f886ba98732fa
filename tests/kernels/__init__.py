"""Kernel references on CPU (always run): against naive oracles, plus input checks and launch planning."""
