"""Each data plane's node side. A plane only moves bytes; the put and get drivers (kvstore/node/drivers.py)
run the transaction and the leases, and the caller resolver (kvstore/node/callers.py) says who asks.

    base.py      PlaneServer (a listener the node starts and advertises) and NodeServices
    streams.py   gRPC streams: a Put stream read as pages (the servicer's Put and Get use it)
    shm.py       the same-host plane: a Unix socket passing memfds; pages cross through client memory
    tcp.py       the bulk TCP plane's listener (+ tcp_io.py: non-blocking socket I/O, plain or TLS)
    ucx.py       the UCX plane's listener and worker (+ ucx_device.py: sending from device memory)
"""
