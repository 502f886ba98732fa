"""The CLI's error line (kvstore/cli/common.py): one line whatever its length, the message taken literally."""

from __future__ import annotations

import pytest

from kvstore.cli.common import friendly_errors


def test_a_long_error_stays_one_line_and_brackets_are_not_markup(capsys: pytest.CaptureFixture[str]) -> None:
    path = "/tmp/" + "a-rather-long-directory-name/" * 6 + "node.key_secret"

    @friendly_errors
    def refuse() -> None:
        raise ValueError(f"{path}: accessible to every user (mode 0644); chmod 600 {path} [expected ['x']]")

    with pytest.raises(SystemExit) as exited:
        refuse()
    assert exited.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert (
        lines[0]
        == f"error: ValueError: {path}: accessible to every user (mode 0644); chmod 600 {path} [expected ['x']]"
    )
    assert lines[1] == "(set KVSTORE_DEBUG=1 for the traceback)"
