"""Redis key layout of the index (see kvstore/index/__init__.py), the holder-list format of an entry and
the scripts that change entries (pure: strings only, no Redis)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from kvstore.scoping import DEFAULT_TENANT, tenant_of

PREFIX = "kvs:v2:"
# Node records share one Redis Cluster hash tag, so a node listing or a refresh of who is alive is one
# command on one server, wherever the block entries live.
NODE_TAG = "{n}"
NODES_KEY = f"{PREFIX}{NODE_TAG}:nodes"
ALIVE_PREFIX = f"{PREFIX}{NODE_TAG}:alive:"
BEAT_PREFIX = f"{PREFIX}{NODE_TAG}:beat:"
# A node refreshes its beat key every BEAT_S with a TTL of BEAT_TTL_MS: a node that stops answering (hung,
# SIGSTOPped, its loop stuck) loses it within about a second, long before its alive key (index TTL) expires,
# and readers treat it as suspect: read from only when no other holder is (kvstore/index/reader.py).
BEAT_S = 0.25
BEAT_TTL_MS = 1000

# NOTE: a namespace's entries are spread over STRIPES hashes, each its own hash tag (so its own cluster
# slot): a hot namespace spreads over up to STRIPES masters, and a lookup of a chain reads at most
# STRIPES hashes (one HMGET each, all sent before any reply is read). A page's stripe is its hash's
# first byte modulo STRIPES: the chain hash is uniform, and a node knows a page's hash and namespace,
# never its place in a chain, so nothing else could be shared by writer and reader. 32: a 280-block
# lookup is 32 commands (16 and 64 stripes cost the same Redis CPU within this VM's noise, in a scratch
# run), and a stripe of a namespace of P pages holds P/32 entries.
STRIPES = 32
# An entry's field: the block hash's first 28 hex digits (112 bits). A collision costs a miss (the node
# is asked by the full hash and says no), never a wrong page; 28 digits keep a field in a 32-byte
# allocation (Redis' sds header + 28 + NUL).
FIELD_HEX = 28
MAX_NODE_ID = 200

STRIPE_KEYS_GLOB = f"{PREFIX}[bt]:*"  # every stripe, of every tenant (the nodes' garbage collection)

# KEYS[1]: a stripe. ARGV: node id, epoch, then (field, tier) pairs; tier "" removes the node's entry.
# Replaces the node's own entry of each field (whatever its epoch) and keeps every other node's: a field
# with no entry left is deleted. Atomic per stripe, so nodes writing the same page never lose each
# other's entries. Returns how many fields it changed.
UPDATE_SCRIPT = """
local key, mine = KEYS[1], ARGV[1] .. '='
local n = #mine
local own = mine .. ARGV[2] .. ':'
local changed = 0
for i = 3, #ARGV, 2 do
  local f, tier = ARGV[i], ARGV[i + 1]
  local cur = redis.call('HGET', key, f)
  local kept = {}
  if cur then
    for e in string.gmatch(cur, '[^,]+') do
      if string.sub(e, 1, n) ~= mine then kept[#kept + 1] = e end
    end
  end
  if tier ~= '' then kept[#kept + 1] = own .. tier end
  if #kept > 0 then
    local value = table.concat(kept, ',')
    if value ~= cur then
      redis.call('HSET', key, f, value)
      changed = changed + 1
    end
  elseif cur then
    redis.call('HDEL', key, f)
    changed = changed + 1
  end
end
return changed
"""

# KEYS[1]: a stripe. ARGV: k, then k (node id, bound) pairs, then fields. Drops every entry of a listed
# node whose epoch is below its bound (kvstore/index/publisher.py says which bounds are safe); a field
# with no entry left is deleted. Returns how many entries it dropped.
PRUNE_SCRIPT = """
local key, k = KEYS[1], tonumber(ARGV[1])
local bound = {}
for i = 2, 2 * k, 2 do bound[ARGV[i]] = tonumber(ARGV[i + 1]) end
local dropped = 0
for i = 2 * k + 2, #ARGV do
  local f = ARGV[i]
  local cur = redis.call('HGET', key, f)
  if cur then
    local kept, all = {}, 0
    for e in string.gmatch(cur, '[^,]+') do
      all = all + 1
      local node, ep = string.match(e, '^(.*)=(%d+):')
      local b = node and bound[node]
      if b and tonumber(ep) < b then dropped = dropped + 1 else kept[#kept + 1] = e end
    end
    if #kept == 0 then
      redis.call('HDEL', key, f)
    elseif #kept < all then
      redis.call('HSET', key, f, table.concat(kept, ','))
    end
  end
end
return dropped
"""


def ns_tag(namespace: str) -> str:
    """16 hex digits naming a namespace inside Redis keys."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


def stripe_of(h: bytes) -> int:
    return h[0] % STRIPES


def stripe_key(namespace: str, stripe: int) -> str:
    """One of a namespace's STRIPES hashes. A tenant's (a scoped namespace, kvstore/scoping.py) live under
    the tenant's own prefix, so a Redis user can be let read one tenant's entries only (index/acl.py); the
    default tenant's keys are those of a node without tenancy. The braces are the Redis Cluster hash tag:
    each stripe is a slot of its own."""
    tenant = tenant_of(namespace)
    base = PREFIX if tenant == DEFAULT_TENANT else tenant_prefix(tenant)
    return f"{base}b:{{{ns_tag(namespace)}.{stripe:02x}}}"


def entry_field(h: bytes) -> str:
    return h[: FIELD_HEX // 2].hex()


def entry_of(namespace: str, h: bytes) -> tuple[str, str]:
    """(stripe key, field) of a page's entry."""
    return stripe_key(namespace, stripe_of(h)), entry_field(h)


def tenant_prefix(tenant: str) -> str:
    """Where a (non-default) tenant's stripes live."""
    return f"{PREFIX}t:{tenant}:"


def alive_key(node_id: str) -> str:
    return ALIVE_PREFIX + node_id


def beat_key(node_id: str) -> str:
    return BEAT_PREFIX + node_id


def node_key(node_id: str) -> str:
    return f"{PREFIX}{NODE_TAG}:node:{node_id}"


def epoch_key(node_id: str) -> str:
    return f"{PREFIX}{NODE_TAG}:epoch:{node_id}"


# -- an entry's value: the holders of one page, "node=epoch:tier[,node=epoch:tier...]"


def holder(node_id: str, epoch: int, tier: int) -> str:
    """One holder as an entry lists it (what UPDATE_SCRIPT writes)."""
    return f"{node_id}={epoch}:{tier}"


def holders_of(value: bytes | str) -> Iterator[tuple[str, int, int]]:
    """(node id, epoch, tier) of each well-formed holder in an entry's value; malformed ones are skipped
    (a value is written by nodes, which the index does not trust: a bad one costs a miss, not an error)."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    for item in text.split(","):
        node, eq, rest = item.rpartition("=")
        epoch, colon, tier = rest.partition(":")
        if eq and colon and node and epoch.isdigit() and tier.isdigit():
            yield node, int(epoch), int(tier)


def check_node_id(node_id: str) -> str:
    """`node_id` if an entry can list it (1-200 printable characters, none of `,` `=` or whitespace);
    ValueError naming node_id otherwise."""
    if (
        not node_id
        or len(node_id) > MAX_NODE_ID
        or any(c in ",=" or c.isspace() or not c.isprintable() for c in node_id)
    ):
        raise ValueError(
            f"node_id: {node_id!r} cannot be published to the index (1-{MAX_NODE_ID} printable characters, "
            "no ',', '=' or whitespace)"
        )
    return node_id
