"""The model workers run: paged Llama against transformers, loader, paged-cache bookkeeping."""
