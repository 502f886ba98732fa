"""What a policy's bookkeeping costs per event, in process: every policy on the workload suite.

What is measured
    The policy alone, not the simulator around it. For each policy, workload and capacity, the
    simulated cache (devkit.sim.TieredBlockCache, one tier, admission on: what a node does) is run
    once with the policy behind a recorder that writes down every call the cache makes on it, with
    its arguments: on_insert (with parent and reads), on_access, on_remove, refuses (the refusal
    asked before a victim is chosen, for a policy that has it), admit (with the victim) and the victim
    query (first_candidate, with the set of keys pinned at that moment). The recorded
    stream is then replayed against a fresh instance of the same policy, --runs times; every answer
    (victim, admit verdict) must equal the recorded one, or the run fails (the replay is the same
    work, decision for decision). The time of a replay, less the time of the same loop over a
    policy that does nothing, divided by the number of calls, is the cost per event; divided by
    the block references of the workload, the cost per block reference (a cached block is one
    access; a missing block in a full tier is a victim query, an admit and, when admitted, a remove
    and an insert; or, refused whatever the victim, one refuses). Both are reported. Per event
    depends on how a policy splits its work into calls (a refusal before the victim is one call
    where a victim query and an admit were two; a policy that admits less makes fewer inserts and
    removes); per block reference does not, so compare designs by it.

Reference (same run)
    `lru` (an OrderedDict move: about the least any policy can cost in Python) and `prefix-arc`.

Method
    time.perf_counter around each replay; the median of --runs (default 5) after one warm-up
    replay (the one that checks the decisions); garbage collection off while timing. Within a cell
    the policies and the empty loop take turns replay by replay, in a rotating order, so a change of
    the machine's speed (a shared VM's speed moves by up to 1.7x from minute to minute) hits them
    alike: compare the policies of one cell, or each one's ratio to prefix-arc (the issue's yardstick),
    rather than absolute figures across runs. Keys are the node's own keys, (namespace, 32-byte
    hash) tuples (benchmarks/node_replay.py), so hashing costs what it costs on a node.

Run:  .venv/bin/python benchmarks/policy_bench.py [--workloads conversation,chat,...] [--fractions 0.02,0.1,0.3]
          [--policy all|NAME,...] [--size full|smoke] [--runs 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path

from machine import machine_line, save_results
from node_replay import node_requests

from devkit.sim import TieredBlockCache, replay
from devkit.workloads import WORKLOADS, Size, generate
from kvstore.policy import POLICIES, EvictionPolicy, first_usable, make_policy, refused_outright, should_admit

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
INSERT, ACCESS, REMOVE, ADMIT, VICTIM, REFUSES = range(6)
Event = tuple  # (op, key, ...); see Recorder


class Recorder:
    """A policy behind a tape: forwards every call and appends (op, arguments..., answer) to `tape`.
    The victim query records the cache's pinned set at that moment (TieredBlockCache._pinned: the
    blocks of the request being served), so a replay can ask the same question."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.tape: list[Event] = []
        self.cache: TieredBlockCache | None = None
        if getattr(policy, "refuses", None) is not None:  # NOTE: only then does refused_outright ask it
            self.refuses = self._refuses

    def on_insert(self, key: Hashable, parent: Hashable | None = None, reads: int = 0) -> None:
        self.tape.append((INSERT, key, parent, reads))
        self.policy.on_insert(key, parent=parent, reads=reads)  # type: ignore[call-arg]

    def on_access(self, key: Hashable) -> None:
        self.tape.append((ACCESS, key))
        self.policy.on_access(key)

    def on_remove(self, key: Hashable) -> None:
        self.tape.append((REMOVE, key))
        self.policy.on_remove(key)

    def _refuses(self, key: Hashable, parent: Hashable | None = None) -> bool:
        no = refused_outright(self.policy, key, parent)
        self.tape.append((REFUSES, key, parent, no))
        return no

    def admit(self, key: Hashable, victim: Hashable | None, parent: Hashable | None = None) -> bool:
        ok = should_admit(self.policy, key, victim, parent)
        self.tape.append((ADMIT, key, victim, parent, ok))
        return ok

    def first_candidate(self, usable: Callable[[Hashable], bool]) -> Hashable | None:
        assert self.cache is not None
        found = first_usable(self.policy, usable)
        self.tape.append((VICTIM, self.cache._pinned, found))
        return found

    def candidates(self) -> Iterator[Hashable]:
        return self.policy.candidates()

    def __len__(self) -> int:
        return len(self.policy)


