"""Fixtures that start real processes on loopback and always stop them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvstore.server.process import ServerProcess


try:
    import torch
except ImportError:
    torch = None
#: Modules that move torch tensors throughout (others skip their few torch tests without it).
collect_ignore = ["test_transfer.py", "test_seed_scenario.py", "test_pd_example.py"] if torch is None else []


def pytest_configure(config: pytest.Config) -> None:
    """The suite moves real torch tensors: without torch it stops at once, unless asked to run
    what it can (``KVSTORE_TEST_WITHOUT_TORCH=1``, e.g. on a Python with no CPU wheel at hand).
    torch is the client's optional extra, not a test one, so that installing the test extra never
    pulls PyPI's multi-GB CUDA build."""
    if torch is None and not os.environ.get("KVSTORE_TEST_WITHOUT_TORCH"):
        raise pytest.UsageError("the test suite needs torch (the CPU build): ./scripts/test.sh installs it, "
                                "or pip install torch==2.13.0 (see README); KVSTORE_TEST_WITHOUT_TORCH=1 "
                                "runs the rest")


@pytest.fixture(autouse=True)
def shm_puts_of_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests put small blocks through the shared arena too (by default a put under 2 MiB goes over
    the socket, which is faster there); test_shm checks that default on its own."""
    from kvstore.client.shm import ShmChannel

    monkeypatch.setattr(ShmChannel, "inline_put_bytes", 0)


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    """A real kvstore-server (64 MiB, LRU) on 127.0.0.1, any free port."""
    with ServerProcess("--capacity", "64MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def kv_server() -> Iterator[ServerProcess]:
    """A real kvstore-server (256 MiB) shared by one test module."""
    with ServerProcess("--capacity", "256MiB") as srv:
        yield srv


@pytest.fixture
def make_server() -> Iterator:
    """Start servers with custom flags: ``make_server("--capacity", "8MiB")``."""
    started: list[ServerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None, open_files: tuple[int, int] | None = None) -> ServerProcess:
        srv = ServerProcess(*args, env=env, open_files=open_files).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


# ---------------------------------------------------------------- operations (metrics, auth, TLS)


def metrics_address(srv: ServerProcess) -> str:
    """``http://127.0.0.1:PORT`` of a server started with ``--metrics-port 0`` (read from its log)."""
    import re

    line = srv.wait_log(r"metrics served at http://\S+:\d+/")
    match = re.search(r"http://(\S+?):(\d+)/", line)
    assert match is not None
    return f"http://{match.group(1)}:{match.group(2)}"


@pytest.fixture
def metrics_url() -> Callable[[ServerProcess], str]:
    """``metrics_url(srv)`` -> the base URL of ``srv``'s metrics/health listener."""
    return metrics_address


@pytest.fixture
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throw-away CA and a server certificate for ``localhost``/127.0.0.1, made with ``cryptography``.

    Returns the paths ``ca`` (CA certificate), ``cert`` and ``key`` (the server's, PEM).
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject: str, issuer: x509.Certificate | None, signing_key: ec.EllipticCurvePrivateKey | None,
              ca: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        # The extensions Python 3.13's default context requires (VERIFY_X509_STRICT): key usage on
        # the CA, key identifiers on both.
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        issuer_key = (issuer.public_key() if issuer else key.public_key())
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer.subject if issuer else name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key), critical=False)
                   .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                                                decipher_only=False), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            builder = builder.add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                                            critical=False)
        return builder.sign(signing_key or key, hashes.SHA256()), key

    ca_cert, ca_key = build("kvstore test CA", None, None, ca=True)
    cert, key = build("localhost", ca_cert, ca_key, ca=False)
    paths = {"ca": out / "ca.pem", "cert": out / "server.pem", "key": out / "server.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths
