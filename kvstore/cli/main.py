"""`kvstore`: run cache nodes and the local demo."""

from __future__ import annotations

import typer

from kvstore.cli.demo import demo
from kvstore.cli.serve import serve
from kvstore.cli.up import up

app = typer.Typer(no_args_is_help=True, add_completion=False, help="kvstore: a tiered KV cache for LLM serving.")
app.command("serve")(serve)
app.command("demo")(demo)
app.command("up")(up)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
