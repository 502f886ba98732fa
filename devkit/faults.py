"""Fault scenarios against real node processes (tests/faults at smoke size, benchmarks/faults.py at full).

Each scenario starts real `kvstore serve` processes (and a real redis-server where it needs one), injects
one kind of fault, and returns a `FaultResult`: rounds or requests, pages served with wrong bytes, pages
lost that were durable, seconds to recover, and the node's peak RSS. Every loop is bounded in count
and time, and every process a scenario starts it stops, by PID.

"Durable" is the API's definition (the Put rpc in proto/kvstore/v1/kvstore.proto): a page Lookup has
reported in TIER_NVME, and that has stayed there (these scenarios give NVMe room enough never to evict,
and read durable pages without promotion). Exactly those must survive a kill -9.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.cli.launch import NodeProcess
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.layout import DType, PageLayout
from kvstore.names import TierKind
from kvstore.pageformat import HEADER_BYTES
from kvstore.pageformat import MAGIC as PAGE_MAGIC
from kvstore.tiers.nvme_meta import META_NAME, SEGMENT_RE, SlotState, classify

LAYOUT = PageLayout(DType.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB pages
PAGE = LAYOUT.page_bytes
SLOT = HEADER_BYTES + PAGE
NS = "faults/llama-tiny/fp16"
CHAIN = 4  # pages per Put stream
_GET_BATCH = 512


def key(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{salt}:{i}".encode()).digest()


def content(h: bytes) -> bytes:
    """The bytes page h must always have (unique per key, so a page served under the wrong key shows)."""
    return hashlib.shake_256(h).digest(PAGE)


@dataclass(slots=True)
class FaultResult:
    """One scenario's figures (a row of the fault table)."""

    fault: str
    rounds: int = 0  # kill/restart rounds, fuzz batches, or fault injections
    requests: int = 0  # requests answered during the scenario
    corrupt_served: int = 0  # pages handed out whose bytes differ from those put
    durable_lost: int = 0  # durable pages (see the module docstring) missing after a restart
    errors: int = 0  # requests that failed where the scenario expects none
    recovery_seconds: list[float] = field(default_factory=list)
    memory_peak_bytes: int = 0  # node peak RSS (VmHWM) over the scenario
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def recovery_max(self) -> float:
        return max(self.recovery_seconds, default=0.0)

    def row(self) -> str:
        rec = (f"{sorted(self.recovery_seconds)[len(self.recovery_seconds) // 2]:.2f} / {self.recovery_max:.2f}"
               if self.recovery_seconds else "—")  # fmt: skip
        return (f"| {self.fault} | {self.rounds} | {self.requests} | {self.corrupt_served} | {self.durable_lost} | "
                f"{self.errors} | {rec} | {self.memory_peak_bytes / 2**20:.0f} MiB |")  # fmt: skip


TABLE_HEAD = ("| fault | rounds | requests | corrupt served | durable pages lost | errors | recovery s (median / max) "
              "| node memory peak |\n|---|---|---|---|---|---|---|---|")  # fmt: skip


