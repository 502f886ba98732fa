"""The same-host plane's socket file: where it is, and what the node does with whatever it finds at its path
(kvstore/wire/shm.py says why a path is not an identity: clients check who answers).

- The default path (`default_socket_path`) lies in `kvstore-<uid>` under the runtime directory. The node
  makes that directory (mode 0755) and uses it only if it is a real directory, its own, and nobody else may
  write it; otherwise (another user made it first, perhaps with a socket in it) the node serves from a fresh
  directory of its own beside it and says which one it would not use. So no other user can bind the default
  path, before or after the node ran.
- A configured path (`--local-socket`) is the operator's: the node warns when others may write its directory
  (they could bind the path while the node is down, or replace the socket while it runs, where no sticky bit
  stops them; clients then refuse the socket, but lose the plane). In Kubernetes the chart's directory is
  the node user's, mode 2750: clients may enter it, not write it.
- A socket file at the path when the node starts: nobody listening on it (a node killed -9) -> replaced;
  served by this node's own user (another node) -> the start is refused, naming the path; served by another
  user (a squatter) -> replaced, with a warning naming the path and who served it, where the node may remove
  it (it owns the directory, or is root), else the start is refused naming both. Anything else at the path
  (a file, a directory) -> refused, naming it.

Invariant: `BoundSocket.close` removes only the socket file this node bound (by inode), never one that another
process put at the path since.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvstore.wire.shm import default_socket_path, peer_credentials

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660  # owner and group: in Kubernetes the node's and the workers' pods share a group
DIRECTORY_MODE = 0o755  # the default socket's directory: anyone may enter, only the node's user may write
BIND_TRIES = 3  # a squatter that rebinds between our unlink and our bind gets this many rounds


@dataclass(slots=True)
class BoundSocket:
    """A listening SEQPACKET socket at `path`; `made` is a directory the node made for it alone (removed with
    it), or None."""

    sock: socket.socket
    path: str
    inode: int
    made: Path | None = None

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self.inode:  # still ours
                os.unlink(self.path)
        if self.made is not None:
            with contextlib.suppress(OSError):
                self.made.rmdir()


def bind_node_socket(configured: str | None, port: int) -> BoundSocket:
    """The node's listening socket: at `configured`, else at the default path for gRPC port `port` (see the
    module docstring); OSError naming the path when the node may not serve there."""
    if configured:
        _warn_if_others_may_write(Path(configured).parent)
        return BoundSocket(*_listen(configured))
    path = Path(default_socket_path(port))
    made = None
    if not _own_directory(path.parent):
        fresh = Path(tempfile.mkdtemp(prefix=f"{path.parent.name}-", dir=path.parent.parent))
        fresh.chmod(DIRECTORY_MODE)
        log.warning(
            "same-host plane: %s is not a directory only this node's user (uid %d) may write (another user may "
            "have made it): serving from %s instead; clients learn the path from the node",
            path.parent,
            os.geteuid(),
            fresh,
        )
        path, made = fresh / path.name, fresh
    try:
        return BoundSocket(*_listen(str(path)), made=made)
    except BaseException:
        if made is not None:
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


def _own_directory(d: Path) -> bool:
    """Make `d` (mode 0755) unless it exists; True if it is a directory of this user that nobody else may write."""
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        d.mkdir()
        d.chmod(DIRECTORY_MODE)
    except FileExistsError:
        pass
    st = d.lstat()
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _warn_if_others_may_write(d: Path) -> None:
    with contextlib.suppress(OSError):
        st = d.stat()
        if st.st_mode & 0o022:
            log.warning(
                "same-host plane: other users may write %s (mode %o): they could bind the socket's path while this "
                "node is down%s; clients refuse a socket another user serves, but lose the plane: use a directory "
                "only the node's user may write",
                d,
                stat.S_IMODE(st.st_mode),
                "" if st.st_mode & stat.S_ISVTX else ", or replace the socket while it runs",
            )


def _listen(path: str) -> tuple[socket.socket, str, int]:
    """(socket, path, inode): listening at `path`, after clearing what `_clear` allows."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(BIND_TRIES):
        _clear(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            if exc.errno == 98 and attempt < BIND_TRIES - 1:  # EADDRINUSE: bound again since it was cleared
                continue
            raise OSError(f"--local-socket {path}: cannot bind: {exc.strerror}") from None
        try:
            os.chmod(path, SOCKET_MODE)
            inode = os.lstat(path).st_ino
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock, path, inode
    raise AssertionError("unreachable: the last attempt returns or raises")


def _clear(path: str) -> None:
    """Remove what may be removed at `path` before binding (see the module docstring), or raise OSError."""
    p = Path(path)
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"--local-socket {path}: exists and is not a socket; remove it or choose another path")
    me = os.geteuid()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
        peer = peer_credentials(probe)
        who, uid = f"uid {peer.uid}, pid {peer.pid or 'of another PID namespace'}", peer.uid
    except ConnectionRefusedError:  # nobody listens: a node that died without removing it
        _remove(path, "a stale socket nobody serves", st.st_uid)
        return
    except OSError as exc:  # another kind of socket, or one we may not reach: its owner says whose it is
        if st.st_uid == me:
            raise OSError(
                f"--local-socket {path}: cannot tell whether another node serves it ({exc}); remove it or choose "
                "another path"
            ) from None
        who, uid = f"uid {st.st_uid}, the socket file's owner", st.st_uid
    finally:
        probe.close()
    if uid == me:
        raise OSError(f"--local-socket {path}: another node serves this socket ({who}); choose another path")
    log.warning(
        "same-host plane: %s was served by another user (%s), not this node's (uid %d): replacing it (clients "
        "check who serves the socket, so they sent it nothing)",
        path,
        who,
        me,
    )
    _remove(path, f"a socket another user serves ({who})", st.st_uid)


def _remove(path: str, what: str, owner: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except PermissionError:
        raise OSError(
            f"--local-socket {path}: {what}, owned by uid {owner}, is in the way and this node's user may not "
            "remove it (a sticky directory); remove it as its owner or root, or choose another path"
        ) from None
    log.info("same-host plane: removed %s at %s", what, path)
