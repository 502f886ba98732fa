"""Redis key layout of the index (see kvstore/index/__init__.py) and the one-round-trip lookup script."""

from __future__ import annotations

import hashlib

from kvstore.scoping import DEFAULT_TENANT, tenant_of

PREFIX = "kvs:v1:"
NODES_KEY = PREFIX + "nodes"
ALIVE_PREFIX = PREFIX + "alive:"

LOOKUP_SCRIPT = """
local alive_prefix = ARGV[1]
local epochs = {}
local out = {}
for i = 1, #KEYS do
  local fields = redis.call('HGETALL', KEYS[i])
  local holders = {}
  for j = 1, #fields, 2 do
    local node = fields[j]
    local ep = epochs[node]
    if ep == nil then
      ep = redis.call('GET', alive_prefix .. node) or false
      epochs[node] = ep
    end
    if ep then
      local sep = string.find(fields[j + 1], ':', 1, true)
      if sep and string.sub(fields[j + 1], 1, sep - 1) == ep then
        holders[#holders + 1] = node
        holders[#holders + 1] = string.sub(fields[j + 1], sep + 1)
      end
    end
  end
  if #holders == 0 then break end
  out[#out + 1] = holders
end
return out
"""


def ns_tag(namespace: str) -> str:
    """16 hex digits naming a namespace inside Redis keys."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


def block_key(namespace: str, h: bytes) -> str:
    """The entry of a page. A tenant's pages (a scoped namespace, kvstore/scoping.py) live under the
    tenant's own prefix, so a Redis user can be let read one tenant's entries only (index/acl.py); the
    default tenant's keys are those of a node without tenancy."""
    tenant = tenant_of(namespace)
    if tenant == DEFAULT_TENANT:
        return f"{PREFIX}b:{ns_tag(namespace)}:{h.hex()}"
    return f"{tenant_prefix(tenant)}b:{ns_tag(namespace)}:{h.hex()}"


def tenant_prefix(tenant: str) -> str:
    """Where a (non-default) tenant's block entries live."""
    return f"{PREFIX}t:{tenant}:"


BLOCK_KEYS_GLOB = f"{PREFIX}[bt]:*"  # every block entry, of every tenant (the node's garbage collection)


def alive_key(node_id: str) -> str:
    return ALIVE_PREFIX + node_id


def node_key(node_id: str) -> str:
    return f"{PREFIX}node:{node_id}"


def epoch_key(node_id: str) -> str:
    return f"{PREFIX}epoch:{node_id}"
