"""A KV-event subscriber for tests and for looking at a node's feed by hand.

    python -m devkit.kv_events_sub tcp://127.0.0.1:5557 [ENDPOINT ...] [--classes vllm] [--seconds 10] [--until-quiet 1.0]
        [--curve-server-key keys/node.key --curve-key keys/indexer.key_secret]   # a feed with CURVE keys

Connects a ZMQ SUB socket (to every endpoint given), decodes each message with vLLM's own classes (`--classes vllm`, in a venv that
has vLLM: `vllm.distributed.kv_events.KVEventBatch`) or as plain msgpack, and prints one JSON line per
message: {"topic", "seq", "ts", "events": [{"type", "block_hashes" (hex or int), "parent_block_hash",
"block_size", "medium", "token_ids"}]}. Stops after `--seconds`, or once nothing arrived for
`--until-quiet` seconds after the first message, or after `--max-messages`. Kept free of kvstore imports
so it runs in an engine's venv.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec
import zmq
import zmq.auth

_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _hash(h: Any) -> Any:
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


def _plain(event: Any) -> dict[str, Any]:
    """An event decoded without classes -> dict: a map with "type" (vLLM 0.32), or a tagged array (older)."""
    if isinstance(event, dict):
        return dict(event)
    tag, values = event[0], list(event[1:])
    out: dict[str, Any] = {"type": tag}
    for name, value in zip(_FIELDS.get(tag, ()), values, strict=False):
        out[name] = value
    return out


def _from_vllm(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in _FIELDS.get(out["type"], ()):
        if hasattr(event, name):
            out[name] = getattr(event, name)
    return out


def decoder(classes: str) -> Any:
    if classes == "vllm":
        from vllm.distributed.kv_events import KVEventBatch

        typed = msgspec.msgpack.Decoder(type=KVEventBatch)

        def decode_vllm(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
            batch = typed.decode(payload)
            return batch.ts, [_from_vllm(e) for e in batch.events]

        return decode_vllm
    return decode_plain


def decode_plain(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A KVEventBatch payload as plain data (what a non-Python indexer sees)."""
    batch = msgspec.msgpack.decode(payload)
    return batch[0], [_plain(e) for e in batch[1]]


def replay_state(messages: list[dict[str, Any]]) -> dict[str, dict[Any, set[str]]]:
    """What an indexer following these messages believes: per topic, each block hash and its media."""
    state: dict[str, dict[Any, set[str]]] = {}
    for msg in messages:
        blocks = state.setdefault(msg["topic"], {})
        for e in msg["events"]:
            if e["type"] == "AllBlocksCleared":
                blocks.clear()
            elif e["type"] == "BlockStored":
                for h in e["block_hashes"]:
                    blocks.setdefault(h, set()).add(e.get("medium"))
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    media = blocks.get(h, set())
                    media.discard(e.get("medium"))
                    if not media:
                        blocks.pop(h, None)
    return state


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("endpoints", nargs="+")
    ap.add_argument("--classes", choices=["vllm", "plain"], default="plain")
    ap.add_argument("--topic", default="")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--until-quiet", type=float, default=0.0)
    ap.add_argument("--max-messages", type=int, default=1_000_000)
    ap.add_argument("--curve-server-key", help="the node's public certificate (NAME.key), for a CURVE feed")
    ap.add_argument("--curve-key", help="this subscriber's certificate with its secret key (NAME.key_secret)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if (args.curve_server_key is None) != (args.curve_key is None):
        ap.error("--curve-server-key and --curve-key go together")
    decode = decoder(args.classes)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    if args.curve_key is not None:
        sock.curve_serverkey, _ = zmq.auth.load_certificate(args.curve_server_key)
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(args.curve_key)
    for endpoint in args.endpoints:
        sock.connect(endpoint)
    sock.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + args.seconds
    last = None
    n = 0
    while n < args.max_messages:
        now = time.monotonic()
        if now >= deadline or (args.until_quiet and last is not None and now - last >= args.until_quiet):
            break
        if not sock.poll(50):
            continue
        topic, seq, payload = sock.recv_multipart()
        ts, events = decode(payload)
        for e in events:
            if "block_hashes" in e:
                e["block_hashes"] = [_hash(h) for h in e["block_hashes"]]
            if e.get("parent_block_hash") is not None:
                e["parent_block_hash"] = _hash(e["parent_block_hash"])
        print(json.dumps({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": ts, "events": events}),
              flush=True)  # fmt: skip
        last = time.monotonic()
        n += 1
    sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
