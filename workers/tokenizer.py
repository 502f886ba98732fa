"""Text <-> token ids from a checkpoint's `tokenizer.json` (the `tokenizers` library).

A checkpoint without `tokenizer.json` has no tokenizer: `load_tokenizer` returns None and callers work
in token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers

__all__ = ["TOKENIZER_FILE", "TextTokenizer", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A thin wrapper over `tokenizers.Tokenizer`: plain lists of ints in and out, no special-token magic.

    `encode` adds nothing the caller did not ask for (the tokenizer's own post-processor is not run),
    so the ids are exactly the text's tokens, optionally after `bos_token_id`.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: every id lies in [0, vocab_size)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | Path, *, bos_token_id: int | None = None) -> TextTokenizer | None:
    """The tokenizer in `directory/tokenizer.json`, or None when the file is absent.

    Raises ValueError naming the file when it exists but cannot be parsed.
    """
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception subclass for parse errors
        raise ValueError(f"{path}: not a valid tokenizers file: {e}") from e
    return TextTokenizer(tok, bos_token_id=bos_token_id)
