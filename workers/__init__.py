"""Prefill and decode workers (DESIGN.md §1, §9): a paged Llama, its checkpoint loader, and Ray on top.

Model side (no Ray, no cache service; runs on CPU or CUDA):

    paged_cache.py  BlockAllocator / BlockManager (pure bookkeeping: free list, per-sequence block
                    tables) and PagedKVCache (per-layer K/V tensors [num_blocks, block_size, kv_heads,
                    head_dim]; pages [n, layers, 2, block_size, kv_heads, head_dim] in and out)
    model.py        ModelConfig, PagedLlama: prefill (chunked, after imported pages), batched decode,
                    export_pages / import_pages, greedy_generate; attention through `kernels`
    loader.py       Hugging Face checkpoint directory (config.json + safetensors, sharded or not) -> PagedLlama
    tokenizer.py    tokenizer.json -> TextTokenizer (None when absent: callers use token ids)
    testing.py      tiny random checkpoints and the transformers oracle, for tests and demos

    page_codec.py   PageCodec: the model's pages <-> stored page bytes in the deployment's encoding
                    (raw: a byte view; fp8-e4m3: kernels.quantize_fp8 / dequantize_fp8 in place)

The Ray layer (serving engines, actors, router, runtime) builds on that API. Imports point downward:
the model side imports `kernels` and `kvstore.layout` only, never the Ray layer.
"""
