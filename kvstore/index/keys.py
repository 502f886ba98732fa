"""Redis key layout of the index (see kvstore/index/__init__.py) and the one-round-trip lookup script."""

from __future__ import annotations

import hashlib

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
    return f"{PREFIX}b:{ns_tag(namespace)}:{h.hex()}"


def alive_key(node_id: str) -> str:
    return ALIVE_PREFIX + node_id


def node_key(node_id: str) -> str:
    return f"{PREFIX}node:{node_id}"


def epoch_key(node_id: str) -> str:
    return f"{PREFIX}epoch:{node_id}"