def _status_kib(pid: int, field_name: str) -> int:
    try:
        m = re.search(rf"{field_name}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def rss_peak(pid: int) -> int:
    """Peak resident set (VmHWM) of a live process, in bytes; 0 when it is gone."""
    return _status_kib(pid, "VmHWM")


def rss_now(pid: int) -> int:
    """Resident set (VmRSS) of a live process, in bytes; 0 when it is gone."""
    return _status_kib(pid, "VmRSS")


def node_pid(node: NodeProcess) -> int:
    assert node.proc is not None
    return node.proc.pid


def start_timed(node: NodeProcess, result: FaultResult, timeout: float = 60.0) -> None:
    """Start (or restart) a node; its start-to-serving time is a recovery time."""
    t0 = time.monotonic()
    node.start(timeout=timeout)
    result.recovery_seconds.append(time.monotonic() - t0)


def put_chain(kv: KVStoreClient, keys: Sequence[bytes]) -> None:
    kv.put(NS, LAYOUT, keys, [content(h) for h in keys], chain=True)


def check_pages(kv: KVStoreClient, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes], int]:
    """Get every key without promotion (a missing page ends a stream, so the rest are asked again).
    Returns (present, missing, corrupt): corrupt counts pages whose bytes differ from those put, or that
    failed the client's checksum check after the transfer."""
    present: list[bytes] = []
    missing: list[bytes] = []
    corrupt = 0
    todo = list(keys)
    for _ in range(len(todo) + 1):  # each pass consumes at least one key
        if not todo:
            break
        # NOTE: the stored prefix is asked first (a lookup moves no page): a get whose first page is
        # missing costs as much as a full batch, and after a crash most of a key list can be missing.
        stored = kv.lookup(NS, todo[:_GET_BATCH])
        if stored == 0:
            missing.append(todo[0])
            todo = todo[1:]
            continue
        batch = todo[:stored]
        try:
            pages = kv.get_pages(NS, batch, promote=False)
        except KVStoreError as exc:
            if "checksum" not in str(exc):
                raise
            corrupt += 1
            pages = []
        for h, p in zip(batch, pages, strict=False):
            if bytes(p.data) != content(h):
                corrupt += 1
            present.append(h)
        n = len(pages)
        if n < len(batch):
            missing.append(batch[n])
            n += 1
        todo = todo[n:]
    return present, missing, corrupt


# ------------------------------------------------------------------ kill -9


class _Load:
    """Writer and promoter threads against one node, until stopped (or the node dies under them)."""

    def __init__(self, addr: str, state: _KillState, promote: bool, rng: random.Random, max_pages: int) -> None:
        self.addr = addr
        self.state = state
        self.promote = promote
        self.rng = rng
        self.max_pages = max_pages
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._writer, daemon=True)]
        if promote:
            self.threads.append(threading.Thread(target=self._promoter, daemon=True))

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _writer(self) -> None:
        st = self.state
        with contextlib.suppress(Exception), KVStoreClient(self.addr, timeout=10) as kv:
            pending: list[list[bytes]] = []
            written = 0
            while not self.stop.is_set() and written < self.max_pages:
                keys = [key(st.next_key + i, st.salt) for i in range(CHAIN)]
                st.next_key += CHAIN
                st.maybe.update(keys)  # in flight: may or may not survive, never with other bytes
                put_chain(kv, keys)
                written += CHAIN
                st.requests += 1
                pending.append(keys)
                pending = pending[-64:]
                self.stop.wait(self.rng.uniform(0.0, 0.03))  # spreads kill points over puts, demotions, lookups
                if st.requests % 3 == 0:
                    for chain in pending:
                        res = kv.lookup_detail(NS, chain)
                        st.requests += 1
                        for h, tier in zip(chain, res.tiers, strict=False):
                            if tier is TierKind.NVME and h in st.maybe:
                                st.maybe.discard(h)
                                st.durable.add(h)
                    pending = [c for c in pending if any(h in st.maybe for h in c)]

    def _promoter(self) -> None:
        st = self.state
        with contextlib.suppress(Exception), KVStoreClient(self.addr, timeout=10) as kv:
            while not self.stop.is_set() and st.durable:
                picks = self.rng.sample(sorted(st.durable), min(CHAIN, len(st.durable)))
                for h in picks:  # promoted pages keep their NVMe copy only best-effort: no longer durable
                    st.durable.discard(h)
                    st.maybe.add(h)
                kv.get_pages(NS, picks, promote=True)
                st.requests += 1


@dataclass(slots=True)
class _KillState:
    salt: str
    next_key: int = 0
    requests: int = 0
    durable: set[bytes] = field(default_factory=set)
    maybe: set[bytes] = field(default_factory=set)


KILL_MODES = ("put+demote", "put+demote", "promote", "shutdown-spill")


