"""`kvctl`: the operator's view of cache nodes."""

from __future__ import annotations

import typer

from kvstore.cli.cluster import lookup, nodes
from kvstore.cli.health import health
from kvstore.cli.stats import stats
from kvstore.cli.top import top

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Inspect kvstore cache nodes.")
app.command("stats")(stats)
app.command("nodes")(nodes)
app.command("lookup")(lookup)
app.command("top")(top)
app.command("health")(health)


@app.callback()
def _group() -> None:
    """Inspect kvstore cache nodes."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
