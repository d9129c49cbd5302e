"""Static checks of deploy/ (no Docker engine, no cluster here) and runs of the server as deployed.

What can be run is run: ``systemd-analyze verify`` and ``security --offline`` on the unit, the
server under the unit's memory-W^X rule (``PR_SET_MDWE``) with the unit's environment file, and
every ``KVSTORE_*`` setting and CLI argument of every manifest through the real flag parser.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import pytest
import yaml

from kvstore.client import KVClient
from kvstore.config import ServerConfig, parse_size
from kvstore.server.cli import build_parser, config_from_args
from kvstore.server.metrics import TIER_METRICS
from kvstore.server.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
VENV_BIN = Path(sys.executable).parent


def flag_dests() -> set[str]:
    return {a.dest for a in build_parser()._actions}


def check_env(env: dict[str, str], where: str, args: Sequence[str] = ()) -> ServerConfig:
    """Every KVSTORE_* name is a real flag and every value parses (via the real env-var path); the
    settings the server would run with, given these variables and command-line ``args``."""
    dests = flag_dests()
    for name in env:
        assert name.startswith("KVSTORE_") and name[8:].lower() in dests, f"{where}: {name} is no kvstore flag"
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVSTORE_")}
    try:
        os.environ.update(env)
        return config_from_args(list(args))  # SystemExit on a bad value
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(old)


def image_env_and_cmd() -> tuple[dict[str, str], list[str]]:
    """The Dockerfile's ENV variables and its CMD (the default arguments; none when it has no CMD)."""
    instrs = dockerfile()
    env = dict(kv.split("=", 1) for i, a in instrs if i == "ENV" for kv in shlex.split(a))
    cmd = [json.loads(a) for i, a in instrs if i == "CMD" and a.startswith("[")]
    return env, cmd[-1] if cmd else []


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# ---------------------------------------------------------------- all YAML


def test_every_yaml_file_parses() -> None:
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(files) >= 9
    for f in files:
        assert docs(f), f"{f} is empty"


# ---------------------------------------------------------------- Docker


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instr, _, rest = line.strip().partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def test_dockerfile_entrypoint_is_the_console_script_and_copies_existing_files() -> None:
    instrs = dockerfile()
    entry = [json.loads(a) for i, a in instrs if i == "ENTRYPOINT"]
    assert entry == [["kvstore-server"]]
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^kvstore-server = "kvstore\.server\.cli:main"$', scripts, re.M)
    assert (VENV_BIN / "kvstore-server").exists()  # what pip makes of that entry point
    image_env, cmd = image_env_and_cmd()
    # Settings go in KVSTORE_* variables, not CMD flags: a flag wins over its variable, so a CMD
    # --capacity silently overrode the capacity a ConfigMap or `docker run -e` set.
    assert cmd == [], "the image's default settings belong in ENV, where a deployment's variables override them"
    assert check_env({**image_env, "KVSTORE_CAPACITY": "3GiB"}, "docker run -e").capacity == 3 << 30
    assert check_env(image_env, "Dockerfile ENV").capacity == 1 << 30  # (the image's default)
    for instr, args in instrs:
        if instr == "COPY" and not args.startswith("--from"):
            *sources, _ = args.split()
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: no such file in the build context"
        if instr == "ENV":
            check_env(dict(kv.split("=", 1) for kv in shlex.split(args)), "Dockerfile ENV")
    copied = {src.rstrip("/") for i, a in instrs if i == "COPY" and not a.startswith("--from")
              for src in a.split()[:-1]}
    pyproject = (ROOT / "pyproject.toml").read_text()
    package_dirs = pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    assert set(re.findall(r'= "([^"]+)"', package_dirs)) | {"pyproject.toml", "README.md"} <= copied
    exposed = {int(p) for i, a in instrs if i == "EXPOSE" for p in a.split()}
    env = dict(kv.split("=", 1) for i, a in instrs if i == "ENV" for kv in shlex.split(a))
    assert {int(env["KVSTORE_PORT"]), int(env["KVSTORE_METRICS_PORT"])} == exposed


