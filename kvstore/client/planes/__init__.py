"""Each data plane's client side, as exchanges both clients drive (kvstore/client/exchange.py).

base.py      DataPlane: batching, chain parents and prefix stops, written once; a plane does one batch
choice.py    which plane a client uses (pure): same host -> shm, else ucx, tcp; gRPC streams last
streams.py   gRPC streams (always available: the fallback)
shm.py       the same-host plane (+ segments.py: scratch segments and registered SharedBuffers)
tcp.py       the bulk TCP plane: pooled connections, recv_into straight into place
ucx.py       the UCX plane: pooled endpoints, tagged messages straight into place
buffers.py   checks of caller buffers for get_into / put_from
"""