def kill9(workdir: Path, rounds: int, seed: int = 0, pages_per_round: int = 256) -> FaultResult:
    """`rounds` cycles of: (re)start, check every durable page and every page that may have survived,
    load (Puts that demote; promoting Gets in some rounds), then SIGKILL at a random moment (in
    shutdown-spill rounds, SIGTERM first and SIGKILL during the spill)."""
    rng = random.Random(seed)
    res = FaultResult("kill -9 during put / demotion / promotion / shutdown spill")
    st = _KillState(salt=f"kill9-{seed}")
    node = NodeProcess(dram_bytes=8 * SLOT, nvme_path=workdir / "nvme", nvme_bytes=(rounds + 2) * pages_per_round * SLOT,
                       max_page_bytes=PAGE, node_id="kill9")  # fmt: skip
    failures = 0
    try:
        for rnd in range(rounds + 1):
            start_timed(node, res)
            with KVStoreClient(node.addr, timeout=30) as kv:
                failures += kv.stats().tiers[-1].counters.checksum_failures
                _, missing, corrupt = check_pages(kv, sorted(st.durable))
                res.durable_lost += len(missing)
                res.corrupt_served += corrupt
                st.durable.difference_update(missing)
                present2, _, corrupt2 = check_pages(kv, sorted(st.maybe))
                res.corrupt_served += corrupt2
                # After a restart every page the node holds was recovered from NVMe: durable from here on.
                st.durable.update(present2)
                st.maybe.clear()
            res.memory_peak_bytes = max(res.memory_peak_bytes, rss_peak(node_pid(node)))
            if rnd == rounds:
                break
            mode = KILL_MODES[rnd % len(KILL_MODES)]
            with _Load(node.addr, st, promote=mode == "promote", rng=rng, max_pages=pages_per_round):
                time.sleep(rng.uniform(0.3, 1.5))
                res.memory_peak_bytes = max(res.memory_peak_bytes, rss_peak(node_pid(node)))
                proc = node.proc
                assert proc is not None
                if mode == "shutdown-spill":
                    proc.send_signal(signal.SIGTERM)
                    time.sleep(rng.uniform(0.0, 0.2))
                node.kill()
        res.rounds = rounds
        res.requests = st.requests
        res.notes = {"durable_pages_at_end": len(st.durable), "pages_put": st.next_key,
                     "checksum_failures_at_restarts": failures}  # fmt: skip
        return res
    finally:
        node.close()


# ------------------------------------------------------------------ bit rot


def live_slots(nvme: Path) -> list[tuple[Path, int]]:
    """(segment file, offset) of every slot holding a valid page header."""
    out = []
    for seg in sorted(p for p in nvme.iterdir() if SEGMENT_RE.fullmatch(p.name)):
        with open(seg, "rb") as f:
            size = seg.stat().st_size
            for off in range(0, size - SLOT + 1, SLOT):
                f.seek(off)
                if classify(f.read(HEADER_BYTES))[0] is SlotState.PAGE:
                    out.append((seg, off))
    return out


def damage_page(nvme: Path, page_hash: bytes, at: int = 100) -> Path:
    """Flip one bit `at` bytes into the payload of the NVMe slot holding `page_hash` (bit rot under a live
    or stopped node); returns the segment file. Slots start on 4 KiB boundaries whatever their size, so
    every boundary is checked for a page header naming the hash. KeyError if no slot holds it."""
    for seg in sorted(p for p in nvme.iterdir() if SEGMENT_RE.fullmatch(p.name)):
        with open(seg, "r+b") as f:
            for off in range(0, seg.stat().st_size - HEADER_BYTES + 1, 4096):
                f.seek(off)
                state, header, _ = classify(f.read(HEADER_BYTES))
                if state is SlotState.PAGE and header is not None and header.hash == page_hash:
                    f.seek(off + HEADER_BYTES + at)
                    byte = f.read(1)
                    f.seek(off + HEADER_BYTES + at)
                    f.write(bytes([byte[0] ^ 0x40]))
                    return seg
    raise KeyError(f"no NVMe slot under {nvme} holds page {page_hash.hex()[:16]}")


