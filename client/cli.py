"""``kvstore-cli``: look at and poke a kvstore server from a terminal.

Every connection option is also a ``KVSTORE_*`` environment variable; flags
win. Exit codes: 0 success, 1 a failure (unreachable server, refused token,
missing key, ``exists`` with a key absent), 2 a usage error (bad flag or
``KVSTORE_*`` value, bad hex key, bad address), 130 interrupted. Errors are one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Sequence, TextIO, TypeVar

from kvstore import __version__
from kvstore.config import format_size, note_env, parse_bool, parse_number
from kvstore.errors import (
    InvalidRequest, KVStoreError, ProtocolError, RequestTimeout, TransportError, Unauthorized, Unavailable,
)
from kvstore.keys import check_key
from kvstore.protocol import Ping

from . import workers
from .aio import AsyncKVClient
from .connection import open_connection
from .node import check_host
from .tokens import read_token_file, uncovered

T = TypeVar("T")
PROG = "kvstore-cli"
ENV = "KVSTORE_"


class UsageError(Exception):
    """Bad input caught before talking to the server (exit code 2)."""


class Failure(Exception):
    """A failure found before talking to the server, e.g. an unreadable file (exit code 1)."""


# ----------------------------------------------------------------------------- arguments


def _env(name: str, default: Any = None, convert: Callable[[str], Any] | None = None) -> Any:
    """``KVSTORE_<NAME>``, through ``convert`` as the flag's value would be (argparse checks only the command line)."""
    raw = os.environ.get(ENV + name)
    if raw is None or raw == "":
        return default
    try:
        return convert(raw) if convert else raw
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"bad {ENV}{name}={raw!r}: {exc}") from None


def _seconds(text: str) -> float:
    return parse_number(text, float, lambda v: v > 0, "a number of seconds > 0")


def _interval(text: str) -> float:
    return parse_number(text, float, lambda v: v >= 0, "a number of seconds >= 0")


def _count(text: str) -> int:
    return parse_number(text, int, lambda v: v >= 1, "a whole number >= 1")


def _lines(text: str) -> int:
    return parse_number(text, int, lambda v: v >= 0, "a whole number >= 0 (0: never stop)")


def _namespace(text: str) -> str:
    if not 1 <= len(text) <= 256:  # what HELLO accepts (kvstore/messages.py)
        raise argparse.ArgumentTypeError(f"expected a namespace of 1..256 characters, got {text!r}")
    try:
        text.encode()
    except UnicodeEncodeError:  # (bytes the locale could not decode arrive as surrogates)
        raise argparse.ArgumentTypeError(f"expected a namespace in UTF-8, got {text!r}") from None
    return text