class Nothing:
    """A policy that does nothing: the cost of the replay loop itself."""

    name = "nothing"

    def on_insert(self, key: Hashable, parent: Hashable | None = None, reads: int = 0) -> None:
        pass

    def on_access(self, key: Hashable) -> None:
        pass

    def on_remove(self, key: Hashable) -> None:
        pass

    def admit(self, key: Hashable, victim: Hashable | None, parent: Hashable | None = None) -> bool:
        return True

    def refuses(self, key: Hashable, parent: Hashable | None = None) -> bool:
        return False

    def first_candidate(self, usable: Callable[[Hashable], bool]) -> Hashable | None:
        return None


def record(requests: Sequence[Sequence[Hashable]], capacity: int, policy: str) -> list[Event]:
    """The calls a one-tier simulated cache of `capacity` makes on `policy` over `requests`."""
    rec: Recorder | None = None

    def factory() -> EvictionPolicy:
        nonlocal rec
        rec = Recorder(make_policy(policy))
        return rec  # type: ignore[return-value]

    cache = TieredBlockCache(capacity, factory)
    assert rec is not None
    rec.cache = cache
    replay(requests, cache)
    return rec.tape


def play(tape: Sequence[Event], policy: object, check: bool) -> float:
    """Replay `tape` against `policy`; seconds. With `check`, every answer must equal the tape's."""
    on_insert, on_access, on_remove = policy.on_insert, policy.on_access, policy.on_remove  # type: ignore[attr-defined]
    admit = policy.admit if hasattr(policy, "admit") else None  # type: ignore[attr-defined]
    fast = getattr(policy, "first_candidate", None)
    refuses = getattr(policy, "refuses", None)
    gc.disable()
    try:
        t0 = time.perf_counter()
        for ev in tape:
            op = ev[0]
            if op == ACCESS:
                on_access(ev[1])
            elif op == INSERT:
                on_insert(ev[1], parent=ev[2], reads=ev[3])
            elif op == REMOVE:
                on_remove(ev[1])
            elif op == ADMIT:
                ok = True if admit is None else admit(ev[1], ev[2], ev[3])
                if check and bool(ok) != ev[4]:
                    raise AssertionError(f"{policy}: admit({ev[1]!r}) answered {ok}, recorded {ev[4]}")
            elif op == REFUSES:
                no = refuses(ev[1], ev[2])  # type: ignore[misc]  # NOTE: only policies with it record one
                if check and bool(no) != ev[3]:
                    raise AssertionError(f"{policy}: refuses({ev[1]!r}) answered {no}, recorded {ev[3]}")
            else:
                if fast is not None:
                    got = fast(lambda k, pinned=ev[1]: k not in pinned)
                else:
                    got = next((k for k in policy.candidates() if k not in ev[1]), None)  # type: ignore[attr-defined]
                if check and got != ev[2]:
                    raise AssertionError(f"{policy}: victim {got!r}, recorded {ev[2]!r}")
        return time.perf_counter() - t0
    finally:
        gc.enable()


