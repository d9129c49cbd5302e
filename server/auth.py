"""Shared-secret authentication, TLS set-up, and the warning for an exposed, open server.

Token file (``--token-file``), one entry per line; blank lines and ``#``
comments are ignored::

    # a bare token may use every namespace
    3f1c...e9
    # NAMESPACE_PATTERN:TOKEN may use only the namespaces the pattern matches
    llama3-8b/*:9a77...01
    qwen2-7b/bf16/tp0:c0de...42

A pattern is a shell glob (:func:`fnmatch.fnmatchcase`); the token is
everything after the *first* colon, so a token may contain colons (write a
colon-bearing global token as ``*:TOKEN``). A client's token may match several
lines; it is granted the union of their patterns. Tokens are compared with
:func:`hmac.compare_digest` against every entry, so timing does not reveal how
much of a token matched nor which entry did.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """The namespace patterns one authenticated token may use."""

    patterns: tuple[str, ...]

    def allows(self, namespace: str) -> bool:
        return any(fnmatchcase(namespace, p) for p in self.patterns)


class TokenTable:
    """Tokens and the namespaces each may use, loaded from a token file."""

    def __init__(self, entries: list[tuple[str, bytes]]) -> None:
        if not entries:
            raise ValueError("the token file holds no token")
        self.entries = entries  # (namespace pattern, token bytes)

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Parse a token file (format in the module docstring).

        Raises:
            OSError: the file cannot be read.
            ValueError: it holds no token, or an entry with an empty token.
        """
        entries = []
        try:
            text = Path(path).read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text file of tokens (not UTF-8)") from None
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            pattern, sep, token = line.partition(":")
            if not sep:
                pattern, token = "*", line
            if not token or not pattern:
                raise ValueError(f"{path}:{n}: an entry is TOKEN or NAMESPACE_PATTERN:TOKEN")
            entries.append((pattern, token.encode()))
        return cls(entries)

    def authenticate(self, token: str | None) -> Grant | None:
        """The namespaces ``token`` may use, or None when it is no known token."""
        given = (token or "").encode()
        patterns = []
        for pattern, secret in self.entries:  # every entry, no early exit
            if hmac.compare_digest(given, secret):
                patterns.append(pattern)
        return Grant(tuple(patterns)) if patterns and token else None


def server_tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A server-side TLS context from a PEM certificate chain and key, or None without TLS.

    Raises:
        ValueError: only one of the two files is given, or the key is encrypted (a daemon has
            no one to ask for its passphrase: OpenSSL would prompt on the terminal).
        OSError (ssl.SSLError): a file is missing or not a matching cert/key.
    """
    if not cert and not key:
        return None
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key, password=_no_passphrase)
    return ctx


class EncryptedKey(ValueError):
    """The TLS private key needs a passphrase."""


def _no_passphrase() -> str:
    raise EncryptedKey("the private key is encrypted; give the server an unencrypted one "
                       "(e.g. openssl pkey -in KEY -out KEY.plain), readable only by its user")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (``localhost`` and ``::ffff:127.0.0.1``,
    as a dual-stack socket shows an IPv4 peer, included)."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a hostname: assume it is reachable from elsewhere
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def warn_if_exposed(host: str, auth: TokenTable | None, tls: bool) -> None:
    """Log a warning when a non-loopback listener takes anyone, or sends tokens in clear."""
    if is_loopback(host):
        return
    if auth is None:
        log.warning("bound to a non-loopback address without --token-file: anyone who can reach %s can "
                    "read, overwrite and flush every namespace", host,
                    extra={"event": "insecure_bind", "host": host})
    elif not tls:
        log.warning("tokens travel in clear text on %s: add --tls-cert/--tls-key", host,
                    extra={"event": "cleartext_tokens", "host": host})


__all__ = ["Grant", "TokenTable", "is_loopback", "server_tls_context", "warn_if_exposed"]
