"""Every module and entry point of this checkout, found from the files themselves, and an import of all of
them in one interpreter (tests/unit/test_entry_points.py; tests/engines for the modules that need an engine).

What counts, so that nothing a README or a user runs is left out by a hand-kept list:
- modules: every `*.py` under kvstore/, workers/ and devkit/ (as packages), and every benchmarks/*.py
  (scripts: imported by file stem with benchmarks/ on sys.path, as they import each other);
- console scripts: `[project.scripts]` of pyproject.toml, and the commands other packages add to `kvstore`
  (the "kvstore.cli" entry-point group);
- `python -m` modules: a package's `__main__.py`, and every module of the packages with an
  `if __name__ == "__main__":` block;
- benchmark scripts: every benchmarks/*.py with such a block.

    python -m devkit.entry_points [MODULE ...]     import them (default: all), print JSON {module: error}

The import runs each module once, in this process, and reports every failure rather than the first one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "workers", "devkit")
BENCHMARKS = REPO / "benchmarks"
_MAIN_BLOCK = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.MULTILINE)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> list[str]:
    """Every module of the packages, dotted; `__main__` modules are left out (importing one runs it:
    they are run as `python -m PACKAGE --help` instead)."""
    return [_module_name(p) for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")) if p.stem != "__main__"]


def benchmark_modules() -> list[str]:
    """Every benchmarks/*.py, by file stem (they are scripts, not a package)."""
    return [p.stem for p in sorted(BENCHMARKS.glob("*.py"))]


def all_modules() -> list[str]:
    return package_modules() + benchmark_modules()


def _has_main_block(path: Path) -> bool:
    return bool(_MAIN_BLOCK.search(path.read_text()))


def python_m_modules() -> list[str]:
    """What `python -m NAME` runs: packages with a `__main__.py`, and modules with a `__main__` block."""
    out = []
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            if p.stem == "__main__":
                out.append(_module_name(p.parent))
            elif _has_main_block(p):
                out.append(_module_name(p))
    return out


def benchmark_scripts() -> list[Path]:
    """benchmarks/*.py that run as scripts (the rest are helpers the scripts import)."""
    return [p for p in sorted(BENCHMARKS.glob("*.py")) if _has_main_block(p)]


@dataclass(frozen=True, slots=True)
class ConsoleEntryPoints:
    scripts: dict[str, str]  # console script name -> "module:function"
    kvstore_commands: dict[str, str]  # `kvstore NAME` added through the "kvstore.cli" group -> "module:function"


def console_entry_points(pyproject: Path = REPO / "pyproject.toml") -> ConsoleEntryPoints:
    """What pyproject.toml declares (not what some installed copy says)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return ConsoleEntryPoints(
        scripts=dict(project.get("scripts", {})),
        kvstore_commands=dict(project.get("entry-points", {}).get("kvstore.cli", {})),
    )


def import_all(modules: list[str]) -> dict[str, str]:
    """Import each module; {module: "ExceptionType: message"} for every one that failed."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other by stem (`from machine import ...`)
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # SystemExit and friends are failures to report too
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.entry_points", description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help="dotted module names, or benchmark stems (default: every module)")
    args = ap.parse_args(argv)
    print(json.dumps(import_all(args.modules or all_modules())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