def flip_bits(rng: random.Random, targets: list[tuple[Path, int]], flips: int) -> None:
    """Flip `flips` random bits inside the given slots (header block or payload)."""
    for _ in range(flips):
        seg, off = rng.choice(targets)
        pos = off + rng.randrange(HEADER_BYTES + PAGE)
        with open(seg, "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def scrape_checksum_failures(port: int, tier: str = "nvme") -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith("kvstore_tier_checksum_failures_total") and f'tier="{tier}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def bitrot(workdir: Path, rounds: int, flips_per_round: int, pages: int = 512, seed: int = 0) -> FaultResult:
    """Random bit flips over the NVMe segment files (headers and payloads of stored pages) and, in the
    first round, one flipped byte in the metadata file; after each, a restart reads every page back.
    Every page refused must be counted, in Stats and in /metrics, and no page served with wrong bytes."""
    rng = random.Random(seed)
    res = FaultResult("bit rot on NVMe data and metadata")
    nvme = workdir / "nvme"
    node = NodeProcess(dram_bytes=8 * SLOT, nvme_path=nvme, nvme_bytes=2 * pages * SLOT, max_page_bytes=PAGE,
                       node_id="bitrot", extra_args=["--metrics-port", "0"])  # fmt: skip
    keys = [key(i, f"rot-{seed}") for i in range(pages)]
    refused = counted = counted_metrics = 0
    try:
        start_timed(node, res)
        with KVStoreClient(node.addr, timeout=30) as kv:
            for i in range(0, pages, CHAIN):
                put_chain(kv, keys[i : i + CHAIN])
                res.requests += 1
        res.memory_peak_bytes = rss_peak(node_pid(node))
        if node.stop() != 0:
            res.errors += 1
        live = set(keys)
        for rnd in range(rounds):
            targets = live_slots(nvme)
            flip_bits(rng, targets, flips_per_round)
            if rnd == 0:
                meta = nvme / META_NAME
                raw = bytearray(meta.read_bytes())
                raw[rng.randrange(len(raw))] ^= 0xFF
                meta.write_bytes(bytes(raw))
            start_timed(node, res)
            with KVStoreClient(node.addr, timeout=30) as kv:
                present, missing, corrupt = check_pages(kv, sorted(live))
                res.requests += len(present) + len(missing)
                res.corrupt_served += corrupt
                refused += len(missing)
                live.difference_update(missing)
                nvme_stats = next(t for t in kv.stats().tiers if t.tier is TierKind.NVME)
                counted += nvme_stats.counters.checksum_failures
            assert node.metrics_port is not None
            counted_metrics += int(scrape_checksum_failures(node.metrics_port))
            res.memory_peak_bytes = max(res.memory_peak_bytes, rss_peak(node_pid(node)))
            if node.stop() != 0:
                res.errors += 1
        res.rounds = rounds
        res.notes = {"flips": rounds * flips_per_round, "pages": pages, "refused": refused,
                     "checksum_failures_stats": counted, "checksum_failures_metrics": counted_metrics,
                     "metadata_rebuilt": re.search(r"NVMe metadata .* rebuilt", node.log_path.read_text()) is not None}  # fmt: skip
        return res
    finally:
        node.close()


# ------------------------------------------------------------------ disk full


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at path (root only), unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True,
                   capture_output=True, timeout=30)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)


def can_mount_tmpfs(probe: Path) -> str | None:
    """None when this process may mount a tmpfs, else why not."""
    try:
        with tmpfs(probe, 1 << 20):
            return None
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot mount a tmpfs here ({exc}); the disk-full scenario needs root (CI runs as root)"


def fill(path: Path) -> Path:
    """Fill the filesystem of `path` with one file until ENOSPC; returns the file."""
    filler = path / "filler.bin"
    block = b"\xa5" * (1 << 20)
    with open(filler, "wb") as f:
        for _ in range(1 << 16):  # bounded: 64 GiB
            try:
                f.write(block)
                f.flush()
            except OSError:
                break
    with contextlib.suppress(OSError):
        os.sync()
    return filler


def punch_free_slots(nvme: Path, keep_slots: int) -> int:
    """Punch holes in every slot from `keep_slots` on of each segment file (`fallocate --punch-hole`):
    those slots lose their reserved blocks, as on a thin-provisioned or copy-on-write volume, so a write
    there needs new blocks from the filesystem. Returns the bytes released."""
    released = 0
    for seg in sorted(p for p in nvme.iterdir() if SEGMENT_RE.fullmatch(p.name)):
        size = seg.stat().st_size
        start = keep_slots * SLOT
        if size > start:
            subprocess.run(["fallocate", "--punch-hole", "--offset", str(start), "--length", str(size - start),
                            str(seg)], check=True, capture_output=True, timeout=30)  # fmt: skip
            released += size - start
    return released


