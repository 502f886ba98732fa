"""Redis prefix-hash index: the cluster view of which node holds which page in which tier (DESIGN §7).

Each node's own TierManager is authoritative for what that node holds; Redis holds a best-effort,
eventually consistent copy so any client can find the longest cached prefix across the cluster in one
round trip. A stale entry (a node no longer holds the page) costs the reader one miss, never an error.
The index runs on one Redis, behind Redis Sentinel, or on a Redis Cluster (URL forms: connect.py).

## Key layout (all keys start with `kvs:v2:`; text so an SRE can read them with redis-cli)

    kvs:v2:b:{<ns16>.<ss>}        HASH  <h28> -> "node=epoch:tier[,node=epoch:tier...]"
                                  stripe ss (00..1f) of a namespace: the entries of its pages
    kvs:v2:t:<tenant>:b:{...}     the same, a tenant's (so ACL users can be let read one tenant's only)
    kvs:v2:{n}:alive:<node_id>    STRING epoch, with a TTL (the heartbeat)   a node is live iff it exists
    kvs:v2:{n}:beat:<node_id>     STRING "1", TTL 1 s, refreshed 4x a second  a live node without it is suspect
    kvs:v2:{n}:epoch:<node_id>    STRING counter (INCR)                      the node's epoch source
    kvs:v2:{n}:node:<node_id>     HASH  addr, epoch, version, pages_*, queued, resyncs, lag_ms, ...
    kvs:v2:{n}:nodes              SET   every node id ever registered

`ns16` is the first 8 bytes of SHA-256(namespace) in hex, `h28` the block hash's first 28 hex digits
(DESIGN §3; a collision costs a miss, never a wrong page), `ss` the block hash's first byte modulo 32.
The braces are Redis Cluster hash tags: a namespace's entries spread over 32 slots (so a hot namespace
over up to 32 masters), and every node record shares one slot (a node listing is one command).

An entry lists every holder of the page: several nodes may hold one page. Nodes change only their own
holder in an entry, through one Lua script per stripe (keys.UPDATE_SCRIPT: atomic, so two nodes writing
the same page never lose each other's holder).

Measured (benchmarks/RESULTS.md, "The Redis index"): against one HASH per page (the v1
layout, read by a Lua script), about half the Redis memory per indexed page and several times fewer
Redis CPU seconds per lookup of a long chain.

## Epochs

A holder counts only while its node is live *and* the holder's epoch equals the node's current epoch
(the value of its alive key). A node takes a new epoch (INCR) whenever it (re)publishes its holdings
from scratch: at start, after Redis was unreachable, after its update queue overflowed, when its
heartbeat finds its alive key gone, or when the master(s) changed (Sentinel or Cluster failover). So a
restart or a resync invalidates every old holder of the node at once, without scanning Redis; the
garbage left behind is removed by a slow background sweep (publisher.gc_step says when that is safe).

## Lookups cost one round trip

A lookup reads the chain's fields from its namespace's stripes: one HMGET per stripe the chain touches,
every request written before any reply is read (to one Redis, or to each master of a Redis Cluster that
holds one of them). No Lua on the read path: the reader filters holders by the nodes' current epochs,
which it reads with the node set (one round trip) at most every 0.5 s. On a Redis Cluster, a master
that fails over or a slot that moves during a lookup makes it a miss from the first block it holds,
never an error (reader.py).

## Modules

    keys.py       the key layout above, the entry format, the scripts that change entries (pure)
    lookup.py     ClusterLookup: what a lookup found, and the fetch plan over it (pure)
    connect.py    the one place a URL (one Redis, Sentinel, Redis Cluster) becomes a client
    reader.py     IndexReader: the client side (lookups, node listing)
    publisher.py  IndexPublisher: the node side (heartbeat, batched updates, resyncs, GC)
    acl.py        the Redis ACL users: nodes write only their own records, clients only read (pure)

Trust: the index is not trusted with identities. A client dials each address as the node id the index
names and checks the node's TLS certificate (kvstore/client/cluster.py); only nodes can write (acl.py),
and a client runs no Lua at all.
"""

from kvstore.index.keys import (
    ALIVE_PREFIX,
    NODES_KEY,
    PREFIX,
    STRIPES,
    alive_key,
    entry_of,
    epoch_key,
    holder,
    node_key,
    ns_tag,
    stripe_key,
)
from kvstore.index.lookup import ClusterLookup, NodeShare, from_entries, summarize
from kvstore.index.reader import IndexFailure, IndexReader, IndexUnavailable, NodeInfo

__all__ = [
    "ALIVE_PREFIX",
    "NODES_KEY",
    "PREFIX",
    "STRIPES",
    "ClusterLookup",
    "IndexFailure",
    "IndexReader",
    "IndexUnavailable",
    "NodeInfo",
    "NodeShare",
    "alive_key",
    "entry_of",
    "epoch_key",
    "from_entries",
    "holder",
    "node_key",
    "ns_tag",
    "stripe_key",
    "summarize",
]
