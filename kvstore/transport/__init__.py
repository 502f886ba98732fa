"""Data planes: how page bytes of Put and Get travel between a client and a node (DESIGN.md §8).

Control goes over gRPC (the UCX plane carries its own small control messages, to save a gRPC round trip
per call); bulk bytes go over the fastest plane both ends have, and gRPC streams
are the fallback that always works. Each plane has a client side (an `exchange.DataPlane`, driven by
both clients) and a node side (served beside the gRPC servicer).

    exchange.py      the operations client-side code yields, and the DataPlane interface
    grpc_streams.py  Put/Get as gRPC streams (client side; framing in kvstore/wire.py)
    shm/             same-host shared-memory segments: protocol, client side, node side
    tcp/             the bulk TCP plane for other hosts: frame format (__init__), client.py, node.py
                     (+ node_io.py: the node's non-blocking socket I/O, plain or TLS)
    serving.py       PlaneServer: a node-side listener the node starts and advertises (tcp, ucx)
    ucx/             UCX through ucxx (RDMA, shared memory or TCP, as UCX finds): protocol, client, node
"""
