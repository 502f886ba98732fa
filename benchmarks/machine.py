"""What every benchmark prints about the machine it ran on (shared by the scripts in benchmarks/)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line() -> str:
    """`- Machine: <date> | <cpu>, <n> CPUs | <platform> | python <version>` for a results entry."""
    return (
        f"- Machine: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC} | {cpu_model()}, {os.cpu_count()} CPUs | "
        f"{platform.platform()} | python {platform.python_version()}"
    )


def save_results(out: Path, name: str, text: str, args: object, **payload: object) -> None:
    """Print the markdown table and write out/<name>.md and out/<name>.json (args stringified)."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, **payload}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2))


def memcpy_gbs(nbytes: int, reps: int) -> float:
    """The machine's own limit for moving `nbytes`: best of `reps` copies between two buffers, GB/s (1e9)."""
    src, dst = bytearray(b"\x5a" * nbytes), bytearray(nbytes)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class LoadLog:
    """The machine's 1-minute load average, sampled by a benchmark as it goes (`note()` at each run), so that
    its figures can be read beside how busy the machine was while they were measured."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.note()

    def note(self) -> float:
        load = os.getloadavg()[0]
        self.samples.append(load)
        return load

    def span(self) -> str:
        """`load average 5.1-9.8 (1-min, N samples; 2 CPUs)`: what the figures' readers need to judge them."""
        self.note()
        lo, hi = min(self.samples), max(self.samples)
        rng = f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}"
        return f"load average {rng} (1-min, {len(self.samples)} samples; {os.cpu_count()} CPUs)"
