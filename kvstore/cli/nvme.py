"""`kvstore nvme check|repair`: inspect and repair an NVMe tier directory while its node is stopped.

check   reads the metadata file and the header blocks of every chunk (its first block, then the slots of
        the size it names); exit 1 when something needs repair.
repair  rebuilds the metadata file from the segment files and page headers under the geometry given
        (the one the node will run with) or the directory's own, when its file is intact; erases headers
        that fail their check and the page a truncation cut in two; adopts an older build's fixed-slot
        files as a node does at its first start (kvstore/tiers/nvme_meta.py); and, with
        --discard-foreign, reformats segment files that are not ours.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated

import typer

from kvstore.cli.common import friendly_errors
from kvstore.config import NodeConfig, parse_size
from kvstore.pageformat import FORMAT_VERSION, HEADER_BYTES, slot_bytes_for
from kvstore.tiers import nvme_meta as nm

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Check or repair an NVMe tier directory (stop its node first)."
)

_DEFAULT_SEGMENT_BYTES: int = next(f.default for f in dataclasses.fields(NodeConfig) if f.name == "nvme_segment_bytes")  # type: ignore[assignment]
PathOpt = Annotated[Path, typer.Option(help="the node's --nvme-path directory")]
SizeOpt = Annotated[str | None, typer.Option(help="bytes, or with a unit: 2MiB (the node's value)", show_default=False)]


def _geometry(max_page_bytes: str | None, segment_bytes: str | None) -> nm.Geometry | None:
    if max_page_bytes is None:
        return None
    chunk = slot_bytes_for(parse_size(max_page_bytes))
    seg = parse_size(segment_bytes) if segment_bytes else _DEFAULT_SEGMENT_BYTES
    return nm.Geometry(chunk, max(1, seg // chunk))


def _read_meta(path: Path) -> tuple[nm.Geometry | None, str]:
    meta = path / nm.META_NAME
    if not meta.exists():
        return None, "missing"
    try:
        geom = nm.decode_meta(meta.read_bytes())
    except nm.MetaDamaged as exc:
        return None, f"damaged: {exc}"
    return geom, "ok (an older build's fixed slots: adopted at the next start)" if geom.legacy else "ok"


def _survey(path: Path, geom: nm.Geometry, trusted: bool) -> tuple[nm.Geometry, list[nm.SegmentSurvey]]:
    """The survey under `geom`; a geometry not read from an intact metadata file (`trusted` False) is taken
    as an older build's (legacy) unless some chunk holds a marker, as a node rebuilding it does."""
    segs = nm.survey(path, geom)
    if not trusted and not geom.legacy and not any(s.counts[nm.SlotState.CHUNK] for s in segs):
        geom = nm.Geometry(geom.chunk_bytes, geom.chunks_per_segment, legacy=True)
        segs = nm.survey(path, geom)
    return geom, segs


def _report(path: Path, meta_state: str, geom: nm.Geometry, segs: list[nm.SegmentSurvey]) -> dict[str, object]:
    return {
        "path": str(path),
        "metadata": meta_state,
        "chunk_bytes": geom.chunk_bytes,
        "chunks_per_segment": geom.chunks_per_segment,
        "legacy": geom.legacy,
        "segments": [
            {
                "file": s.name,
                "bytes": s.size,
                "chunks": s.chunks,
                "chunk_sizes": {str(k): n for k, n in sorted(s.classes.items())},
                "cut_mid_chunk": s.cut,
                "foreign_file": s.foreign,
                "slots": {st.value: n for st, n in s.counts.items()},
                "page_formats": {str(v): n for v, n in sorted(s.formats.items())},
            }
            for s in segs
        ],
    }


