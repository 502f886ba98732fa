"""Tenants: names, and how the node scopes a caller's namespace to its tenant (DESIGN.md §10). Pure.

A tenant is an identity the *server* binds to a caller (a token line in a token file, or an mTLS subject
in the tenants file: kvstore/security.py, kvstore/node/tenancy.py). The node stores every page of tenant T
under a scoped namespace, `scope(namespace, T)`, and every plane scopes the namespace a request names
before it reaches the manager (`TierManager.scoped`), so:

- two tenants' keys are disjoint: equal prompts of two tenants never share a page, a hit or its timing;
- a namespace a client sends can never name another tenant's scope: client namespaces contain no control
  characters (kvstore/hashing.validate_namespace), and a scoped one starts with one (SEP);
- the default tenant's scope is the namespace itself, so a node without tenancy (and its NVMe files and
  index keys) is exactly what it was before tenancy existed;
- the scoped namespace is what a page header stores on NVMe, so a restarted node recovers each page into
  its tenant's scope (no separate tenancy metadata to lose).
"""

from __future__ import annotations

import re

from kvstore.hashing import MAX_NAMESPACE_BYTES

DEFAULT_TENANT = "default"
SEP = "\x1f"  # ASCII unit separator: a control character, so never part of a client's namespace
MAX_TENANT_BYTES = 64
# The longest namespace the node stores (page headers, the index): a client namespace plus a tenant scope.
MAX_SCOPED_NAMESPACE_BYTES = MAX_NAMESPACE_BYTES + MAX_TENANT_BYTES + 2 * len(SEP)
_TENANT_RE = re.compile(rf"^[A-Za-z0-9._-]{{1,{MAX_TENANT_BYTES}}}$")  # no glob characters: Redis ACL patterns


def check_tenant(name: str, where: str = "tenant") -> str:
    """`name` if it is a valid tenant name ([A-Za-z0-9._-], 1..64 characters); ValueError naming `where`."""
    if not isinstance(name, str) or not _TENANT_RE.match(name):
        raise ValueError(f"{where}: {name!r} is not a tenant name (1-{MAX_TENANT_BYTES} of A-Z a-z 0-9 . _ -)")
    return name


def scope(namespace: str, tenant: str) -> str:
    """The namespace the node stores `namespace` of `tenant` under (the default tenant's is unchanged).
    The caller has validated `namespace` (a client namespace has no control characters)."""
    if tenant == DEFAULT_TENANT:
        return namespace
    return f"{SEP}{tenant}{SEP}{namespace}"


def tenant_of(scoped: str) -> str:
    """The tenant a stored (scoped) namespace belongs to."""
    if not scoped.startswith(SEP):
        return DEFAULT_TENANT
    end = scoped.find(SEP, 1)
    return scoped[1:end] if end > 0 else DEFAULT_TENANT


def unscope(scoped: str) -> str:
    """The namespace as its tenant's clients name it (what errors and Stats show them)."""
    if not scoped.startswith(SEP):
        return scoped
    end = scoped.find(SEP, 1)
    return scoped[end + 1 :] if end > 0 else scoped


def split(scoped: str) -> tuple[str, str]:
    """(tenant, client namespace) of a stored namespace."""
    return tenant_of(scoped), unscope(scoped)
