"""Replication by heat (DESIGN.md §7.3): the node-to-node copier, above both the node and the clients.

A node knows which of its pages are read (kvstore/node/heat.py, fed by the one get driver); this package makes
the copies those reads ask for, on other nodes, and takes the copies others ask it to take:

- `service.Replicator` is a `NodeService` (kvstore/node/server.py) that `kvstore serve` attaches to a node with
  an index and replication on. Every `replication_interval_seconds` it looks at the pages whose heat (or whose
  Put's replicas=k) asks for more copies than they have live, non-suspect holders in the index; for each page
  one holder acts (the leader: a rendezvous hash of page and holder; another holder acts when the deficit
  outlives LAGGARD_ROUNDS, so a leader that sees no heat cannot leave a page short), picks destinations by free
  room and load (kvstore/index/choose.py `copy_targets`, seeded by the page: holders deciding together pick
  alike) and sends each a Replicate.
- a Replicate (from another node, or from a client of this host asking for copies of what it reads remotely)
  is answered by `Replicator.take_copies`: the node pulls the pages from the source over a data plane (the
  fastest both have; gRPC streams when the copy is a tenant's, whose name rides in the call's metadata), each
  verified on arrival by the client that receives it (DESIGN.md §8.3: a damaged page ends the copy there, is
  reported to the source, which drops a bad copy, and is counted here), and stores them through the node's one
  put driver in the tenant's scope: ordinary pages with the same checksums, counted against the tenant's share.
  A copy takes only free room: pages past what leaves `replication_free_reserve` of the node's slots free (or
  past the tenant's share) are refused, never evicting anything for a copy.
- SIGTERM (`handoff`): before the node drains, its hot pages that no other node holds are handed to others,
  hottest first, until `handoff_seconds`.

Nothing here stops the world: every round is bounded (ROUND_PAGES pages, COPY_BATCH pages per request,
CONCURRENCY requests in flight, `replication_bytes_per_second`), and cold pages keep their one copy.

Credentials: nodes call each other with a peer token (`auth_peer_tokens_file`, Role.PEER, kvstore/security.py)
where tokens are on; a peer names the tenant it acts for, so a copy lands in the same tenant's scope and no
other. Without tokens there are no tenants but the default one (or mTLS-bound ones, whose pages are not copied:
a node cannot act for them).
"""

from kvstore.replication.service import Replicator, peer_security

__all__ = ["Replicator", "peer_security"]
