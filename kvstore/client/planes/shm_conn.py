"""The same-host plane's connections: one SEQPACKET socket to the node's Unix socket each, one request at a time,
and the memory a request lends the node (the client side of kvstore/wire/shm.py; the plane itself:
kvstore/client/planes/shm.py).

Connections: a pool of SEQPACKET connections (one request at a time each), opened on demand with HELLO and
the client's token; each registers a SharedBuffer (passing its memfd with SCM_RIGHTS) the first time a
request names it. Before HELLO a connection checks who answers (kvstore/wire/shm.py): the socket's peer must be
the user the node advertised over gRPC (or KVSTORE_LOCAL_SOCKET_UID), else nothing is sent. A node that cannot
be reached (no socket, another host, the plane off), a socket another user serves, and a node that refuses the
connection (its plane full: ERROR UNAVAILABLE in answer to HELLO) are PlaneUnavailable before anything but
the HELLO was sent: the client falls back to the next plane.

Memory a request names is the node's to read or write until the node is done with it (DESIGN.md §8): its
reply says so, and so does its close of the connection after the client hung up (the node cancels a request
whose client hung up and closes only once its work on that request has ended). A request the caller gives up
on (a timeout, an asyncio cancel: `Connection.abort`) is therefore hung up on, and its memory (receive-pool
blocks) comes back to the pool only when that close arrives: the caller waits DRAIN_SECONDS for it, then a
background watcher up to QUARANTINE_SECONDS, after which the memory is written off (kept out of the pool for
good). A `get_into` whose node did not close in DRAIN_SECONDS raises an error saying its buffers may still be
written.
"""

from __future__ import annotations

import array
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.client.planes.segments import SharedBuffer
from kvstore.errors import (
    PlaneUnavailable,
    ResourceExhausted,
    StreamError,
    Unavailable,
    from_status,
)
from kvstore.wire import shm
from kvstore.wire.shm import Kind

log = logging.getLogger("kvstore.client.planes.shm")  # NOTE: the plane's logger name, as before the split

DRAIN_SECONDS = 2.0  # after giving up on a request: how long the caller waits for the node's close
QUARANTINE_SECONDS = 600.0  # then how long a background watcher waits before the lent memory is written off
Release = Callable[[], None]  # gives memory lent to a request back (called once the node is done with it)


def nothing() -> None:
    """A release with nothing to give back (the request lent no pool memory)."""
    return None


class Loan:
    """Memory one request lends the node. `settle()` gives it back (once) when the call is over, unless a
    connection handed it to QUARANTINE because the node never said it was done with it."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self.quarantined = False
        self._settled = False

    def settle(self) -> None:
        if not self._settled and not self.quarantined:
            self._settled = True
            self.release()


class _Quarantine:
    """Sockets of requests given up on whose node has not closed yet, each with the release of the memory the
    request lent it. One daemon thread (while any are left) waits for each socket's close, then releases its
    memory; after QUARANTINE_SECONDS it writes the memory off instead (`written_off`: never released, so it
    never returns to the pool while a late write could still land in it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[socket.socket, Release, float]] = []
        self._thread: threading.Thread | None = None
        self.written_off: list[Release] = []

    def add(self, sock: socket.socket, release: Release) -> None:
        with self._lock:
            self._items.append((sock, release, time.monotonic() + QUARANTINE_SECONDS))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-shm-quarantine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    self._thread = None
                    return
                items = list(self._items)
            try:
                readable, _, _ = select.select([s for s, _, _ in items], [], [], 0.5)
            except (OSError, ValueError):
                readable = [s for s, _, _ in items]  # a socket went bad: its checks below settle it
            now = time.monotonic()
            for sock, release, deadline in items:
                if sock in readable and _closed_by_peer(sock):
                    release()
                elif now > deadline:
                    log.warning("the node never closed a same-host connection given up on: its memory stays lent")
                    self.written_off.append(release)
                else:
                    continue
                with self._lock:
                    self._items = [i for i in self._items if i[0] is not sock]
                sock.close()


