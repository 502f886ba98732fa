"""Retention hints an engine passes with a request (DESIGN.md §6.5): one schema for every door. Pure.

A request that names a session asks the store to keep that session's pages through the pauses between its
turns (tool calls, a user typing). The schema, whatever carries it:

    session   the conversation's id (1..128 bytes, your choice; scoped to your tenant on the node)   required
    ttl_s     the lease, renewed by each request of the session (seconds > 0)           default: the door's retain_ttl
    priority  0..100: at the tenant's cap, sessions of lower priority give way              default: the node's (50)
    mode      "hold" (kept where they are) or "demote" (DRAM may demote them; never dropped)   default: the node's
    resume    prefetch the session's pages back to DRAM when the request arrives                      default: true
    end       the session ends when this request finishes: its pages are released                    default: false

Carriers (each door's module says what its engine hands it): LMCache's request configs (`lmcache.kvstore.<key>`
in vLLM's `kv_transfer_params`), vLLM's `kv_transfer_params` (`{"kvstore": {...}}` or `kvstore.<key>`) and its
`kv_hints` (an action of type `kvstore.retain`, the schema as its payload), SGLang's `extra_info.extra_info`
(`session_id`, SGLang's own key, and `kvstore.<key>`), our Ray router (a `SessionHints` per conversation).

A bad hint is the engine's request's problem, not the store's: doors log it (naming the key as the engine
spells it) and serve the request without retention; they never raise into the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.names import MAX_PRIORITY, MAX_SESSION_BYTES, MIN_PRIORITY, RetainMode

KEYS = ("session", "ttl_s", "priority", "mode", "resume", "end")
KV_HINT_ACTION = "kvstore.retain"  # vLLM kv_hints: the action type this schema travels as


class HintError(ValueError):
    """A bad retention hint; the message names the key as the engine's request spells it."""


@dataclass(frozen=True, slots=True)
class SessionHints:
    """What one request says about its session's retention (see the module docstring)."""

    session: str
    ttl_s: float | None = None
    priority: int | None = None
    mode: RetainMode | None = None
    resume: bool = True
    end: bool = False

    def lease(self, default: float) -> float:
        return self.ttl_s if self.ttl_s is not None else default


def parse(values: Mapping[str, object], where: str) -> SessionHints | None:
    """Hints from a mapping of the schema's keys (others ignored); None when it names no session. HintError
    names `where` + the key."""
    if values.get("session") is None:
        return None
    session = values["session"]
    if not isinstance(session, str) or not 1 <= len(session.encode("utf-8", "surrogatepass")) <= MAX_SESSION_BYTES:
        raise HintError(f"{where}session: a session id is 1..{MAX_SESSION_BYTES} bytes of text, got {session!r}")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in session):
        raise HintError(f"{where}session: {session!r} contains a control character")
    ttl = values.get("ttl_s")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (math.isfinite(ttl) and ttl > 0):
            raise HintError(f"{where}ttl_s: a lease is a finite number of seconds > 0, got {ttl!r}")
        ttl = float(ttl)
    priority = values.get("priority")
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise HintError(f"{where}priority: an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    mode = values.get("mode")
    if mode is not None:
        try:
            mode = RetainMode[str(mode).upper()]
        except KeyError:
            raise HintError(f"{where}mode: 'hold' or 'demote', got {mode!r}") from None
    flags = {}
    for name, default in (("resume", True), ("end", False)):
        v = values.get(name, default)
        if not isinstance(v, bool):
            raise HintError(f"{where}{name}: true or false, got {v!r}")
        flags[name] = v
    return SessionHints(session, ttl, priority, mode, flags["resume"], flags["end"])


def prefixed(values: Mapping[str, object] | None, prefix: str) -> dict[str, object]:
    """The schema's keys among `prefix`<key> entries (e.g. "lmcache.kvstore.session" with prefix
    "lmcache.kvstore.")."""
    return {k[len(prefix) :]: v for k, v in (values or {}).items() if isinstance(k, str) and k.startswith(prefix)}


def from_vllm(kv_transfer_params: Mapping[str, object] | None, kv_hints: object = None) -> SessionHints | None:
    """vLLM's request: `kv_transfer_params` {"kvstore": {...}} or flat "kvstore.<key>", or a `kv_hints` envelope's
    action of type KV_HINT_ACTION (its payload the schema). The first that names a session wins, in that order."""
    params = kv_transfer_params or {}
    nested = params.get("kvstore")
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise HintError(f"kv_transfer_params.kvstore: an object of {', '.join(KEYS)}, got {nested!r}")
        found = parse(nested, "kv_transfer_params.kvstore.")
        if found is not None:
            return found
    found = parse(prefixed(params, "kvstore."), "kv_transfer_params.kvstore.")
    if found is not None:
        return found
    for action in getattr(kv_hints, "actions", None) or ():
        if getattr(action, "action_type", None) == KV_HINT_ACTION:
            payload = getattr(action, "payload", None)
            if not isinstance(payload, Mapping):
                raise HintError(f"kv_hints {KV_HINT_ACTION}.payload: an object, got {payload!r}")
            return parse(payload, f"kv_hints {KV_HINT_ACTION}.payload.")
    return None


def from_lmcache(request_configs: Mapping[str, object] | None) -> SessionHints | None:
    """LMCache's request configs (the `lmcache.*` entries of vLLM's kv_transfer_params): lmcache.kvstore.<key>."""
    return parse(prefixed(request_configs, "lmcache.kvstore."), "lmcache.kvstore.")


def from_sglang(extra_info: Mapping[str, object] | None) -> SessionHints | None:
    """SGLang's `HiCacheStorageExtraInfo.extra_info`: `session_id` (SGLang's own key for the session that wrote
    the pages) or kvstore.session, and kvstore.<key> for the rest."""
    values = prefixed(extra_info, "kvstore.")
    if "session" not in values and (extra_info or {}).get("session_id") is not None:
        values["session"] = (extra_info or {})["session_id"]
    return parse(values, "extra_info.kvstore.")