def _add_connection_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The options every command takes, before or after the command name.

    On a subcommand their default is SUPPRESS, so a value given before the
    command is not overwritten by the subcommand's default (an argparse trap).
    """
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    g = p.add_argument_group("connection (each also KVSTORE_<NAME>)")
    g.add_argument("--addr", default=default(_env("ADDR", "127.0.0.1:7600")),
                   help="server host:port [KVSTORE_ADDR, default 127.0.0.1:7600]")
    g.add_argument("--namespace", "-n", type=_namespace, default=default(_env("NAMESPACE", "default", _namespace)),
                   help="namespace to work in [KVSTORE_NAMESPACE, default 'default']")
    g.add_argument("--token-file", default=default(_env("TOKEN_FILE")),
                   help="file holding the token (first non-comment line) [KVSTORE_TOKEN_FILE]")
    g.add_argument("--tls", action="store_true", default=default(_env("TLS", False, parse_bool)),
                   help="connect with TLS, verifying against the system CAs [KVSTORE_TLS=1]")
    g.add_argument("--tls-ca", default=default(_env("TLS_CA")),
                   help="verify the server against this CA bundle (implies --tls) [KVSTORE_TLS_CA]")
    g.add_argument("--tls-server-name", default=default(_env("TLS_SERVER_NAME")),
                   help="name to verify in the server's certificate [KVSTORE_TLS_SERVER_NAME]")
    g.add_argument("--timeout", type=_seconds, default=default(_env("TIMEOUT", 10.0, _seconds)),
                   help="seconds to wait for a connection or a reply [KVSTORE_TIMEOUT, default 10]")


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: an option it does not know is its error, shown with its usage (argparse
    would hand it back to the top-level parser, whose usage does not list the command's options)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Inspect and debug a kvstore server.",
                                allow_abbrev=False)  # (`--token S` would be taken for --token-file and echoed)
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _add_connection_options(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, allow_abbrev=False)
        _add_connection_options(sp, suppress=True)
        return sp

    command("stats", "server summary: memory, traffic, lookups, tier").add_argument(
        "--json", action="store_true", help="the raw statistics as JSON")
    command("namespaces", "blocks and bytes per namespace").add_argument(
        "--json", action="store_true", help="as JSON")
    sp = command("ping", "round-trip time")
    sp.add_argument("--count", "-c", type=_count, default=1, help="pings to send (default 1)")
    sp = command("get", "fetch one block by hex key")
    sp.add_argument("key", help="the key in hex")
    out = sp.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", help="write the block to this file ('-': stdout, the default)")
    out.add_argument("--hex", action="store_true", help="print the block as hex")
    sp = command("put", "store one block by hex key")
    sp.add_argument("key", help="the key in hex")
    sp.add_argument("file", nargs="?", default="-", help="file with the block's bytes ('-' or absent: stdin)")
    command("exists", "which keys are stored (exit 1 when any is missing)").add_argument(
        "keys", nargs="+", metavar="KEY", help="keys in hex")
    command("delete", "delete blocks by hex key").add_argument("keys", nargs="+", metavar="KEY", help="keys in hex")
    sp = command("flush", "delete every block of a namespace (asks first)")
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask")
    sp = command("watch", "live statistics, one line per interval")
    sp.add_argument("--interval", "-i", type=_interval, default=2.0, help="seconds between lines (default 2)")
    sp.add_argument("--count", "-c", type=_lines, default=0, help="stop after this many lines (default: never)")
    return p


def parse_key(text: str) -> bytes:
    """A block key from hex (``0x`` prefix, spaces and colons allowed)."""
    shown = text if len(text) <= 40 else text[:37] + "..."
    cleaned = text.strip().removeprefix("0x").replace(":", "").replace(" ", "")
    try:
        key = bytes.fromhex(cleaned)
    except ValueError:
        odd = len(cleaned) % 2 and all(c in "0123456789abcdefABCDEF" for c in cleaned)
        why = f" ({len(cleaned)} hex digits, an odd number: each byte takes two)" if odd else ""
        raise UsageError(f"not a hex key: {shown!r}{why}") from None
    try:
        check_key(key)
    except InvalidRequest as exc:
        raise UsageError(f"bad key {shown!r}: {exc}") from None
    return key


def read_token(path: str | None, namespace: str | None = None) -> str | None:
    """The token a token file holds for ``namespace`` (:func:`read_token_file`)."""
    if not path:
        return None
    try:
        return read_token_file(path, namespace)
    except OSError as exc:  # (named with its flag: the path alone does not say which file it was)
        raise Failure(f"--token-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--token-file {exc}") from None


def _tls(args: argparse.Namespace) -> ssl.SSLContext | bool | None:
    if not args.tls_ca:
        return True if args.tls else None
    try:  # (here, not in the client: its error would read as one of --addr's below)
        return ssl.create_default_context(cafile=args.tls_ca)
    except (OSError, ssl.SSLError) as exc:  # (ssl's FileNotFoundError names no file)
        raise Failure(f"--tls-ca {args.tls_ca}: cannot load it as a CA file ({exc.strerror or exc})") from None


def make_client(args: argparse.Namespace) -> AsyncKVClient:
    try:
        workers.check_setting()  # (a variable the client library reads itself)
    except InvalidRequest as exc:
        raise UsageError(str(exc)) from None
    tls = _tls(args)
    token = read_token(args.token_file, args.namespace)
    try:
        check_host(args.tls_server_name or "", f"--tls-server-name {args.tls_server_name!r}")
    except InvalidRequest as exc:
        raise UsageError(str(exc)) from None
    try:
        return AsyncKVClient(args.addr, namespace=args.namespace, token=token, tls=tls,
                             pool_size=1, retries=0, timeout=args.timeout, connect_timeout=args.timeout,
                             server_hostname=args.tls_server_name,
                             shm=False)  # (one small request: mapping the whole arena would cost more)
    except InvalidRequest:  # the address (the library checks it)
        raise UsageError(f"--addr must be HOST:PORT ([IPV6]:PORT) or unix:/path/to.sock, not {args.addr!r}") from None


# ----------------------------------------------------------------------------- rendering


def _duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}h{m:02d}m" if d else f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render_stats(st: dict[str, Any], addr: str) -> str:
    """A terminal-sized summary of a STATS reply."""
    store, req, err = st.get("store", {}), st.get("requests", {}), st.get("errors", {})
    hit, miss = store.get("lookup_hit_keys", 0), store.get("lookup_miss_keys", 0)
    lines = [
        f"kvstore {st.get('version', '?')} at {addr}, up {_duration(st.get('uptime_s', 0))}",
        f"memory      {format_size(store.get('used_bytes', 0))} used of {format_size(store.get('capacity', 0))} "
        f"({_pct(store.get('used_bytes', 0), store.get('capacity', 0))}), eviction {store.get('eviction', '?')}",
        f"blocks      {store.get('blocks', 0)} in {st.get('namespaces_total', len(st.get('namespaces', {})))} namespace(s), "
        f"{format_size(store.get('bytes', 0))} of payload, {store.get('pinned_blocks', 0)} pinned",
        f"evictions   {store.get('evictions', 0)} ({format_size(store.get('evicted_bytes', 0))})",
        f"lookups     {store.get('lookups', 0)}: {hit} keys hit, {miss} missed "
        f"(prefix hit ratio {_pct(hit, hit + miss)})",
        f"requests    {sum(req.values())} ({', '.join(f'{k} {v}' for k, v in sorted(req.items())) or 'none'}), "
        f"{sum(err.values())} errors",
        f"traffic     {format_size(st.get('bytes_in', 0))} in, {format_size(st.get('bytes_out', 0))} out",
        f"connections {st.get('connections', 0)} open of at most {st.get('max_connections', '?')}, "
        f"{st.get('connections_total', 0)} accepted, {st.get('connections_rejected', 0)} refused"
        + (f", {st['tls_handshake_failures']} TLS handshake(s) failed" if st.get("tls_handshake_failures") else ""),
    ]
    poll = st.get("busy_poll") or {}
    if poll.get("window_us"):
        lines.append(f"polling     {poll['window_us']} us after each request (--busy-poll-us), "
                     f"{poll.get('seconds', 0.0):.2f} s polled idle, {poll.get('turns', 0)} polling turns so far")
    else:
        lines.append("polling     off (sleeps between requests)")
    tier = st.get("tier")
    if tier:
        lines.append(f"tier        {tier.get('state', '?')} ({tier.get('mode', '?')}) {tier.get('target', '')}, backlog "
                     f"{tier.get('backlog_blocks', 0)} blocks / {format_size(tier.get('backlog_bytes', 0))}")
        if tier.get("last_error"):  # (Redis refusing writes leaves the state "ok": it answers)
            at = tier.get("last_error_at")
            ago = f" ({_duration(max(0, time.time() - at))} ago)" if isinstance(at, (int, float)) else ""
            lines.append(f"            {tier.get('failures', 0)} failed call(s), the last{ago}: {tier['last_error']}")
    else:
        lines.append("tier        none (memory only)")
    return "\n".join(lines)


def _shown(name: str) -> str:
    """A name any client chose, safe for a terminal: non-printable characters escaped (a newline
    would forge a row, an escape sequence clear the operator's screen)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def render_namespaces(namespaces: dict[str, dict[str, int]], total: int | None = None, tier: str | None = None) -> str:
    """The namespaces in memory (``tier``: the Redis tier, whose blocks are not counted here)."""
    if not namespaces:
        return f"no blocks in memory (the Redis tier {tier} is not counted here)" if tier else "no blocks stored"
    shown = {ns: _shown(ns) for ns in namespaces}
    width = max(len("NAMESPACE"), *(len(s) for s in shown.values()))
    rows = [f"{'NAMESPACE':<{width}}  {'BLOCKS':>10}  {'BYTES':>12}"]
    for ns, st in sorted(namespaces.items()):
        rows.append(f"{shown[ns]:<{width}}  {st['blocks']:>10}  {format_size(st['bytes']):>12}")
    if total is not None and total > len(namespaces):
        rows.append(f"... the largest {len(namespaces)} of {total} namespaces (all of them: /metrics)")
    return "\n".join(rows)


def _restarted(prev: dict[str, Any], cur: dict[str, Any]) -> bool:
    """Another server process answered ``cur`` than ``prev``: its start time (where an older
    server's STATS has none: its uptime, or its request count, went back). Uptime alone missed a
    restart whose new process had been up longer than the old one when that was sampled."""
    if "started" in prev and "started" in cur:
        return bool(prev["started"] != cur["started"])
    return bool(cur.get("uptime_s", 0) < prev.get("uptime_s", 0)
                or sum(cur.get("requests", {}).values()) < sum(prev.get("requests", {}).values()))


def watch_line(prev: dict[str, Any] | None, cur: dict[str, Any], dt: float, own: int = 1) -> str:
    """One line of ``watch``: gauges now, rates since the previous sample (none across a restart:
    the counters start again from 0, and differences with the old ones would be negative).
    ``own``: the requests the watch itself sent since then (left out of the rate)."""
    store = cur.get("store", {})
    restarted = prev is not None and _restarted(prev, cur)
    if restarted:
        prev = None

    def rate(get: Callable[[dict[str, Any]], float]) -> float:
        return (get(cur) - get(prev)) / dt if prev is not None and dt > 0 else 0.0

    # Without this watch's own sample: one STATS per interval, on a connection of its own, and the
    # HELLO of each connection it opened (an --idle-timeout closed the last). (Its bytes, ~0.8 KB per
    # interval, stay in: the reply's size is the server's to know.)
    own_rate = own / dt if prev is not None and dt > 0 else 0.0
    reqs = max(0.0, rate(lambda s: sum(s.get("requests", {}).values())) - own_rate)
    rx, tx = rate(lambda s: s.get("bytes_in", 0)), rate(lambda s: s.get("bytes_out", 0))
    ev = rate(lambda s: s.get("store", {}).get("evictions", 0))
    hit, miss = store.get("lookup_hit_keys", 0), store.get("lookup_miss_keys", 0)
    if prev is not None:
        hit -= prev.get("store", {}).get("lookup_hit_keys", 0)
        miss -= prev.get("store", {}).get("lookup_miss_keys", 0)
    return (f"{time.strftime('%H:%M:%S')}  blocks {store.get('blocks', 0):>8}  "
            f"used {_pct(store.get('used_bytes', 0), store.get('capacity', 0)):>6}  "
            f"req/s {reqs:>8.1f}  in {format_size(rx)}/s  out {format_size(tx)}/s  "
            f"hit {_pct(hit, hit + miss):>6}  evict/s {ev:>6.1f}  conns {max(0, cur.get('connections', 0) - 1)}"
            + ("  (server restarted: rates from the next line)" if restarted else ""))


# ----------------------------------------------------------------------------- commands


class Output:
    """Standard output whose reader may leave early (``kvstore-cli exists ... | head -1``): past a
    broken pipe its writes are dropped, so the command still ends, with its own exit code (an
    ``exists`` that found a key missing: 1), where the pipe's error had ended it with 0. A command
    that would go on printing (watch, ping -c) stops once ``gone``."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream  # None: closed at start (cron, ``>&-``), or its reader gone
        self.gone = False

    def write(self, text: str) -> int:
        if self.stream is not None:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if self.stream is not None:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self.stream, self.gone = None, True
        _drop_stdout()


def _drop_stdout() -> None:
    """Point stdout at /dev/null: no second broken-pipe error when Python flushes it at exit."""
    if sys.stdout is not None:  # (None: closed at start, ``>&-``; nothing to drop)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


async def cmd_stats(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    st = await kv.stats()
    print(json.dumps(st, indent=2, sort_keys=True) if args.json else render_stats(st, args.addr), file=out)
    return 0


async def cmd_namespaces(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    st = await kv.stats()
    ns = st.get("namespaces", {})
    tier = (st.get("tier") or {}).get("target")
    print(json.dumps(ns, indent=2, sort_keys=True) if args.json else
          render_namespaces(ns, st.get("namespaces_total"), tier), file=out)
    return 0


async def cmd_ping(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    """PING; without a token it skips HELLO, so it checks a server that wants tokens too
    (a health check needs no secret); with one, the token is checked first. A server with
    tokens closes a connection that has not said HELLO after ``--frame-timeout``: a long
    ``--count`` then goes on on a new one."""
    conn = None
    answered = False  # a PONG came: a close after it is the auth deadline, not a TLS server

    async def bare() -> Any:
        (node,) = kv.nodes
        return await open_connection(node.host, node.port, namespace=kv.namespace, token=None, tls=kv.tls,
                                     limits=kv.limits, timeout=kv.connect_timeout,
                                     server_hostname=kv.server_hostname or node.host, unix=node.unix, hello=False)

    if kv.token is None:
        conn = await bare()
    try:
        for i in range(args.count):
            if i:
                await asyncio.sleep(0.2)
            if conn is None:
                rtt = await kv.ping()
            else:
                try:
                    rtt = await _bare_ping(conn, kv.timeout)
                except RequestTimeout:
                    raise
                except TransportError:
                    if answered:  # closed since the last PONG (its auth deadline): again on a new connection
                        await conn.aclose()
                        conn = await bare()
                        rtt = await _bare_ping(conn, kv.timeout)
                    elif kv.tls is None and kv.nodes[0].unix is None:  # what a TLS server does with plain text
                        raise TransportError(f"{args.addr} closed the connection at PING (does it expect TLS? "
                                             "--tls or --tls-ca)") from None
                    else:
                        raise
                answered = True
            print(f"PONG from {args.addr} in {rtt * 1000:.3f} ms", file=out, flush=True)
            if out.gone:
                break
    finally:
        if conn is not None:
            await conn.aclose()
    return 0


async def _bare_ping(conn: Any, timeout: float | None) -> float:
    t0 = time.perf_counter()
    await conn.request(Ping(), timeout=timeout)
    return time.perf_counter() - t0


async def cmd_get(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    key = parse_key(args.key)
    (blob,) = await kv.get([key])
    if blob is None:
        return _fail(f"key {key.hex()} not found in namespace {args.namespace!r}")
    if args.output not in (None, "-"):
        await _off_loop(partial(_on_file, args.output, lambda path: path.write_bytes(blob), "--output "))
    elif args.hex:
        print(bytes(blob).hex(), file=out)
    else:
        out.flush()
        sys.stdout.buffer.write(blob)
        sys.stdout.buffer.flush()
    return 0


def _on_file(name: str, op: Callable[[Path], T], flag: str = "") -> T:
    """``op(Path(name))``, its OSError named with the file (one raised by a read or write rather than
    the open names none: ``get -o /proc/version`` said only "Input/output error")."""
    try:
        return op(Path(name))
    except BrokenPipeError:  # (-o /dev/stdout | head -c 10: the reader has what it wanted, as without -o)
        raise
    except OSError as exc:
        raise Failure(f"{flag}{name}: {exc.strerror or exc}") from None


def _open_stream(stream: TextIO | None, name: str, instead: str) -> TextIO:
    """(Python sets a stream closed at start -- cron, ``<&-`` -- to None)"""
    if stream is None:
        raise Failure(f"{name} is closed: {instead}")
    return stream


async def _off_loop(work: Callable[[], T]) -> T:
    """A call that may block -- a read of stdin, the open of a FIFO no one writes -- on a daemon
    thread: the event loop stays free, so the first Ctrl-C ends the command (a read in the loop's
    thread was resumed after it: only a second one did). Stdin is read from its descriptor, not
    ``sys.stdin``: a daemon thread left blocked holding the buffered stream's lock aborts the
    interpreter at exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

    def run() -> None:
        result: Any = None
        try:
            result, error = work(), None
        except BaseException as exc:  # (an OSError of the stream, say: raised in the command)
            error = exc
        with contextlib.suppress(RuntimeError):  # (the loop is closed: the command ended meanwhile)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="kvstore-cli-io", daemon=True).start()
    return await done


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_line(fd: int) -> bytes:
    """Up to a newline or the end (a byte at a time: nothing past the answer is taken from stdin)."""
    line = bytearray()
    while (byte := os.read(fd, 1)) and byte != b"\n":
        line += byte
    return bytes(line)


async def cmd_put(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    key = parse_key(args.key)
    if args.file == "-":
        data = await _off_loop(partial(_read_all, _open_stream(sys.stdin, "stdin", "give a FILE").fileno()))
    else:
        data = await _off_loop(partial(_on_file, args.file, Path.read_bytes))
    res = await kv.put([key], [data])
    if res.statuses[0] == "existed":  # (the stored block stays; its size is not this file's)
        print(f"existed: {key.hex()} in namespace {args.namespace!r}, kept as it was (blocks are immutable: "
              f"delete it first to store other bytes)", file=out)
    else:
        print(f"{res.statuses[0]}: {key.hex()} ({format_size(len(data))}) in namespace {args.namespace!r}", file=out)
    return 0


async def cmd_exists(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    keys = [parse_key(k) for k in args.keys]
    present = await kv.exists(keys)
    for k, p in zip(keys, present):
        print(f"{k.hex()} {'present' if p else 'missing'}", file=out)
    return 0 if all(present) else 1


async def cmd_delete(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    n = await kv.delete([parse_key(k) for k in args.keys])
    print(f"deleted {n} of {len(args.keys)} block(s) in namespace {args.namespace!r}", file=out)
    return 0


async def cmd_flush(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    ns = args.namespace
    if not args.yes:
        st = await kv.stats()
        listed = st.get("namespaces", {})
        tier = st.get("tier")
        if tier:  # (the count below is memory's: Redis may hold many more)
            what = f"all blocks, in memory and in the Redis tier ({tier.get('target', '?')}),"
        elif ns in listed or st.get("namespaces_total", 0) <= len(listed):
            what = f"all {listed.get(ns, {}).get('blocks', 0)} block(s)"
        else:  # not among the largest the server lists
            what = "all blocks"
        print(f"Delete {what} of namespace {ns!r} on {args.addr}? [y/N] ", end="", file=out, flush=True)
        stdin = _open_stream(sys.stdin, "stdin", "give --yes to flush without asking").fileno()
        answer = (await _off_loop(partial(_read_line, stdin))).decode(errors="replace").strip().lower()
        if answer not in ("y", "yes"):
            print("not flushed", file=out)
            return 1
    n = await kv.flush(ns)
    print(f"flushed {n} block(s) of namespace {ns!r}", file=out)
    return 0


async def cmd_watch(kv: AsyncKVClient, args: argparse.Namespace, out: Output) -> int:
    """A server that cannot be reached for a sample (restarting, say, or at its connection limit
    after one) gets a line saying so, and watch goes on; one that cannot be reached at the start is
    an error, as for every command. With ``--count``, the exit status is 1 when the last sample
    found no server."""
    prev: dict[str, Any] | None = None
    t_prev = time.monotonic()
    n = 0
    conns: set[Any] = set()  # the watch's connections at the last sample (a new one sent a HELLO)
    while True:
        try:
            cur, now = await kv.stats(), time.monotonic()
        except (TransportError, Unavailable) as exc:
            print(f"{time.strftime('%H:%M:%S')}  unreachable: {exc}", file=out, flush=True)
            prev, n, reached = None, n + 1, False
        else:
            opened = [c for node in kv.nodes for c in node.conns if c not in conns]
            conns = {c for node in kv.nodes for c in node.conns}
            print(watch_line(prev, cur, now - t_prev, own=1 + len(opened)), file=out, flush=True)
            prev, t_prev, n, reached = cur, now, n + 1, True
        if args.count and n >= args.count:
            return 0 if reached else 1
        if out.gone:  # (`watch | head -1`: its reader has what it wanted)
            return 0
        await asyncio.sleep(max(0.05, args.interval))


COMMANDS: dict[str, Callable[[AsyncKVClient, argparse.Namespace, Output], Awaitable[int]]] = {
    "stats": cmd_stats, "namespaces": cmd_namespaces, "ping": cmd_ping, "get": cmd_get, "put": cmd_put,
    "exists": cmd_exists, "delete": cmd_delete, "flush": cmd_flush, "watch": cmd_watch,
}


# ----------------------------------------------------------------------------- entry point


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _explain(exc: KVStoreError, args: argparse.Namespace | None = None) -> str:
    if isinstance(exc, Unauthorized):
        if args is not None and args.token_file and uncovered(args.token_file, args.namespace):
            # (the globs themselves are not shown: in a client's own file, "a:b" is one token)
            return (f"refused by the server: {exc} (no NAMESPACE_GLOB:TOKEN line of --token-file {args.token_file} "
                    f"covers namespace {args.namespace!r}, so its first line went whole as the token)")
        return f"refused by the server: {exc} (check --token-file / KVSTORE_TOKEN_FILE)"
    if isinstance(exc, TransportError):
        return f"{exc}"
    if isinstance(exc, ProtocolError) and "not a kvstore frame" in str(exc) and args is not None:
        return f"{args.addr} does not answer in kvstore's protocol ({exc}): another service, such as the metrics port?"
    return f"{type(exc).__name__}: {exc}"


#: Commands whose answer is what they print: with stdout closed (cron, ``>&-``) they would succeed unseen.
SHOWING = ("stats", "namespaces", "watch", "get")


async def _run(args: argparse.Namespace) -> int:
    if sys.stdout is None and args.command in SHOWING and getattr(args, "output", None) in (None, "-"):
        raise Failure("stdout is closed: " + ("give -o FILE" if args.command == "get" else
                                              f"{args.command} has nowhere to show its answer"))
    kv = make_client(args)
    out = Output(sys.stdout)
    try:
        if args.command != "ping":  # (ping connects its own way: without a token, no HELLO)
            await kv.connect()
        return await COMMANDS[args.command](kv, args, out)
    finally:
        out.flush()
        await kv.close()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    flags: Iterable[str] = ()
    args: argparse.Namespace | None = None

    def said(exc: Exception) -> str:  # (a flag set by its KVSTORE_* variable says so)
        return note_env(str(exc), argv, flags)

    try:
        parser = build_parser()  # a bad KVSTORE_* value: UsageError
        flags = parser._option_string_actions
        args = parser.parse_args(argv)
        if args.command in ("get", "put", "exists", "delete"):  # fail on a bad key before connecting
            for k in getattr(args, "keys", None) or [args.key]:
                parse_key(k)
        if "" in (getattr(args, "output", None), getattr(args, "file", None)):  # (-o "" wrote to stdout)
            raise UsageError("an empty file name (give a path; for put, '-' or none reads stdin)")
        return asyncio.run(_run(args))
    except UsageError as exc:
        return _fail(said(exc), 2)
    except Failure as exc:
        return _fail(said(exc))
    except KVStoreError as exc:
        return _fail(_explain(exc, args))
    except BrokenPipeError:  # `kvstore-cli get KEY | head -c 10`: the reader has what it wanted
        _drop_stdout()
        return 0
    except OSError as exc:  # an unreadable token, CA or value file
        return _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
