"""The node side of the wire: the cache node's server, its data planes and what a request passes first.

    server.py       Node: the manager, the gRPC server, planes, index link; start / SIGTERM drain / spill
    servicer.py     the gRPC API (kvstore.v1.KVStore) on the caller's tenant view
    interceptor.py  auth before a request is read, the caller bound, exceptions -> status codes, timings
    limits.py       request limits: size before parsing, counts before lists
    callers.py      the one caller resolver: token, certificate tenant, tenant view, may-move
    drivers.py      the one put driver and one get driver every plane runs
    planes/         each data plane's node side (streams, shm, tcp, ucx) and the PlaneServer interface
    config.py       NodeConfig: one typed config from file, environment and flags (pure)
    tenancy.py      the tenants file: shares, and tenants bound to mTLS certificates
    metrics.py      OpenTelemetry meters and the Prometheus /metrics endpoint

Below it: kvstore/manager (pages and tiers), kvstore/index (the Redis index publisher). It never imports
kvstore/client; what both sides agree on lives in kvstore/wire.
"""
