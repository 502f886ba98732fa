"""What the code cites is in the tree: every `DESIGN.md §N` names a section of DESIGN.md, and no source file
cites an issue number (an issue is gone when it closes; the design document stays).

Reads files as text (no import runs); covers the package, the workers, the dev kit, the benchmarks, the tools,
the Helm chart and the top-level documents.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("kvstore", "workers", "devkit", "benchmarks", "tools", "helm", "tests")
DOCS = ("README.md", "SECURITY.md", "kvstore/README.md", "benchmarks/RESULTS.md")
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".tpl", ".proto", ".cu", ".json", ".txt"}
CITE = re.compile(r"DESIGN(?:\.md)?\s*§\s*(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)?)\.?\s", re.MULTILINE)
# "issue 32", "issue #32", "(#32)": how a tracker number reads in prose; a GitHub issue of another project is
# cited with its repository ("vllm-project/vllm#123"), which this leaves alone.
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+\b")


def _files() -> list[Path]:
    """The tree's own files (tracked, or new and not ignored): never a venv or a build beside them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SOURCES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split("\n")
    paths = [ROOT / line for line in listed if line and Path(line).suffix in SUFFIXES]
    return [ROOT / d for d in DOCS] + [p for p in paths if p.is_file()]


def design_sections() -> set[str]:
    """The section numbers DESIGN.md has ("8", "8.3", ...)."""
    return set(HEADING.findall((ROOT / "DESIGN.md").read_text()))


def test_design_md_has_numbered_sections() -> None:
    sections = design_sections()
    assert {"1", "8", "8.3", "13"} <= sections


def test_every_design_citation_names_a_section_that_exists() -> None:
    sections = design_sections()
    dangling = []
    for path in _files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            dangling += [f"{path.relative_to(ROOT)}:{n}: §{s}" for s in CITE.findall(line) if s not in sections]
    assert not dangling, "citations of DESIGN.md sections it does not have:\n" + "\n".join(dangling)


def test_no_source_file_cites_an_issue_number() -> None:
    cited = []
    for path in _files():
        if path.suffix not in {".py", ".sh", ".yaml", ".yml", ".tpl", ".proto", ".cu"}:
            continue  # NOTE: documents may tell history (RESULTS-archive.md); code states what holds now
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ISSUE.search(line) and path.name != Path(__file__).name:
                cited.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not cited, "code citing an issue number instead of a DESIGN.md section:\n" + "\n".join(cited)
