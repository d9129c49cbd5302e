"""Reading a token file the one way every client-side tool does (kvstore-cli, the vLLM adapter)."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path


def read_token_file(path: str | Path, namespace: str | None = None) -> str:
    """A client's token from a token file: its first line that is neither blank nor a ``#`` comment,
    stripped -- or, given the client's ``namespace``, the first entry that covers it when the file
    is written as the server's ``--token-file`` (``TOKEN`` or ``NAMESPACE_GLOB:TOKEN`` lines): a
    container that sets ``KVSTORE_TOKEN_FILE`` for its server hands the same file to a
    ``kvstore-cli`` run inside it. A file with no such entry gives its first line whole (refused,
    the CLI says so: :func:`uncovered`).

    Read as the server reads its ``--token-file``: UTF-8, a byte-order mark dropped (an editor's
    BOM would otherwise become part of the token), any line ending.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not UTF-8 text, or holds no token.
    """
    lines = _lines(path)
    if namespace is not None:
        token = _covering(lines, namespace)
        if token is not None:
            return token
    return lines[0]


def uncovered(path: str | Path, namespace: str) -> bool:
    """Whether no line of a token file covers ``namespace`` (:func:`read_token_file` then gave its
    first line whole); False where one does, or the file cannot be read: a hint for a refusal."""
    try:
        return _covering(_lines(path), namespace) is None
    except (OSError, ValueError):
        return False


def _lines(path: str | Path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file of tokens (not UTF-8)") from None
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{path}: holds no token")
    return lines


def _covering(lines: list[str], namespace: str) -> str | None:
    """The token of the first entry that covers ``namespace`` (a bare token covers every one)."""
    for line in lines:
        pattern, sep, token = line.partition(":")
        if not sep:
            return line
        if token and fnmatchcase(namespace, pattern):
            return token
    return None
