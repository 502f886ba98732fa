"""Redis ACL users of the index: who may write which keys (pure; `kvstore up` and the chart apply them).

Roles (SECURITY.md):
- a node (`kvnode-<node id>`) reads the whole index and writes only its own records: its alive, beat,
  epoch and node keys, its holder in entries (through the entry scripts it loads, keys.UPDATE_SCRIPT and
  PRUNE_SCRIPT, whose own calls may only HGET/HSET/HDEL a stripe: a stripe cannot be deleted) and its
  id in the node set (SADD only). Redis cannot restrict what a script writes inside a hash, so a node
  could still claim or drop another node's holders: that costs a miss (clients ask the real node, which
  says no), never a page from the wrong node.
- a client (`kvclient`: workers, routers, kvctl) only reads, with plain read commands: no script at all
  (no EVAL, EVALSHA or SCRIPT LOAD), so it cannot write or run Lua of its own; it reads the node records
  and the default tenant's entries. A tenant's client (`kvclient-<tenant>`) reads the node records and
  that tenant's entries only (`tenant_client_rules`).
- on a Redis Cluster every user may also ask for the slot map (CLUSTER SLOTS), the command table
  (COMMAND: redis-py reads it when it connects) and follow an ASK redirection (ASKING); nodes may read
  INFO (the masters' run ids tell a node that its entries may be gone, kvstore/index/connect.py).
  Redis Cluster does not propagate ACL users: every server of the cluster, replicas included (any may
  become a master), carries the same users (`kvstore up` and the chart write them into every server's
  configuration).
- `default` is the administrator (all commands), for the operator and the Redis pod's probes.
- with Sentinel, the sentinels have their own users: `default` (their administrator) and `kvsentinel`
  (`SENTINEL_CLIENT_RULES`: where is the master, nothing more), shared by nodes and clients.

`node_rules("*")` is the shared node user the Helm chart renders when node ids are not known in
advance (a DaemonSet): every node may then write every node's records, and only the clients' TLS
check of node identities stands between a compromised node and its peers' traffic.
"""

from __future__ import annotations

import hashlib
import re

from kvstore.index.keys import (
    NODE_TAG,
    NODES_KEY,
    PREFIX,
    alive_key,
    beat_key,
    epoch_key,
    node_key,
    tenant_prefix,
)
from kvstore.scoping import check_tenant

NODE_USER_PREFIX = "kvnode-"
SHARED_NODE_USER = "kvnode"
CLIENT_USER = "kvclient"
_NODE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # no glob characters: ids become key patterns

# What any index connection needs: redis-py's handshake (AUTH/HELLO, SELECT; it ignores a refused CLIENT
# SETINFO), and on a Redis Cluster its discovery (the slot map, the command table) and ASK redirections.
_CONNECT = "+ping +hello +auth +select +client|setname +client|id +echo +reset +cluster|slots +command +asking"
_RESET = "resetkeys resetchannels nocommands"

_NODE_RECORDS = f"%R~{PREFIX}{NODE_TAG}:*"  # where nodes are, who is alive (read only)
_CLIENT_COMMANDS = "+get +mget +hgetall +hmget +smembers"
# The default tenant's client: node records and the default tenant's entries, no other tenant's.
CLIENT_RULES = f"{_RESET} {_CONNECT} {_NODE_RECORDS} %R~{PREFIX}b:* {_CLIENT_COMMANDS}"


def tenant_client_rules(tenant: str) -> str:
    """ACL rules of tenant `tenant`'s index client (`kvclient-<tenant>`): node records and that tenant's
    block entries only, so its lookups through the index see no other tenant's pages (Redis answers
    NOPERM for another tenant's keys)."""
    check_tenant(tenant, "tenant of an index client")
    return f"{_RESET} {_CONNECT} {_NODE_RECORDS} %R~{tenant_prefix(tenant)}* {_CLIENT_COMMANDS}"


def tenant_client_user(tenant: str) -> str:
    return f"{CLIENT_USER}-{tenant}"


# Redis Sentinel (index/connect.py): the sentinels' own users. `default` (the sentinels' administrator,
# who may reconfigure them; only Redis' own pods/processes hold it) and `kvsentinel`, which nodes and
# clients share to ask where the master is and nothing else: a client that could SENTINEL SET, REMOVE or
# FAILOVER could point every node at a Redis of its own and collect their passwords.
SENTINEL_CLIENT_USER = "kvsentinel"
SENTINEL_CLIENT_RULES = (
    "resetchannels -@all +ping +hello +auth +client|setname +client|id +sentinel|masters +sentinel|master "
    "+sentinel|get-master-addr-by-name +sentinel|slaves +sentinel|replicas +sentinel|sentinels"
)


def node_rules(node_id: str) -> str:
    """ACL rules (after the password) of the Redis user of node `node_id`; "*" for a user every node
    shares. Raises ValueError for an id that is not a plain name (it becomes part of key patterns)."""
    if node_id != "*" and not _NODE_ID_RE.match(node_id):
        raise ValueError(f"node id {node_id!r}: a per-node Redis user needs [A-Za-z0-9._-] only")
    own = f"~{alive_key(node_id)} ~{beat_key(node_id)} ~{epoch_key(node_id)} ~{node_key(node_id)}"
    # NOTE: a selector per kind of stripe: EVALSHA declares its keys read-write whatever the script does,
    # and the scripts' own HGET/HSET/HDEL are checked against these same rules.
    stripe = "+evalsha +hget +hset +hdel"
    return (
        f"{_RESET} {_CONNECT} %R~{PREFIX}* {own} +get +mget +set +incr +incrby +del +expire +exists +hset +hgetall "
        f"+hmget +hscan +smembers +scan +info +script|load "
        f"(~{PREFIX}b:* {stripe}) (~{PREFIX}t:* {stripe}) (~{NODES_KEY} +sadd)"
    )


def node_user(node_id: str) -> str:
    return f"{NODE_USER_PREFIX}{node_id}"


def acl_line(user: str, password: str, rules: str) -> str:
    """One `user` directive for redis.conf; the password is stored only as its SHA-256."""
    return f"user {user} on #{hashlib.sha256(password.encode()).hexdigest()} {rules}"


def admin_line(password: str) -> str:
    return acl_line("default", password, "~* &* +@all")


def index_acl(
    admin_password: str,
    client_password: str,
    node_passwords: dict[str, str],
    tenant_passwords: dict[str, str] | None = None,
) -> list[str]:
    """Every `user` line of a secured index: the administrator, the read-only client user (default
    tenant), one user per node id (each may write only its own records) and one read-only client user
    per tenant (each may read only its tenant's entries)."""
    lines = [admin_line(admin_password), acl_line(CLIENT_USER, client_password, CLIENT_RULES)]
    lines += [acl_line(node_user(n), pw, node_rules(n)) for n, pw in sorted(node_passwords.items())]
    lines += [
        acl_line(tenant_client_user(t), pw, tenant_client_rules(t))
        for t, pw in sorted((tenant_passwords or {}).items())
    ]
    return lines
