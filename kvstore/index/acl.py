"""Redis ACL users of the index: who may write which keys (pure; `kvstore up` and the chart apply them).

Roles (SECURITY.md):
- a node (`kvnode-<node id>`) reads the whole index and writes only its own records: its alive, epoch
  and node keys, its field in block entries (HSET/HDEL only: a block key cannot be deleted) and its
  id in the node set (SADD only). Redis cannot restrict hash *fields*, so a node could still claim or
  drop another node's block entries: that costs a miss (clients ask the real node, which says no),
  never a page from the wrong node.
- a client (`kvclient`: workers, routers, kvctl) only reads, and may run only scripts a node loaded
  (EVALSHA, no EVAL / SCRIPT LOAD), so it cannot write or run Lua of its own; it reads the node records
  and the default tenant's block entries. A tenant's client (`kvclient-<tenant>`) reads the node
  records and that tenant's block entries only (`tenant_client_rules`).
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

from kvstore.index.keys import ALIVE_PREFIX, NODES_KEY, PREFIX, epoch_key, node_key, tenant_prefix
from kvstore.scoping import check_tenant

NODE_USER_PREFIX = "kvnode-"
SHARED_NODE_USER = "kvnode"
CLIENT_USER = "kvclient"
_NODE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # no glob characters: ids become key patterns

# What any index connection needs: redis-py's handshake (AUTH/HELLO, SELECT; it ignores a refused CLIENT SETINFO).
_CONNECT = "+ping +hello +auth +select +client|setname +client|id +echo +reset"
_RESET = "resetkeys resetchannels nocommands"

# NOTE: `~` rather than `%R~`: EVALSHA declares its keys read-write whatever the script does. The
# commands keep the client read-only: only read commands, and EVALSHA of scripts a node loaded, whose
# own calls Redis checks against these same command rules.
_NODE_RECORDS = f"~{ALIVE_PREFIX}* ~{PREFIX}node:* ~{NODES_KEY} ~{PREFIX}epoch:*"  # where nodes are, who is alive
_CLIENT_COMMANDS = "+get +hgetall +smembers +evalsha"
# The default tenant's client: node records and the default tenant's block entries, no other tenant's.
CLIENT_RULES = f"{_RESET} {_CONNECT} {_NODE_RECORDS} ~{PREFIX}b:* {_CLIENT_COMMANDS}"


def tenant_client_rules(tenant: str) -> str:
    """ACL rules of tenant `tenant`'s index client (`kvclient-<tenant>`): node records and that tenant's
    block entries only, so its lookups through the index see no other tenant's pages (Redis answers
    NOPERM for another tenant's keys, and the lookup script's reads are checked the same way)."""
    check_tenant(tenant, "tenant of an index client")
    return f"{_RESET} {_CONNECT} {_NODE_RECORDS} ~{tenant_prefix(tenant)}* {_CLIENT_COMMANDS}"


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
    own = f"~{ALIVE_PREFIX}{node_id} ~{epoch_key(node_id)} ~{node_key(node_id)}"
    return (
        f"{_RESET} {_CONNECT} %R~{PREFIX}* {own} +get +set +incr +incrby +del +expire +hset +hgetall +hdel "
        f"+smembers +scan +evalsha +script|load "
        f"(~{PREFIX}b:* +hset +hdel +hgetall) (~{PREFIX}t:* +hset +hdel +hgetall) (~{NODES_KEY} +sadd)"
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
