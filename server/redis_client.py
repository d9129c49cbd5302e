"""The redis-py client that ``--redis`` or ``--redis-cluster`` names, and how logs show it.

A password never shows: :func:`redact` masks it in what logs, stats and errors print, and a
parser's complaint about a URL is masked too (:func:`_masked`).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisClusterException

from kvstore.config import ServerConfig

_CLUSTER_FORMS = "host:port[,host:port...] or redis[s]://[[user]:password@]host:port[,host:port...]"


def client_for(config: ServerConfig, max_connections: int) -> tuple[Redis | RedisCluster, str] | None:
    """The client the config names and its redacted target, or ``None`` (memory only).

    Connects nothing. Raises ``ValueError`` (the value redacted) on bad settings.
    """
    if config.redis and config.redis_cluster:
        raise ValueError("give --redis or --redis-cluster, not both")
    if not config.redis and not config.redis_cluster:
        return None
    options: dict[str, Any] = {
        "max_connections": max_connections,
        "socket_timeout": config.redis_timeout, "socket_connect_timeout": min(1.0, config.redis_timeout),
        # One quick retry covers a pooled connection that died with a restarted Redis; the
        # library default (10 retries, jittered back-off to 10 s) would stall requests for minutes.
        "retry": Retry(ExponentialBackoff(cap=0.1, base=0.02), 1),
    }
    if not config.redis:
        return cluster_client(config.redis_cluster or "", **options)
    try:
        client = Redis.from_url(config.redis, **options)
        pool = client.connection_pool  # an option Redis lacks (?foo=1) fails here, not at the first request
        pool.connection_class(**pool.connection_kwargs)  # (builds a connection object; connects nothing)
        _check_db(config.redis)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"bad --redis URL {redact(config.redis)!r}: {_masked(str(exc), config.redis)}") from None
    return client, redact(config.redis)


def redact(url: str) -> str:
    """``url`` with ``***`` for its password, for logs, stats and errors.

    Everything between ``://`` and the last ``@`` but a ``user:`` is masked, so a password whose
    ``/``, ``?`` or ``@`` breaks the URL's syntax does not show either; so is a ``?password=`` option.
    """
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if sep and at:
        user = userinfo.split(":", 1)[0] + ":" if ":" in userinfo else ""  # no ':': all of it may be a password
        url = f"{scheme}://{user}***@{hosts}"
    return re.sub(r"([?&][^=&#]*password=)[^&#]*", r"\1***", url, flags=re.IGNORECASE)


def _masked(message: str, url: str) -> str:
    """A parser's ``message`` about ``url`` with any piece of its password masked: a password
    holding an unencoded ``/`` or ``?`` breaks the URL there, and the error quotes the pieces."""
    userinfo = url.partition("://")[2].rpartition("@")[0]
    secret = userinfo.partition(":")[2] if ":" in userinfo else userinfo
    for piece in sorted(filter(None, re.split(r"[/?#@:]", secret)), key=len, reverse=True):
        message = message.replace(piece, "***")
    return message


def _check_db(url: str) -> None:
    """A ``redis://`` URL's path must be a database number: redis-py ignores any other
    (``/db3`` would write to database 0, perhaps another application's)."""
    parts = urlsplit(url)
    db = unquote(parts.path).strip("/")  # (as redis-py reads it: /%33 is database 3)
    if parts.scheme in ("redis", "rediss") and db and not (db.isascii() and db.isdigit()):
        raise ValueError("its path is not a database number (redis://host:port/3 for database 3)")


def parse_cluster_nodes(spec: str) -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"`` -> ``[("h1", p1), ("h2", p2)]``; raises ``ValueError``."""
    nodes = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "@" in item or "/" in item:  # a URL gone wrong: not quoted, it may hold a password
            raise ValueError(f"--redis-cluster wants {_CLUSTER_FORMS}")
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"--redis-cluster wants host:port[,host:port...], got {item!r}")
        if not 0 < int(port) < 65536:
            raise ValueError(f"--redis-cluster: port {port} of {item!r} is not in 1-65535")
        nodes.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not nodes:
        raise ValueError("--redis-cluster names no node")
    return nodes


def cluster_client(spec: str, **options: Any) -> tuple[RedisCluster, str]:
    """The ``RedisCluster`` a ``--redis-cluster`` value names, and how logs and stats show it.

    ``spec`` is a seed list, ``host:port[,host:port...]``, or a URL around one:
    ``redis://[[user]:password@]host:port[,...]`` or ``rediss://`` (TLS), with redis-py's URL
    options (``?ssl_ca_certs=...``) as ``--redis`` takes them. redis-py's ``from_url`` reads the
    URL without its hosts (it knows one host only); the seeds become ``startup_nodes``. Raises
    ``ValueError`` that shows the value redacted.
    """
    if "://" not in spec:
        nodes = parse_cluster_nodes(spec)
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **options)
        return client, "cluster " + ",".join(f"{h}:{p}" for h, p in nodes)
    shown = redact(spec)
    scheme, _, rest = spec.partition("://")
    userinfo, at, rest = rest.rpartition("@")  # as redact() splits it: no password in what follows
    hosts, tail = re.match(r"([^/?#]*)(.*)", rest, re.DOTALL).groups()  # type: ignore[union-attr]
    try:
        if scheme not in ("redis", "rediss"):
            raise ValueError("the scheme must be redis:// or rediss:// (TLS)")
        nodes = parse_cluster_nodes(hosts)
        client = RedisCluster.from_url(f"{scheme}://{userinfo}{at}{tail}",
                                       startup_nodes=[ClusterNode(h, p) for h, p in nodes], **options)
    except (ValueError, TypeError, RedisClusterException) as exc:  # (TypeError: an option RedisCluster lacks)
        raise ValueError(f"bad --redis-cluster value {shown!r}: {_masked(str(exc), spec)}") from None
    return client, f"cluster {shown}"