def test_dockerfile_healthcheck_probes_liveness_on_the_metrics_port(make_server, metrics_url) -> None:
    """Liveness (/livez), not readiness: /healthz is 503 while Redis is down, and an unhealthy
    container may be restarted, its memory tier lost, for an outage a restart cannot mend."""
    (check,) = [a for i, a in dockerfile() if i == "HEALTHCHECK"]
    cmd = json.loads(check[check.index("CMD") + 3:].strip())
    assert cmd[0] == "python" and "/livez" in cmd[-1] and "/healthz" not in cmd[-1]
    srv = make_server("--capacity", "1MiB", "--metrics-port", "0", "--redis", "redis://127.0.0.1:1")  # Redis down
    port = metrics_url(srv).rsplit(":", 1)[1]
    env = {**os.environ, "KVSTORE_METRICS_PORT": port}
    assert subprocess.run([sys.executable, *cmd[1:]], env=env, timeout=30).returncode == 0  # healthy
    env["KVSTORE_METRICS_PORT"] = "1"  # nothing listens there: unhealthy
    assert subprocess.run([sys.executable, *cmd[1:]], env=env, timeout=30, capture_output=True).returncode != 0


def test_compose_references_existing_files_and_consistent_names() -> None:
    (compose,) = docs(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert {"kvstore", "redis", "prometheus"} <= set(services)
    build = services["kvstore"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    image_env, cmd = image_env_and_cmd()
    config = check_env({**image_env, **services["kvstore"]["environment"]}, "compose",
                       services["kvstore"].get("command", cmd))
    assert (config.capacity, config.redis_mode) == (2 << 30, "write-behind")  # what its comments promise
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).is_file(), f"compose mounts {src}, which does not exist"
            else:
                assert src in compose.get("volumes", {}), f"named volume {src} is not declared"
    assert config.redis == "redis://redis:6379/0"  # the compose service of redis
    (prom,) = docs(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "kvstore"]
    host, port = job["static_configs"][0]["targets"][0].split(":")
    env = dict(kv.split("=", 1) for i, a in dockerfile() if i == "ENV" for kv in shlex.split(a))
    assert host in services and port == env["KVSTORE_METRICS_PORT"]
    assert job.get("metrics_path", "/metrics") == "/metrics"


# ---------------------------------------------------------------- Kubernetes


def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for f in sorted(K8S.glob("*.yaml")):
        for d in docs(f):
            if d.get("kind") != "Kustomization":
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


def test_kubernetes_manifests_fit_together() -> None:
    objs = k8s()
    (kust,) = docs(K8S / "kustomization.yaml")
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    dep = objs[("Deployment", "kvstore")]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (ctr,) = pod["spec"]["containers"]
    cm = objs[("ConfigMap", ctr["envFrom"][0]["configMapRef"]["name"])]
    image_env, cmd = image_env_and_cmd()
    config = check_env({**image_env, **cm["data"], **{e["name"]: e["value"] for e in ctr["env"]}}, "k8s",
                       ctr.get("args", cmd))  # (a container's args replace the image's CMD)
    assert config.capacity == parse_size(cm["data"]["KVSTORE_CAPACITY"])  # what the pod's memory is sized for
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports == {"kvstore": int(cm["data"]["KVSTORE_PORT"]), "metrics": int(cm["data"]["KVSTORE_METRICS_PORT"])}
    # ready while Redis is degraded: a readiness on /healthz took the Service's only endpoint away
    assert ctr["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert ctr["resources"]["limits"]["memory"] == ctr["resources"]["requests"]["memory"]
    # a Service named kvstore injects KVSTORE_PORT=tcp://... and kin, which the server would read as flags
    assert pod["spec"]["enableServiceLinks"] is False
    assert ctr["securityContext"]["readOnlyRootFilesystem"] and not ctr["securityContext"]["allowPrivilegeEscalation"]
    token_dir = str(Path([e["value"] for e in ctr["env"] if e["name"] == "KVSTORE_TOKEN_FILE"][0]).parent)
    (mount,) = [m for m in ctr["volumeMounts"] if m["mountPath"] == token_dir]
    assert [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]][0]["secret"]["secretName"]
    svc = objs[("Service", "kvstore")]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(cm["data"]["KVSTORE_DRAIN_SECONDS"])
    redis_url = cm["data"]["KVSTORE_REDIS"]
    redis_svc = objs[("Service", "kvstore-redis")]
    sts = objs[("StatefulSet", "kvstore-redis")]
    assert f"//{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}/" in redis_url
    assert sts["spec"]["serviceName"] == redis_svc["metadata"]["name"]
    assert redis_svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


# ---------------------------------------------------------------- Grafana


def test_dashboard_uses_only_metrics_the_server_exports(make_server, metrics_url) -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvstore-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\b(?:kvstore|process)_\w+", e)}
    srv = make_server("--capacity", "8MiB", "--metrics-port", "0")
    with KVClient(srv.addr, namespace="d") as kv:
        kv.put([b"k" * 16], [b"v"])
        kv.lookup([b"k" * 16])
    with urllib.request.urlopen(metrics_url(srv) + "/metrics", timeout=5) as resp:
        body = resp.read().decode()
    exported = {re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split()[0])
                for line in body.splitlines() if line and not line.startswith("#")}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M):  # families with no sample yet
        exported.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    missing = used - exported - set(TIER_METRICS)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    assert set(TIER_METRICS) & used  # and it shows the tier
    # process_* series come from every Python (or Go) target Prometheus scrapes: count kvstore's only
    assert all("and on(instance) kvstore_build_info" in e for e in exprs if "process_" in e)
    (provisioned,) = docs(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert provisioned["datasources"][0]["type"] == "prometheus"
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dash["templating"]["list"])


