"""Client memory the node maps for the same-host plane (kvstore/wire/shm.py): which descriptors it maps, how, and
how long a mapping lives.

Why nothing in a client's memory can kill the node:
- the node maps only a memfd of the shared-memory filesystem (tmpfs, by its fstatfs magic) sealed against
  shrinking and growing and not against writes. Sealed so, no page of it can vanish under a copy (a touch
  past a file's end is SIGBUS). Tmpfs only: a hole punched into it afterwards (FALLOC_FL_PUNCH_HOLE, which
  those seals allow) comes back as a fresh zero page on the next touch, allocated like any other page of the
  node's, never a fault. A hugetlbfs memfd (MFD_HUGETLB) is another matter: a hole punched after the node
  wrote there, with the host's free huge pages taken meanwhile, faults SIGBUS on the node's next write
  (SECURITY.md, round 4), so it is refused like every other descriptor the node will not map: one answer;
- a mapping keeps no descriptor: it is made with mmap(2) through ctypes and the caller closes the descriptor
  right after, so a registration costs the node one mapping, never a descriptor. (CPython's mmap keeps a
  duplicate of the descriptor for as long as the map lives: 1,000 tiny registrations used up a 1,024-descriptor
  limit, and every new connection of any kind failed);
- a mapping is unmapped only when nothing refers to it any more: `view`, and every window cut from it, keep
  alive the ctypes array they export, whose finalizer unmaps. A window still held after the buffer was
  dropped stays valid until it is released.

The mapping helpers here are Linux's (memfd, fstatfs, mmap); the plane exists only where `shm_available`.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
import weakref

from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted

TMPFS_MAGIC = 0x01021994  # statfs.f_type of tmpfs and shmem: where a plain memfd lives
_STATFS_BYTES = 256  # room for struct statfs (120 bytes on 64-bit Linux); f_type is its first field
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_NEEDED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.fstatfs.restype = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


class Unusable(KVStoreError):
    """The one answer for a descriptor this node will not map (see the module docstring)."""

    status_name = "INVALID_ARGUMENT"

    def __init__(self) -> None:
        super().__init__(
            "register: the descriptor is not usable (the node maps only memfds sealed with F_SEAL_SHRINK and "
            "F_SEAL_GROW and not against writes)"
        )


def filesystem_magic(fd: int) -> int:
    """The f_type of the filesystem `fd` lives on (fstatfs(2)); OSError when the call fails."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def usable_size(fd: int) -> int:
    """The size of the memory `fd` would map as; Unusable for anything the node will not map: not a regular
    file, not on tmpfs (a hugetlbfs memfd among others), sealed otherwise than SHRINK and GROW without a write
    seal, or empty. Nothing is mapped; the descriptor stays the caller's to close."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unusable()
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        magic = filesystem_magic(fd)
    except OSError:
        raise Unusable() from None
    if seals & _NEEDED_SEALS != _NEEDED_SEALS or seals & _WRITE_SEALS or magic != TMPFS_MAGIC or st.st_size <= 0:
        raise Unusable()
    return st.st_size


def _unmap(address: int, size: int) -> None:
    _libc.munmap(address, size)


def map_shared(fd: int, size: int) -> memoryview:
    """A writable byte view of `size` bytes of `fd`, mapped MAP_SHARED and holding no descriptor (the caller
    closes `fd` when it likes); unmapped once the view and every view cut from it are gone.
    ResourceExhausted when the node cannot map it (address space, vm.max_map_count)."""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise ResourceExhausted(f"register: the node cannot map {size} more bytes ({os.strerror(err)})")
    region = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(region, _unmap, address, size)
    return memoryview(region).cast("B")


class MappedBuffer:
    """A client's registered memfd, mapped by the node. Invariant: the memory stays mapped until the buffer was
    dropped and every window given out was released (`users` counts the requests using it)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.view = map_shared(fd, size)
        self.users = 0
        self.dropped = False

    def check(self, offset: int, length: int, field: str) -> None:
        """InvalidArgument naming `field` unless [offset, offset + length) lies inside the buffer."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise InvalidArgument(field, f"[{offset}, {offset + length}) runs past the buffer's {self.size} bytes")

    def window(self, offset: int, n: int) -> memoryview:
        return self.view[offset : offset + n]

    def drop(self) -> None:
        self.dropped = True
        if self.users == 0:
            self._close()

    def release(self) -> None:
        self.users -= 1
        if self.dropped and self.users == 0:
            self._close()

    def _close(self) -> None:
        # NOTE: releasing our view unmaps at once unless a window is still held; then the last one unmaps.
        self.view.release()