def measure(tapes: dict[str, Sequence[Event]], runs: int) -> dict[str, float]:
    """Per policy, the median seconds of `runs` replays of its tape on fresh instances of it, less the
    median of `runs` replays of the same tape by the empty loop; after one checked warm-up each, every
    replay of the cell taking turns in a rotating order (see Method)."""
    for pol, tape in tapes.items():
        play(tape, make_policy(pol), check=True)
    turns = [(pol, empty) for pol in tapes for empty in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {t: [] for t in turns}
    for r in range(runs):
        k = r % len(turns)
        for pol, empty in turns[k:] + turns[:k]:
            policy = Nothing() if empty else make_policy(pol)
            times[(pol, empty)].append(play(tapes[pol], policy, check=False))
    med = {t: statistics.median(v) for t, v in times.items()}
    return {pol: max(0.0, med[(pol, False)] - med[(pol, True)]) for pol in tapes}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="conversation,chat,rag,agent,batch,tenants,agentic",
                    help=f"comma-separated, from {sorted(WORKLOADS)}")  # fmt: skip
    ap.add_argument("--fractions", default="0.02,0.1,0.3", help="capacities as fractions of each working set")
    ap.add_argument("--policy", default="all", help=f"'all' or comma-separated names from {sorted(POLICIES)}")
    ap.add_argument("--size", choices=["full", "smoke"], default="full", help="workload size (default full)")
    ap.add_argument("--runs", type=int, default=5, help="timed replays per cell (median; default 5)")
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"directory for policy_bench.{{json,md}} ({DEFAULT_OUT})"
    )
    args = ap.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known: {sorted(WORKLOADS)}")
    policies = (
        sorted(POLICIES) if args.policy == "all" else [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    )
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"--policy: unknown {bad}; known: {sorted(POLICIES)}")
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError:
        raise SystemExit(f"--fractions: {args.fractions!r} is not a comma-separated list of numbers") from None
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise SystemExit(f"--fractions: each must be in (0, 1], got {args.fractions!r}")
    if args.runs < 1:
        raise SystemExit(f"--runs must be >= 1, got {args.runs}")

    rows = []
    print(f"# policy_bench {machine_line()[2:]}", flush=True)
    for name in names:
        requests = node_requests(generate(name, size=Size(args.size)))
        refs = sum(map(len, requests))
        counts: dict[Hashable, int] = {}
        for r in requests:
            for b in r:
                counts[b] = counts.get(b, 0) + 1
        ws = sum(1 for n in counts.values() if n > 1)
        for frac in fractions:
            cap = max(1, int(frac * ws))
            tapes = {pol: record(requests, cap, pol) for pol in policies}
            spent = measure(tapes, args.runs)
            for pol, tape in tapes.items():
                n, secs = max(len(tape), 1), spent[pol]
                row = {"workload": name, "capacity": cap, "fraction": frac, "policy": pol, "events": len(tape),
                       "block_refs": refs, "us_per_event": 1e6 * secs / n, "us_per_block": 1e6 * secs / max(refs, 1)}  # fmt: skip
                rows.append(row)
                print(f"  {name:>12} {cap:>6} {pol:<13} {row['us_per_event']:6.2f} us/event "
                      f"{row['us_per_block']:6.2f} us/block ({len(tape)} events)", flush=True)  # fmt: skip
    lines = ["# policy_bench: bookkeeping per event and per block reference, in process", "", machine_line()]
    by = {(r["workload"], r["capacity"], r["policy"]): r for r in rows}
    for unit, what in (("us_per_event", "event"), ("us_per_block", "block reference")):
        lines += ["", f"Microseconds per {what}:", "",
                  "| workload | capacity | " + " | ".join(policies) + " |", "|---|--:|" + "--:|" * len(policies)]  # fmt: skip
        for name in names:
            for cap in sorted({r["capacity"] for r in rows if r["workload"] == name}):
                cells = [f"{by[(name, cap, p)][unit]:.2f}" for p in policies]
                lines.append(f"| {name} | {cap} | " + " | ".join(cells) + " |")
        mean = {p: statistics.fmean(r[unit] for r in rows if r["policy"] == p) for p in policies}
        lines += ["", f"Mean over the cells (us per {what}): " + ", ".join(f"{p} {v:.2f}" for p, v in mean.items())]
        if "prefix-arc" in policies:
            ratio = {p: statistics.fmean(by[(r["workload"], r["capacity"], p)][unit] / max(r[unit], 1e-9)
                                         for r in rows if r["policy"] == "prefix-arc") for p in policies}  # fmt: skip
            lines += ["", f"Mean over the cells of the ratio to prefix-arc in the same cell, per {what}: "
                      + ", ".join(f"{p} {v:.2f}x" for p, v in ratio.items())]  # fmt: skip
    lines.append("")
    save_results(args.out, "policy_bench", "\n".join(lines), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