# ---------------------------------------------------------------- systemd


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    assert path, "systemd-analyze is missing: install Debian's 'systemd' package (scripts/test.sh does)"
    return path


@pytest.fixture
def unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointed at this venv's kvstore-server (verify checks the binary exists)."""
    text = (DEPLOY / "systemd" / "kvstore.service").read_text()
    assert "ExecStart=/opt/kvstore/bin/kvstore-server" in text
    path = tmp_path / "kvstore.service"
    path.write_text(text.replace("/opt/kvstore/bin/", f"{VENV_BIN}/"))
    return path


def test_systemd_unit_verifies_cleanly(unit: Path) -> None:
    r = subprocess.run([systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values and only warns: any output is a failure
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr + r.stdout
    text = unit.read_text()
    for setting in ("DynamicUser=yes", "ProtectSystem=strict", "NoNewPrivileges=yes", "LimitNOFILE=",
                    "MemoryMax=", "KillSignal=SIGTERM"):
        assert setting in text


def test_systemd_unit_is_hardened(unit: Path) -> None:
    r = subprocess.run([systemd_analyze(), "security", "--offline=yes", "--threshold=20", str(unit)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr  # exposure 2.0 or less ("OK")
    assert re.search(r"Overall exposure level for kvstore.service: (\d+\.\d+) OK", r.stdout)


def test_server_runs_with_the_env_file_and_under_memory_deny_write_execute(tmp_path: Path) -> None:
    """The unit's MemoryDenyWriteExecute= forbids W+X memory; the kernel's PR_SET_MDWE is the same rule.
    A ``sitecustomize`` sets it at the child's start: a server needing W+X memory would crash here."""
    env_file = {}
    for line in (DEPLOY / "systemd" / "kvstore.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, val = line.partition("=")
            env_file[name] = val
    check_env(env_file, "kvstore.env")
    (tmp_path / "sitecustomize.py").write_text(
        "import ctypes\n"
        "PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1\n"
        "assert ctypes.CDLL(None).prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) == 0, 'PR_SET_MDWE failed'\n"
        "open(__file__ + '.applied', 'w').close()\n")
    env = {**env_file, "KVSTORE_CAPACITY": "16MiB", "KVSTORE_METRICS_PORT": "0", "PYTHONPATH": str(tmp_path)}
    with ServerProcess(env=env) as srv:
        assert (tmp_path / "sitecustomize.py.applied").exists()
        with KVClient(srv.addr, namespace="mdwe") as kv:
            kv.put([b"k" * 32], [b"v" * 4096])
            assert [bytes(b) for b in kv.get([b"k" * 32])] == [b"v" * 4096]
        line = srv.wait_log("metrics served at")
        assert json.loads(line)["event"] == "metrics_started"  # KVSTORE_LOG_FORMAT=json from the env file
    assert srv.proc is not None and srv.proc.returncode == 0