def disk_full(workdir: Path, seconds: float = 4.0, seed: int = 0) -> FaultResult:
    """ENOSPC on the NVMe tier: refused at start when the tier does not fit; at run time (free slots
    lose their blocks, then the filesystem is filled) Puts keep succeeding, demotions that cannot be
    written drop their page, nothing half-written is served, SIGTERM exits 0, and after space returns
    a restart serves every page it recovers byte for byte."""
    res = FaultResult("disk full (tmpfs NVMe dir, ENOSPC mid-write)")
    rng = random.Random(seed)
    mnt = workdir / "tmpfs"
    nvme_pages = 64
    with tmpfs(mnt, 48 * SLOT + (1 << 20)) as fs:
        # 1. a tier bigger than the filesystem: refused at start, with the numbers
        big = NodeProcess(dram_bytes=8 * SLOT, nvme_path=fs / "too-big", nvme_bytes=4 * nvme_pages * SLOT,
                          max_page_bytes=PAGE, node_id="full-start", env={"COLUMNS": "400"})  # fmt: skip
        try:
            big.start(timeout=30)
            res.errors += 1  # it should not have started
            res.notes["start_refusal"] = "node started on a filesystem too small"
        except RuntimeError:
            res.notes["start_refusal"] = [line for line in big.log_tail(10).splitlines() if "error" in line]
        finally:
            big.close()
        for p in (fs / "too-big").glob("*"):
            p.unlink()
        # 2. run time: the tier fits, then the disk fills under it
        nvme = fs / "nvme"
        node = NodeProcess(dram_bytes=8 * SLOT, nvme_path=nvme, nvme_bytes=40 * SLOT, max_page_bytes=PAGE,
                           node_id="full-run")  # fmt: skip
        acked: list[bytes] = []
        try:
            start_timed(node, res)
            with KVStoreClient(node.addr, timeout=30) as kv:
                for i in range(0, 16, CHAIN):  # 16 pages: 8 demoted to NVMe slots 0..7
                    keys = [key(i + j, "full") for j in range(CHAIN)]
                    put_chain(kv, keys)
                    acked += keys
                    res.requests += 1
                punch_free_slots(nvme, keep_slots=12)  # slots 8..11 still backed, 12.. holes
                filler = fill(fs)
                deadline = time.monotonic() + seconds
                n = 16
                while time.monotonic() < deadline and n < 4000:
                    keys = [key(n + j, "full") for j in range(CHAIN)]
                    try:
                        put_chain(kv, keys)
                        acked += keys
                    except KVStoreError as exc:
                        res.errors += 1
                        res.notes.setdefault("put_errors", []).append(str(exc)[:200])  # type: ignore[union-attr]
                    n += CHAIN
                    res.requests += 1
                    recent = acked[-8:]
                    _, _, corrupt = check_pages(kv, rng.sample(recent, min(4, len(recent))))
                    res.corrupt_served += corrupt
                    res.requests += 1
                nvme_stats = next(t for t in kv.stats().tiers if t.tier is TierKind.NVME)
                res.notes["nvme_detail"] = nvme_stats.detail
                res.notes["dropped"] = sum(t.counters.dropped for t in kv.stats().tiers)
            res.memory_peak_bytes = rss_peak(node_pid(node))
            res.notes["sigterm_exit_code"] = node.stop()
            if res.notes["sigterm_exit_code"] != 0:
                res.errors += 1
            filler.unlink()  # space comes back: the node restarts and serves what it recovers
            start_timed(node, res)
            with KVStoreClient(node.addr, timeout=30) as kv:
                present, _, corrupt = check_pages(kv, acked)
                res.corrupt_served += corrupt
                res.notes["recovered_after_full"] = len(present)
                res.notes["acked"] = len(acked)
        finally:
            node.close()
    res.rounds = 1
    return res


# ------------------------------------------------------------------ Redis outage


