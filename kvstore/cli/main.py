"""`kvstore`: run cache nodes and the local demo."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import typer

from kvstore.cli.demo import demo
from kvstore.cli.nvme import app as nvme_app
from kvstore.cli.serve import serve
from kvstore.cli.up import up

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvstore: a tiered KV cache for LLM serving.")
app.command("serve")(serve)
app.command("demo")(demo)
app.command("up")(up)
app.add_typer(nvme_app, name="nvme")

# Commands contributed by other installed packages (e.g. `workers`: generate, pd-demo) through the
# "kvstore.cli" entry-point group, so kvstore itself never imports them (imports point downward only).
for _ep in entry_points(group="kvstore.cli"):
    try:
        app.command(_ep.name)(_ep.load())
    except ImportError as _exc:  # an extra that is not installed: the command is simply absent
        logging.getLogger(__name__).debug("kvstore command %s unavailable: %s", _ep.name, _exc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
