"""A process that squats a node's same-host socket path: what another local user can bind where a node's socket
was (tests/security/test_shm_peer.py). It serves a SEQPACKET socket at PATH, answers every message it receives
with the bytes given as REPLY_HEX (e.g. a WELCOME, to lure a client further), and writes one JSON line per
event to stdout: {"event": "ready"}, {"event": "message", "hex": ..., "fds": n} (what a client sent, and how
many descriptors came with it). It stops on SIGTERM, or after LIFETIME seconds.

Standard library only: it runs as another user (`subprocess.Popen(user=...)`), under a Python that may not see
this project's virtual environment.

    python3 devkit/shm_squatter.py PATH REPLY_HEX [LIFETIME]
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import os
import select
import signal
import socket
import sys
import time


def _say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shm_squatter.py", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("path", help="the socket path to serve")
    ap.add_argument("reply_hex", type=bytes.fromhex, help="the bytes answered to every message, in hex")
    ap.add_argument("lifetime", type=float, nargs="?", default=120.0, help="seconds before it stops by itself")
    args = ap.parse_args(argv)
    path, reply, lifetime = args.path, args.reply_hex, args.lifetime
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o666)  # anyone may connect: a squatter wants every client
    inode = os.stat(path).st_ino
    listener.listen(16)
    _say(event="ready", uid=os.getuid())
    conns: list[socket.socket] = []
    deadline = time.monotonic() + lifetime
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([listener, *conns], [], [], 0.2)
            for s in readable:
                if s is listener:
                    conns.append(listener.accept()[0])
                    _say(event="connection")
                    continue
                fds = array.array("i")
                try:
                    msg, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(16 * fds.itemsize))
                except OSError:
                    msg, anc = b"", []
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                for fd in fds:
                    os.close(fd)
                if not msg:
                    conns.remove(s)
                    s.close()
                    continue
                _say(event="message", hex=msg.hex(), fds=len(fds))
                with contextlib.suppress(OSError):
                    s.send(reply)
    finally:
        listener.close()
        for s in conns:
            s.close()
        try:
            if os.stat(path).st_ino == inode:  # still ours: another process may serve the path by now
                os.unlink(path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