def redis_outage(workdir: Path, outages: int = 1, chains: int = 16, down_seconds: float = 2.0) -> FaultResult:
    """Redis killed (SIGKILL) under load and restarted empty on the same port: local reads keep being
    served while it is down; seconds until the index finds every chain again are the recovery time."""
    from kvstore.cli.redis_procs import RedisProcess
    from kvstore.client.cluster import ClusterClient
    from kvstore.index import IndexUnavailable

    res = FaultResult("Redis killed and restarted empty under load")
    all_keys = [[key(c * CHAIN + j, "redis") for j in range(CHAIN)] for c in range(chains)]
    with RedisProcess() as redis_proc:
        node = NodeProcess(dram_bytes=2 * chains * CHAIN * SLOT, node_id="redis-outage", redis_url=redis_proc.url,
                           max_page_bytes=PAGE, extra_args=["--index-ttl", "3"])  # fmt: skip
        try:
            node.start(timeout=60)
            with KVStoreClient(node.addr, timeout=30) as kv, ClusterClient(redis_proc.url, timeout=30) as cc:
                for keys in all_keys:
                    put_chain(kv, keys)
                _wait_index_whole(cc, all_keys, 30.0)
                for _ in range(outages):
                    redis_proc.kill()
                    down_until = time.monotonic() + down_seconds
                    unavailable = 0
                    while time.monotonic() < down_until:
                        keys = all_keys[res.requests % chains]
                        try:
                            pages = kv.get_pages(NS, keys, promote=True)
                            if len(pages) != CHAIN or any(
                                bytes(p.data) != content(h) for h, p in zip(keys, pages, strict=True)
                            ):
                                res.errors += 1
                        except KVStoreError:
                            res.errors += 1
                        res.requests += 1
                        try:
                            cc.lookup(NS, keys)
                        except IndexUnavailable:
                            unavailable += 1
                    res.notes["index_unavailable_answers"] = unavailable
                    redis_proc.start()
                    t0 = time.monotonic()
                    _wait_index_whole(cc, all_keys, 60.0, kv=kv, res=res)
                    res.recovery_seconds.append(time.monotonic() - t0)
                    res.rounds += 1
            res.memory_peak_bytes = rss_peak(node_pid(node))
        finally:
            node.close()
    return res


def _wait_index_whole(cc: object, chains: Iterable[list[bytes]], timeout: float, kv: KVStoreClient | None = None,
                      res: FaultResult | None = None) -> None:  # fmt: skip
    """Poll the index until every chain is found whole (local reads continue meanwhile, when given)."""
    from kvstore.index import IndexUnavailable

    chains = list(chains)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(cc.lookup(NS, c).matched == len(c) for c in chains):  # type: ignore[attr-defined]
                return
        except IndexUnavailable:
            pass
        if kv is not None and res is not None:
            try:
                kv.get_pages(NS, chains[0], promote=True)
            except KVStoreError:
                res.errors += 1
            res.requests += 1
        time.sleep(0.05)
    raise TimeoutError(f"index not whole again after {timeout}s")


# ------------------------------------------------------------------ slow and stalled consumers


