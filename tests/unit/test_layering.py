"""The layer map of kvstore/README.md, checked: imports point down, and no module imports itself back.

Reads every module under kvstore/ with `ast` (no import runs): module-level, function-level and
`if TYPE_CHECKING:` imports of kvstore modules count alike (a lazy or a typing-only import hides a
circle, it does not remove it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvstore"

# Layers, lowest first: a module may import its own layer and the ones below, never one above.
# Side packages (client, node) are one layer: neither imports the other.
LAYERS: list[tuple[str, ...]] = [
    # shared and pure: what both sides of the wire agree on
    ("kvstore.names", "kvstore.hashing", "kvstore.layout", "kvstore.pageformat", "kvstore.errors", "kvstore.scoping",
     "kvstore.addresses", "kvstore.stats", "kvstore.memtune", "kvstore.pointers", "kvstore.security", "kvstore.wire",
     "kvstore._proto",
     "kvstore.index.keys", "kvstore.index.lookup", "kvstore.index.acl", "kvstore.index.choose", "kvstore"),
    ("kvstore.tiers", "kvstore.policy", "kvstore.config", "kvstore.node.heat"),
    ("kvstore.manager",),
    ("kvstore.node", "kvstore.client", "kvstore.index"),
    ("kvstore.replication",),  # node to node: above both sides (the node's CLI attaches it)
    ("kvstore.integrations", "kvstore.cli", "kvstore.__main__"),
]  # fmt: skip
APART = [("kvstore.client", "kvstore.node")]  # same layer, never importing each other
# The map's other rules (kvstore/README.md), each a module prefix that never imports another, wherever they sit.
NEVER = [
    ("kvstore.manager", "kvstore.node"),  # the manager never imports node/ (its config lives below both)
    ("kvstore.tiers", "kvstore.manager"),  # tiers never import the manager
    ("kvstore.client", "kvstore.tiers"),  # clients and the index reader never import tiers/
    ("kvstore.client", "kvstore.manager"),
    ("kvstore.index.reader", "kvstore.tiers"),
    ("kvstore.integrations", "kvstore.node"),  # integrations use the public client API only
    ("kvstore.integrations", "kvstore.manager"),
    ("kvstore.integrations", "kvstore.tiers"),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if "_proto" not in p.parts}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The kvstore modules `name` imports (a `from pkg import sub` of a submodule counts as that submodule)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvstore"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if not base.startswith("kvstore"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m != name}


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    names = set(mods)
    return {
        n: {m for m in imports_of(n, p, names) if m in names or m.startswith("kvstore._proto")} for n, p in mods.items()
    }


def layer_of(mod: str) -> tuple[int, str]:
    best = (-1, "")
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > len(best[1]):
                best = (rank, p)
    assert best[0] >= 0, f"{mod} is in no layer of the map: add it to LAYERS (and kvstore/README.md)"
    return best


def test_imports_point_down_the_layer_map() -> None:
    wrong = []
    for mod, deps in graph().items():
        rank, _ = layer_of(mod)
        for dep in deps:
            drank, _ = layer_of(dep)
            if drank > rank:
                wrong.append(f"{mod} (layer {rank}) imports {dep} (layer {drank})")
            for a, b in APART:
                for x, y in ((a, b), (b, a)):
                    if mod.startswith(x + ".") and (dep == y or dep.startswith(y + ".")):
                        wrong.append(f"{mod} imports {dep}: {x} and {y} never import each other")
            for x, y in NEVER:
                if (mod == x or mod.startswith(x + ".")) and (dep == y or dep.startswith(y + ".")):
                    wrong.append(f"{mod} imports {dep}: {x} never imports {y} (kvstore/README.md)")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_rules_catch_what_they_name() -> None:
    """Each rule refuses the import it is about (the manager's import of node/config.py was hidden by giving that
    one module a lower layer; now no node module may be imported by the manager)."""
    assert layer_of("kvstore.node.config")[0] > layer_of("kvstore.manager.core")[0]
    assert any(x == "kvstore.manager" and y == "kvstore.node" for x, y in NEVER)


def test_no_import_circles() -> None:
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components (recursion depth: module count)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_lazy_imports_and_circles(tmp_path: Path) -> None:
    """The checker itself: function-level and TYPE_CHECKING imports count."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvstore.names\n"
                   "def f():\n    from kvstore.manager import core\n")  # fmt: skip
    assert imports_of("kvstore.x", src, {"kvstore.manager.core"}) == {"kvstore.manager.core", "kvstore.names"}
