"""Every module imports and every entry point answers `--help`, as a user would run it.

The lists come from the files (devkit/entry_points.py), not from a hand-kept table: a new module, console
script, `kvstore` command, `python -m` module or benchmark script is checked the day it is added. A module
moved without its importers being updated (the engine demo once imported a module that had moved) fails
here instead of in front of a user.

Modules that need an engine's own packages (vLLM; LMCache where `./dev test` has not installed it) cannot
import in the project's venv; tests/engines/test_engine_demo.py imports them in the engine venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from devkit.entry_points import (
    REPO,
    all_modules,
    benchmark_scripts,
    console_entry_points,
    python_m_modules,
)

# Packages only an engine's environment has: a module that needs one is imported in the engine venv instead.
ENGINE_PACKAGES = ("vllm", "lmcache")
HELP_TIMEOUT_S = 120  # a --help that imports torch and transformers takes seconds on a busy 2-core box


def _env() -> dict[str, str]:
    """This checkout first on the path, whatever copy the venv has installed."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def run_help(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*args, "--help"], check=False, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=HELP_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip


def assert_help(args: list[str]) -> None:
    r = run_help(args)
    shown = " ".join(str(a) for a in args)
    assert r.returncode == 0, f"`{shown} --help` exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "usage" in r.stdout.lower(), f"`{shown} --help` printed no usage:\n{r.stdout[-2000:]}"


def engine_side(error: str) -> bool:
    """A failure that only says an engine's own package is not installed here."""
    return any(error == f"ModuleNotFoundError: No module named '{p}'" for p in ENGINE_PACKAGES)


def test_every_module_imports() -> None:
    """One fresh interpreter imports every module of kvstore/, workers/, devkit/ and benchmarks/."""
    r = subprocess.run([sys.executable, "-m", "devkit.entry_points"], check=False, cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    failed = json.loads(r.stdout.strip().splitlines()[-1])
    broken = {m: e for m, e in failed.items() if not engine_side(e)}
    assert not broken, "modules that do not import:\n" + "\n".join(f"  {m}: {e}" for m, e in broken.items())


def test_the_lists_find_what_they_should() -> None:
    """Guards the discovery itself: a list that quietly came back empty would pass every test below."""
    mods = all_modules()
    assert {"kvstore.cli.launch", "workers.actors", "devkit.engine_demo", "machine", "l2_bench"} <= set(mods)
    assert "kvstore.__main__" not in mods  # importing it runs the CLI
    assert {"kvstore", "kvstore.cli.main", "devkit.engine_demo"} <= set(python_m_modules())
    eps = console_entry_points()
    assert {"kvstore", "kvctl"} <= set(eps.scripts) and "generate" in eps.kvstore_commands
    assert {p.name for p in benchmark_scripts()} >= {"l2_bench.py", "peer_driver.py"}
    assert "machine.py" not in {p.name for p in benchmark_scripts()}  # a helper, not a script


def _script(name: str) -> str:
    """The venv's console script: the installed entry point itself, as a user's shell finds it."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.fail(f"console script {name} is not installed in {path.parent}: run ./dev setup", pytrace=False)
    return str(path)


def _command_paths(group: typer.Typer) -> list[list[str]]:
    """Every command and nested command of a typer app, as argument paths."""
    import click

    out: list[list[str]] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        out.append(path)
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk(sub, [*path, name])

    walk(typer.main.get_command(group), [])
    return out


def _cli_cases() -> list[tuple[str, list[str]]]:
    from kvstore.cli.kvctl import app as kvctl_app
    from kvstore.cli.main import app as kvstore_app

    apps = {"kvstore": kvstore_app, "kvctl": kvctl_app}
    scripts = console_entry_points().scripts
    assert set(scripts) == set(apps), f"pyproject.toml's console scripts {sorted(scripts)} changed: update {__file__}"
    return [(name, path) for name, app in apps.items() for path in _command_paths(app)]


@pytest.mark.parametrize(("script", "path"), _cli_cases(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_console_script_help(script: str, path: list[str]) -> None:
    """`kvstore --help`, `kvstore serve --help`, `kvctl stats --help`, ... through the installed scripts."""
    assert_help([_script(script), *path])


@pytest.mark.parametrize("command", sorted(console_entry_points().kvstore_commands))
def test_commands_other_packages_add_to_kvstore_are_there(command: str) -> None:
    """`kvstore generate` and the other "kvstore.cli" entry points: `kvstore` drops a command whose module
    fails to import (an extra that is not installed), so each is asked for by name."""
    assert_help([_script("kvstore"), command])


@pytest.mark.parametrize("module", python_m_modules())
def test_python_m_help(module: str) -> None:
    assert_help([sys.executable, "-m", module])


@pytest.mark.parametrize("script", benchmark_scripts(), ids=lambda p: p.name)
def test_benchmark_script_help(script: Path) -> None:
    """Each benchmark as its docstring says to run it: `python benchmarks/NAME.py`."""
    assert_help([sys.executable, str(script.relative_to(REPO))])
