"""kvstore: a multi-tier KV cache service for LLM serving. See kvstore/README.md for the layer map."""

__version__ = "0.1.0"