@app.command("check")
@friendly_errors
def check(
    nvme_path: PathOpt,
    max_page_bytes: SizeOpt = None,
    nvme_segment_bytes: SizeOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Report the metadata file and what every slot holds; exit 1 when `kvstore nvme repair` is needed."""
    if not nvme_path.is_dir():
        raise ValueError(f"--nvme-path {nvme_path}: not a directory")
    have, state = _read_meta(nvme_path)
    geom = have or _geometry(max_page_bytes, nvme_segment_bytes)
    if geom is None:
        raise ValueError(
            f"{nvme_path / nm.META_NAME} is {state}: pass --max-page-bytes (and --nvme-segment-bytes if "
            "not the default) to check the segments under the node's geometry"
        )
    geom, segs = _survey(nvme_path, geom, have is not None)
    report = _report(nvme_path, state, geom, segs)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
    else:
        typer.echo(
            f"{nvme_path}: metadata {state}; chunks of {geom.chunk_bytes} B, {geom.chunks_per_segment} chunks/segment"
        )
        for s in segs:
            counts = ", ".join(f"{n} {st.value}" for st, n in s.counts.items() if n)
            sizes = ", ".join(f"{n} of {k} B slots" for k, n in sorted(s.classes.items()))
            notes = (" CUT MID-CHUNK" if s.cut else "") + (" FOREIGN" if s.foreign else "")
            older = sum(n for v, n in s.formats.items() if v < FORMAT_VERSION)
            if older:  # verified the old way (payload only) until written anew: kvstore/pageformat.py
                notes += f"; {older} page(s) in an older format (payload-only checksums)"
            typer.echo(
                f"  {s.name}: {s.size} B, {s.chunks} chunks ({sizes or 'none laid out'}); "
                f"header blocks: {counts or 'none'}{notes}"
            )
    healthy = state != "missing" and not state.startswith("damaged") and not any(s.cut or s.foreign for s in segs)
    raise SystemExit(0 if healthy else 1)


@app.command("repair")
@friendly_errors
def repair(
    nvme_path: PathOpt,
    max_page_bytes: Annotated[str, typer.Option(help="the node's --max-page-bytes (sets the chunk size)")],
    nvme_segment_bytes: SizeOpt = None,
    discard_foreign: Annotated[
        bool, typer.Option(help="reformat segment files that hold no page of ours (their contents are lost)")
    ] = False,
) -> None:
    """Rebuild the metadata file from the segment files and page headers, erasing what fails its check."""
    if not nvme_path.is_dir():
        raise ValueError(f"--nvme-path {nvme_path}: not a directory")
    want = _geometry(max_page_bytes, nvme_segment_bytes)
    assert want is not None
    have, state = _read_meta(nvme_path)
    if have is not None and have.chunk_bytes < want.chunk_bytes:
        raise nm.NvmeFormatError(
            f"{nvme_path} is formatted with {have.as_dict()} (intact): chunks too small for pages of "
            f"{max_page_bytes}; pass the node's --max-page-bytes, or use an empty directory"
        )
    geom, segs = _survey(nvme_path, have or want, have is not None)
    foreign = [s for s in segs if s.foreign]
    if foreign and not discard_foreign:
        raise nm.NvmeFormatError(nm.foreign_message(nvme_path, foreign[0]))
    erased = 0
    for s in segs:
        erased += _erase(nvme_path / s.name, geom, s)
    nm.write_meta(nvme_path, nm.Geometry(geom.chunk_bytes, geom.chunks_per_segment))
    pages = sum(s.counts[nm.SlotState.PAGE] for s in segs if not s.foreign)
    typer.echo(
        f"{nvme_path}: metadata was {state}, rewritten; {len(segs)} segment file(s), {pages} page header(s) "
        f"kept, {erased} header block(s) erased" + (f", {len(foreign)} foreign file(s) reformatted" if foreign else "")
    )


def _erase(file: Path, geom: nm.Geometry, seg: nm.SegmentSurvey) -> int:
    """Zero the header blocks the survey named (`SegmentSurvey.erase`), or, for a foreign file, the first block
    of every chunk that is not blank; returns how many, fsynced."""
    size = file.stat().st_size
    zero = bytes(HEADER_BYTES)
    erased = 0
    with open(file, "r+b") as f:
        offsets = seg.erase
        if seg.foreign:
            offsets = []
            for base in range(0, size, geom.chunk_bytes):
                f.seek(base)
                if nm.classify(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"))[0] is not nm.SlotState.BLANK:
                    offsets.append(base)
        for off in offsets:
            if off < size:
                f.seek(off)
                f.write(zero[: min(HEADER_BYTES, size - off)])
                erased += 1
        f.flush()
        os.fsync(f.fileno())
    return erased
