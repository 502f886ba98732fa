"""Shared CLI plumbing: one error formatter, logging setup."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape

from kvstore.errors import KVStoreError

F = TypeVar("F", bound=Callable[..., Any])
err_console = Console(stderr=True)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def friendly_errors(fn: F) -> F:
    """Print a one-line cause instead of a traceback; KVSTORE_DEBUG=1 shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (KVStoreError, ValueError, OSError, RuntimeError) as exc:
            if os.environ.get("KVSTORE_DEBUG"):
                raise
            # NOTE: one unwrapped line (a path or a command in it stays whole for copy and paste, in a terminal
            # and in a log), the message taken literally (brackets in it are not markup).
            err_console.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}", soft_wrap=True)
            err_console.print("[dim](set KVSTORE_DEBUG=1 for the traceback)[/]")
            raise SystemExit(1) from None

    return wrapper  # type: ignore[return-value]
