"""Reading a token file the one way every client-side tool does (kvstore-cli, the vLLM adapter)."""

from __future__ import annotations

from pathlib import Path


def read_token_file(path: str | Path) -> str:
    """The first line of a token file that is neither blank nor a ``#`` comment, stripped.

    Read as the server reads its ``--token-file``: UTF-8, a byte-order mark dropped (an editor's
    BOM would otherwise become part of the token), any line ending.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not UTF-8 text, or holds no token.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file of tokens (not UTF-8)") from None
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    raise ValueError(f"{path}: holds no token")
