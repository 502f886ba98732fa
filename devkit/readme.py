"""The commands of the top-level README, as argv lists, for the tests that check each one (tests/unit,
tests/integration and tests/engines `test_readme_*`).

A fenced block is split into commands: backslash continuations and quoted strings that go on over lines
joined, `# comments` dropped, leading
`VAR=value` assignments taken as the command's environment. The README writes optional flags as `[--flag v]`
and alternatives as `a|b`: `variants` expands them into every argv a reader could type.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_ALTERNATIVES = re.compile(r"^[\w.-]+(\|[\w.-]+)+$")


@dataclass(frozen=True, slots=True)
class Block:
    lang: str
    line: int  # README line of the opening fence
    text: str


@dataclass(frozen=True, slots=True)
class Command:
    line: int  # README line the command starts on
    text: str  # as written, continuations joined
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def program(self) -> str:
        """The program's name without a path (`.venv/bin/kvctl` -> `kvctl`; `./dev` stays `./dev`)."""
        return self.argv[0] if self.argv[0].startswith("./") else self.argv[0].rsplit("/", 1)[-1]

    def variants(self) -> list[list[str]]:
        """Every argv the README's `[optional]` and `a|b` notation stands for (all options given)."""
        tokens = [t.removeprefix("[").removesuffix("]") for t in self.argv]
        choices = [t.split("|") if _ALTERNATIVES.match(t) else [t] for t in tokens]
        return [list(c) for c in itertools.product(*choices)]


def blocks(path: Path = README) -> list[Block]:
    text = path.read_text()
    return [Block(m.group(1), text[: m.start()].count("\n") + 1, m.group(2)) for m in _FENCE.finditer(text)]


def commands(block: Block) -> list[Command]:
    """The shell commands of a bash block."""
    out: list[Command] = []
    pending, start = "", 0
    for i, raw in enumerate(block.text.splitlines(), block.line + 1):
        if not pending:
            start = i
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quoted string (JSON) goes on on the next line
            pending += "\n"
            continue
        text, pending = pending.strip(), ""
        if not words:
            continue
        env = {}
        while words and _ASSIGN.match(words[0]):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        out.append(Command(start, text, words, env))
    return out


def all_commands(path: Path = README) -> list[Command]:
    return [c for b in blocks(path) if b.lang == "bash" for c in commands(b)]