def _mixed_ops(kv: KVStoreClient, chains: list[list[bytes]], seconds: float, salt: str,
               res: FaultResult) -> list[float]:  # fmt: skip
    """Lookup, Get and Put round robin for `seconds`; returns per-request latencies (s)."""
    lat: list[float] = []
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline and n < 100_000:
        chain = chains[n % len(chains)]
        t0 = time.perf_counter()
        try:
            if n % 3 == 0:
                kv.lookup(NS, chain)
            elif n % 3 == 1:
                pages = kv.get_pages(NS, chain, promote=False)
                res.corrupt_served += sum(bytes(p.data) != content(h) for h, p in zip(chain, pages, strict=False))
            else:
                put_chain(kv, [key(n * CHAIN + j, salt) for j in range(CHAIN)])
        except KVStoreError:
            res.errors += 1
        lat.append(time.perf_counter() - t0)
        n += 1
    res.requests += n
    return lat


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def slow_consumers(workdir: Path, stalled: int = 8, silent: int = 8, seconds: float = 3.0,
                   stream_pages: int = 256) -> FaultResult:  # fmt: skip
    """Get streams nobody reads and connections that say nothing, while another client works: its error
    count and p50/p99 against the same load just before (same run), and the node's RSS growth."""
    import socket

    import grpc

    from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
    from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    res = FaultResult("slow and stalled consumers")
    node = NodeProcess(dram_bytes=96 * SLOT, nvme_path=workdir / "nvme", nvme_bytes=(stream_pages + 4096) * SLOT,
                       max_page_bytes=PAGE, node_id="stalled")  # fmt: skip
    keys = [key(i, "stall") for i in range(stream_pages)]
    chains = [keys[i : i + CHAIN] for i in range(0, 64, CHAIN)]
    channels: list[grpc.Channel] = []
    socks: list[socket.socket] = []
    try:
        node.start(timeout=60)
        pid = node_pid(node)
        with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
            for c in range(0, stream_pages, CHAIN):
                put_chain(kv, keys[c : c + CHAIN])
            before = _mixed_ops(kv, chains, seconds, "stall-a", res)
            rss_before = rss_now(pid)
            for _ in range(stalled):
                ch = grpc.insecure_channel(node.addr)
                channels.append(ch)
                stream = pb_grpc.KVStoreStub(ch).Get(pb.GetRequest(namespace=NS, hashes=keys, no_promote=True),
                                                     timeout=600)  # fmt: skip
                next(stream)  # the first message, then never another read
            host, port = node.addr.rsplit(":", 1)
            for i in range(silent):
                s = socket.create_connection((host, int(port)), timeout=5)
                if i % 2:
                    s.sendall(b"PRI * HTTP/2.0\r\n")  # half a preface, then silence
                socks.append(s)
            during = _mixed_ops(kv, chains, seconds, "stall-b", res)
            rss_during = rss_now(pid)
        res.memory_peak_bytes = rss_peak(pid)
        for ch in channels:
            ch.close()
        for s in socks:
            s.close()
        channels.clear()
        socks.clear()
        with KVStoreClient(node.addr, timeout=30, transport="grpc") as kv:
            after = _mixed_ops(kv, chains, 1.0, "stall-c", res)
        res.rounds = 1
        res.notes = {
            "stalled_get_streams": stalled, "silent_connections": silent, "pages_per_stalled_stream": stream_pages,
            "p50_ms_before": round(_pct(before, 0.5) * 1e3, 2), "p99_ms_before": round(_pct(before, 0.99) * 1e3, 2),
            "p50_ms_during": round(_pct(during, 0.5) * 1e3, 2), "p99_ms_during": round(_pct(during, 0.99) * 1e3, 2),
            "requests_after_release": len(after), "rss_growth_bytes": rss_during - rss_before,
            "whole_ask_bytes": stalled * stream_pages * PAGE,  # what the stalled streams asked for in all
        }  # fmt: skip
        return res
    finally:
        for ch in channels:
            ch.close()
        for s in socks:
            s.close()
        node.close()


def flip_in_slab(pid: int, payload: bytes, page_hash: bytes, at: int = 0) -> int:
    """Flip one bit of a page held in a live node's host memory: byte `at` of its payload, in every slot image
    of that page in the process's private writable anonymous mappings (the DRAM slab, and any bounce copy),
    through /proc/<pid>/mem. Needs ptrace rights over `pid` (a parent over its child, or root).

    A slot image is the page's header block (MAGIC first, the page's hash in it) followed by the payload
    starting with `payload`'s bytes, so a stale copy of the bytes elsewhere (a freed receive buffer) is
    never touched. Returns how many images were flipped; LookupError when none was found."""
    needle = payload[:64]
    flipped = 0
    regions = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[1].startswith("rw"):  # no path: anonymous memory
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            regions.append((lo, hi))
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for lo, hi in regions:
            try:
                mem.seek(lo)
                data = mem.read(min(hi - lo, 1 << 30))  # bounded: test nodes are small
            except OSError:
                continue  # a guard page, or a mapping that went away
            i = data.find(needle, HEADER_BYTES)
            while i >= 0:
                header = data[i - HEADER_BYTES : i]
                if header.startswith(PAGE_MAGIC) and page_hash in header:
                    mem.seek(lo + i + at)
                    mem.write(bytes((data[i + at] ^ 0x01,)))
                    flipped += 1
                i = data.find(needle, i + 1)
    if not flipped:
        raise LookupError(f"no slot image of page {page_hash.hex()} in the anonymous memory of process {pid}")
    return flipped