QUARANTINE = _Quarantine()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Read what is there (a late reply is dropped); True once the node has closed its end."""
    try:
        return not sock.recv(shm.MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:  # reset: the node's end is gone
        return True


def _wait_closed(sock: socket.socket, seconds: float) -> bool:
    """Wait (bounded) until the node closes its end of `sock`, dropping what arrives before; True if it did."""
    deadline = time.monotonic() + seconds
    for _ in range(10_000):  # bounded: each round waits or reads one message
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            sock.settimeout(left)
            if not sock.recv(shm.MAX_MESSAGE_BYTES):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


class Connection:
    """One connection to the node's socket: HELLO'd, with the buffers registered on it. One call at a time.
    Invariant: nothing is sent on it unless its peer is the user `uid` (checked once connected)."""

    def __init__(self, path: str, token: str | None, timeout: float, uid: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, shm.SOCKET_BUFFER_BYTES)
            sock.connect(path)
            check_peer(sock, path, uid)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.seq = 0
        self.registered: set[int] = set()
        self.usable = True
        self.replied = False  # whether the current request got a reply (the pool clears it before each one)
        self._handed_off = False  # the socket belongs to QUARANTINE now
        try:
            welcome = shm.parse_welcome(self.call(Kind.HELLO, (token or "").encode(), want=Kind.WELCOME))
            self.max_page_bytes, self.max_pages = welcome.max_page_bytes, welcome.max_pages
            self.sums_after = welcome.sums_after  # the node takes PUT_SUMS (kvstore/wire/shm.py)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.usable = False
        if not self._handed_off:
            self.sock.close()

    def abort(self) -> None:
        """From another thread: hang up on the request in progress. The node cancels it and closes the
        connection once its work on this client's memory has ended; the waiting `call` sees that close."""
        self.usable = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def call(
        self,
        kind: Kind,
        body: bytes,
        fds: Sequence[int] = (),
        *,
        want: Kind = Kind.OK,
        loan: Loan | None = None,
        then: Callable[[], bytes] | None = None,
    ) -> memoryview:
        """Send one request and return its reply's body; an ERROR reply raises the node's exception. `then`
        (a PUT_SUMS) makes the body of the SUMS message sent right after the request, before its reply.
        When it returns or raises, the node is done with the memory the request names (its reply, or its close
        after a hang-up: the module docstring), except where `loan` was handed to QUARANTINE."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        msg = shm.frame(kind, self.seq, body)
        try:
            if fds:
                self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(msg)
        except OSError:  # not sent (a SEQPACKET message goes whole or not at all): the node never saw it
            self.usable = False
            raise
        try:
            if then is not None:  # NOTE: made while the node works on the request (a PUT_SUMS's pages hashed)
                self.sock.send(shm.frame(Kind.SUMS, self.seq, then()))
        except BaseException as exc:
            self.usable = False
            self._give_up(loan, exc)
            raise
        try:
            reply = self.sock.recv(shm.MAX_MESSAGE_BYTES)
        except OSError as exc:
            self.usable = False
            self._give_up(loan, exc)
            raise
        if not reply:  # the node closed: it does so only once its work on the request has ended
            self.usable = False
            raise ConnectionError("the node closed the same-host plane connection")
        self.replied = True
        got, seq, payload = shm.unframe(reply)
        if got is Kind.ERROR:
            raise from_status(*shm.parse_error(payload))
        if got is not want or (seq != self.seq and kind is not Kind.HELLO):
            self.usable = False
            raise StreamError(f"the node answered {kind.name} with {got.name} (request {seq}, expected {self.seq})")
        return payload

    def _give_up(self, loan: Loan | None, cause: BaseException) -> None:
        """The request went out and its reply never came (a timeout, an abort): hang up, and wait for the
        node's close, which says its work on the request's memory has ended (the module docstring). When it
        does not close within DRAIN_SECONDS, the loan goes to QUARANTINE and this raises Unavailable saying so."""
        self.abort()
        if _wait_closed(self.sock, DRAIN_SECONDS):
            return
        self._handed_off = True
        if loan is not None:
            loan.quarantined = True
            QUARANTINE.add(self.sock, loan.release)
        else:
            QUARANTINE.add(self.sock, nothing)
        raise Unavailable(
            f"same-host plane: {cause or type(cause).__name__}; the node did not confirm within {DRAIN_SECONDS:g} s "
            "that it stopped using this call's memory: buffers passed to get_into may still be written until it "
            "closes the connection (receive-pool memory is kept out of use until then)"
        ) from None

    def register(self, buf: SharedBuffer) -> None:
        """Have the node map `buf`. A node out of mapping room (its shm_max_mapped_bytes, or address space)
        makes the plane unavailable for this call: an auto-mode client carries on over the next plane."""
        if buf.id not in self.registered:
            try:
                self.call(Kind.REGISTER, shm.REGISTER.pack(buf.id), fds=[buf.fd])
            except ResourceExhausted as exc:
                raise PlaneUnavailable(f"shm: {exc}") from None
            self.registered.add(buf.id)


def check_peer(sock: socket.socket, path: str, uid: int) -> None:
    """PlaneUnavailable (logged: someone else may be posing as the node) unless the process serving `sock` runs
    as `uid`, the node's user. Called before anything is sent on it."""
    peer = shm.peer_credentials(sock)
    if peer.uid != uid:
        msg = (
            f"the same-host socket {path} is served by uid {peer.uid} (pid {peer.pid or 'not visible here'}), "
            f"not by the node's user (uid {uid}: what the node advertises over gRPC, or KVSTORE_LOCAL_SOCKET_UID): "
            "nothing was sent to it. Another local user may have bound the path while the node was down, or "
            "replaced the node's socket in a directory others may write"
        )
        log.warning("%s", msg)
        raise PlaneUnavailable(msg)
