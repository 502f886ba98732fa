"""Redis prefix-hash index: the cluster view of which node holds which page in which tier (DESIGN §7).

Each node's own TierManager is authoritative for what that node holds; Redis holds a best-effort,
eventually consistent copy so any client can find the longest cached prefix across the cluster in one
round trip. A stale entry (a node no longer holds the page) costs the reader one miss, never an error.

## Key layout (all keys start with `kvs:v1:`; text so an SRE can read them with redis-cli)

    kvs:v1:b:{ns16}:{hash64}   HASH  node_id -> "{epoch}:{tier}"   one per (namespace, block hash)
    kvs:v1:alive:{node_id}     STRING epoch, with a TTL (the heartbeat)   a node is live iff it exists
    kvs:v1:epoch:{node_id}     STRING counter (INCR)                      the node's current epoch source
    kvs:v1:node:{node_id}      HASH  addr, epoch, version, pages_*, queued, resyncs, lag_ms, ...
    kvs:v1:nodes               SET   every node id ever registered (for kvctl nodes)

`ns16` is the first 8 bytes of SHA-256(namespace) in hex; `hash64` the block hash in hex (DESIGN §3).

## Epochs

An entry counts only while its node is live *and* the entry's epoch equals the node's current epoch
(the value of its alive key). A node takes a new epoch (INCR) whenever it (re)publishes its holdings
from scratch: at start, after Redis was unreachable, after its update queue overflowed, or when its
heartbeat finds its alive key gone. So a restart or a resync invalidates every old entry of the node
at once, without scanning Redis; the garbage left behind is removed by a slow background sweep.

## Lookups cost one round trip

`LOOKUP_SCRIPT` (Lua, run with EVALSHA) walks the chain in order and stops at the first block no live
node holds, returning the live holders of each matched block. It reads keys it is not given in KEYS
(the alive keys), so it needs a single Redis instance (or a Redis Cluster with hash tags, not done).

## Modules

    keys.py       the key layout above and the lookup script (shared by both sides)
    lookup.py     ClusterLookup: what a lookup found, and the fetch plan over it (pure)
    reader.py     IndexReader: the client side (lookups, node listing)
    publisher.py  IndexPublisher: the node side (heartbeat, batched updates, resyncs, GC)
    acl.py        the Redis ACL users: nodes write only their own records, clients only read (pure)

Trust: the index is not trusted with identities. A client dials each address as the node id the index
names and checks the node's TLS certificate (kvstore/client/cluster.py); only nodes can write (acl.py). The
lookup script is loaded by the nodes when they publish; read-only clients may only run it (EVALSHA).
"""

from kvstore.index.keys import ALIVE_PREFIX, NODES_KEY, PREFIX, alive_key, block_key, epoch_key, node_key, ns_tag
from kvstore.index.lookup import ClusterLookup, NodeShare, summarize
from kvstore.index.reader import IndexReader, IndexUnavailable, NodeInfo

__all__ = [
    "ALIVE_PREFIX",
    "NODES_KEY",
    "PREFIX",
    "ClusterLookup",
    "IndexReader",
    "IndexUnavailable",
    "NodeInfo",
    "NodeShare",
    "alive_key",
    "block_key",
    "epoch_key",
    "node_key",
    "ns_tag",
    "summarize",
]
