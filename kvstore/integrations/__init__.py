"""kvstore as a tier of other caching systems (engine-side adapters built on the public client API).

- `lmcache.py`: an LMCache remote storage plugin (vLLM's LMCacheConnectorV1 and SGLang reach kvstore
  through it). Imports LMCache; install with `./dev test` or the `lmcache` extra (see the README).
- `lmcache_mapping.py`: how LMCache keys and chunks map onto namespaces, layouts and 32-byte keys (pure).
- `lmcache_l2_mapping.py`: the same for LMCache's multiprocess server (mapping l2v1), and the L2 adapter's
  settings (pure).
- `remote.py`: one node or a Redis-indexed cluster behind one small blocking interface, with the
  error policy an engine needs (a failure is a logged miss, never an exception into the engine).
- `health.py`: outage tracking and log rate limiting (pure, clock injected).
- `outcome.py`: which pages of a store the node kept, the one rule every door reports to its engine by (pure).

Nothing else in `kvstore` imports this package. It stands on the public client API only (the clients,
their errors, layouts, security and wire types) and never reaches into the node's internals.
"""
