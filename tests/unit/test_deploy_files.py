"""deploy/ and docs/deployment.md agree with each other and with the daemons' real flags.

Units are parsed and, where systemd-analyze runs, verified and rated; Compose and Kubernetes files
are parsed with PyYAML; every KVFERRY_* variable is checked against the config dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvferry.common.daemon.flags import config_from_args, env_name
from kvferry.decode_worker.config import DecodeConfig
from kvferry.prefill_worker.config import PrefillConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "k8s"
DOC = (ROOT / "docs" / "deployment.md").read_text()
CONFIGS = {"prefill": PrefillConfig, "decode": DecodeConfig}
WORKER_HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
    "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "RestrictNamespaces": "yes",
    "CapabilityBoundingSet": "", "DevicePolicy": "closed",
}
PORTS = {"router": 8000, "prefill": 30000, "decode": 30001, "bootstrap": 8998}


def _parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections → key → every value in order (keys may repeat); joins backslash continuations."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    logical = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in logical.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{path.name}: key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _flag_vars(cls: type) -> set[str]:
    return {env_name(f.name) for f in dataclasses.fields(cls) if "help" in f.metadata}


def _env_example(name: str) -> tuple[dict[str, str], set[str]]:
    """(variables set, every variable named, set or commented out) in an *.env.example file."""
    text = (SYSTEMD / name).read_text()
    assigned = dict(re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", text, re.M))
    named = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", text, re.M))
    return assigned, named


def _yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _k8s(kind: str, name: str) -> dict:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _yaml_docs(path):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name!r} in deploy/k8s/")


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env_list(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


def _seconds(text: str) -> int:
    match = re.fullmatch(r"(\d+)s?", text)
    assert match, f"not a number of seconds: {text!r}"
    return int(match.group(1))


def _drain_s(role: str) -> float:
    return float(_env_example(f"kvferry-{role}.env.example")[0]["KVFERRY_DRAIN_TIMEOUT_S"])


# --- systemd -------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_unit(role):
    service = _parse_unit(SYSTEMD / f"kvferry-{role}.service")["Service"]
    one = {key: values[-1] for key, values in service.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["WatchdogSec"] == "30"
    assert one["ExecStart"] == f"/opt/kvferry/.venv/bin/kvferry {role}"
    assert one["EnvironmentFile"] == f"/etc/kvferry/{role}.env"
    assert one["Restart"] == "on-failure" and "RestartSec" in one
    assert one["KillSignal"] == "SIGTERM"
    assert one["LimitMEMLOCK"] == "infinity"
    assert one["User"] == "kvferry"
    for key, value in WORKER_HARDENING.items():
        assert one.get(key) == value, f"kvferry-{role}.service: {key}={one.get(key)!r}, want {value!r}"
    assert {"char-nvidia* rw", "char-infiniband_verbs rw"} <= set(service["DeviceAllow"])
    # The drain (plus a few seconds to close HTTP and NIXL) must end before systemd's SIGKILL.
    assert _seconds(one["TimeoutStopSec"]) >= _drain_s(role) + 15
    # Writable: the cache directory only.
    assert "ReadWritePaths" not in one and "StateDirectory" not in one
    assert one["CacheDirectory"] == "kvferry"


def test_router_unit():
    text = (SYSTEMD / "kvferry-router.service").read_text()
    service = _parse_unit(SYSTEMD / "kvferry-router.service")["Service"]
    one = {key: values[-1] for key, values in service.items()}
    assert one["Type"] == "simple" and "does not speak sd_notify" in text
    assert "WatchdogSec" not in one
    command = one["ExecStart"].split()
    assert command[:4] == ["/opt/kvferry/.venv/bin/python", "-m", "sglang_router.launch_router",
                           "--pd-disaggregation"]
    assigned, _ = _env_example("kvferry-router.env.example")
    used = set(re.findall(r"\$\{?([A-Z_]+)\}?", one["ExecStart"]))
    assert used == set(assigned), f"router.env.example sets {sorted(assigned)}, ExecStart uses {sorted(used)}"
    assert assigned["ROUTER_PREFILL_URL"].endswith(f":{PORTS['prefill']}")
    assert assigned["ROUTER_PREFILL_BOOTSTRAP_PORT"] == str(PORTS["bootstrap"])
    assert assigned["ROUTER_DECODE_URL"].endswith(f":{PORTS['decode']}")
    assert assigned["ROUTER_PORT"] == str(PORTS["router"])
    assert int(assigned["ROUTER_SHUTDOWN_GRACE_PERIOD_SECS"]) < _seconds(one["TimeoutStopSec"])
    for key in ("NoNewPrivileges", "ProtectSystem", "PrivateDevices", "CapabilityBoundingSet"):
        assert key in one, f"kvferry-router.service lacks {key}"


def _systemd_analyze() -> str:
    """Path of a working systemd-analyze, or skip the test saying why there is none."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian package: systemd)")
    return tool


def _unit_copies(tmp_path: Path) -> list[Path]:
    """The units with ExecStart pointed at /bin/true.

    `systemd-analyze verify` fails a unit whose ExecStart binary is missing, and
    /opt/kvferry/.venv/bin/kvferry exists only on an installed host. Everything else is unchanged.
    """
    copies = []
    for unit in sorted(SYSTEMD.glob("*.service")):
        lines, skipping = [], False
        for line in unit.read_text().splitlines():
            if line.startswith("ExecStart="):
                lines.append("ExecStart=/bin/true")
                skipping = line.endswith("\\")
            elif skipping:
                skipping = line.endswith("\\")
            else:
                lines.append(line)
        copy = tmp_path / unit.name
        copy.write_text("\n".join(lines) + "\n")
        copies.append(copy)
    return copies


def test_units_pass_systemd_analyze_verify(tmp_path):
    tool = _systemd_analyze()
    probe = tmp_path / "probe.service"
    probe.write_text("[Service]\nExecStart=/bin/true\n")
    if subprocess.run([tool, "verify", str(probe)], capture_output=True).returncode != 0:
        pytest.skip("systemd-analyze verify cannot run here (no usable systemd in this container)")
    for copy in _unit_copies(tmp_path):
        result = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True)
        # verify exits 0 on unknown keys and bad values, but names the file in a warning.
        complaints = [line for line in result.stderr.splitlines() if copy.name in line]
        assert result.returncode == 0 and not complaints, f"{copy.name}: {result.stderr}"


@pytest.mark.parametrize(("unit", "max_exposure"), [
    ("kvferry-prefill.service", 3.0), ("kvferry-decode.service", 3.0), ("kvferry-router.service", 2.0),
])
def test_unit_security_exposure(tmp_path, unit, max_exposure):
    tool = _systemd_analyze()
    copy = next(path for path in _unit_copies(tmp_path) if path.name == unit)
    result = subprocess.run([tool, "security", "--offline=true", str(copy)], capture_output=True, text=True)
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout + result.stderr)
    if match is None:
        pytest.skip(f"systemd-analyze security --offline gave no rating here: {result.stderr.strip()}")
    assert float(match.group(1)) <= max_exposure, result.stdout


# --- environment variables -----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_env_example_documents_every_flag(role):
    assigned, named = _env_example(f"kvferry-{role}.env.example")
    flags = _flag_vars(CONFIGS[role])
    kvferry_named = {name for name in named if name.startswith("KVFERRY_")}
    assert kvferry_named - flags == set(), f"not {role} flags: {sorted(kvferry_named - flags)}"
    assert flags - kvferry_named == set(), (
        f"add to deploy/systemd/kvferry-{role}.env.example: {sorted(flags - kvferry_named)}")
    # The values as shipped make a valid config (choices, ranges, paired CURVE settings).
    config = config_from_args(CONFIGS[role], argparse.Namespace(), env=assigned)
    assert config.port == PORTS[role]


def _compose_env(service: str) -> dict[str, str]:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return {k: str(v) for k, v in compose["services"][service].get("environment", {}).items()}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_role_settings_are_flags_of_that_role(role):
    flags = _flag_vars(CONFIGS[role])
    compose_env = _compose_env(role)
    k8s_env = _env_list(_container(_k8s("Deployment", f"kvferry-{role}")))
    for source, names in (("compose.yaml", compose_env), ("k8s", k8s_env)):
        kvferry = {name for name in names if name.startswith("KVFERRY_")}
        assert kvferry <= flags, f"{source} {role}: not flags: {sorted(kvferry - flags)}"
    config = config_from_args(CONFIGS[role], argparse.Namespace(), env=compose_env)
    assert config.port == PORTS[role] and config.host == "0.0.0.0"


def test_every_kvferry_variable_in_deploy_is_a_flag():
    known = _flag_vars(PrefillConfig) | _flag_vars(DecodeConfig)
    shared = _flag_vars(PrefillConfig) & _flag_vars(DecodeConfig)
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        used = set(re.findall(r"\bKVFERRY_[A-Z0-9_]+", path.read_text()))
        assert used <= known, f"{path.relative_to(ROOT)}: unknown {sorted(used - known)}"
    configmap = _k8s("ConfigMap", "kvferry-config")["data"]
    kvferry = {name for name in configmap if name.startswith("KVFERRY_")}
    assert kvferry <= shared, f"configmap.yaml feeds both roles but {sorted(kvferry - shared)} is not"


# --- compose -------------------------------------------------------------------------------------


def test_compose_services_and_health():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"models", "prefill", "decode", "router"}
    for role in ("prefill", "decode"):
        worker = services[role]
        assert worker["command"] == [role]
        assert worker["depends_on"]["models"]["condition"] == "service_completed_successfully"
        assert f"127.0.0.1:{PORTS[role]}/health" in " ".join(worker["healthcheck"]["test"])
        assert worker["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
        assert "shm_size" in worker
        drain_s = float(worker["environment"]["KVFERRY_DRAIN_TIMEOUT_S"])
        assert _seconds(worker["stop_grace_period"]) >= drain_s + 15
    router = services["router"]
    for role in ("prefill", "decode"):
        assert router["depends_on"][role]["condition"] == "service_healthy"
    command = router["command"]
    assert router["entrypoint"] == ["python", "-m", "sglang_router.launch_router"]
    assert "--pd-disaggregation" in command
    prefill_at = command.index("--prefill")
    assert command[prefill_at + 1:prefill_at + 3] == [f"http://prefill:{PORTS['prefill']}", str(PORTS["bootstrap"])]
    assert command[command.index("--decode") + 1] == f"http://decode:{PORTS['decode']}"
    assert command[command.index("--port") + 1] == str(PORTS["router"])
    assert "/readiness" in " ".join(router["healthcheck"]["test"])
    # The decode dials the prefill by the same name the router puts in bootstrap_host.
    assert services["prefill"]["environment"]["KVFERRY_ADVERTISE_HOST"] == "prefill"
    build = services["prefill"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "container" / "Dockerfile"


# --- kubernetes ----------------------------------------------------------------------------------


def _probe(container: dict, kind: str) -> tuple[str, str]:
    get = container[kind]["httpGet"]
    return get["path"], get["port"]


def test_k8s_services_and_ports():
    prefill = _k8s("Service", "kvferry-prefill")["spec"]
    assert prefill["clusterIP"] == "None", "bootstrap_host must resolve to the pod, not a virtual IP"
    assert {p["name"]: p["port"] for p in prefill["ports"]} == {"http": PORTS["prefill"], "bootstrap": PORTS["bootstrap"]}
    assert {p["name"]: p["port"] for p in _k8s("Service", "kvferry-decode")["spec"]["ports"]} == {"http": PORTS["decode"]}
    assert {p["name"]: p["port"] for p in _k8s("Service", "kvferry-router")["spec"]["ports"]} == {"http": PORTS["router"]}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _yaml_docs(path):
            assert "namespace" not in doc["metadata"], f"{path.name}: manifests stay namespace-agnostic"
            if doc["kind"] in ("Service", "Deployment"):
                labels = doc["spec"]["selector"]
                labels = labels.get("matchLabels", labels)
                if doc["kind"] == "Deployment":
                    assert labels.items() <= doc["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_k8s_worker_deployment(role):
    deployment = _k8s("Deployment", f"kvferry-{role}")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["args"] == [role]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == PORTS[role]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _probe(container, kind) == ("/health", "http")
    assert container["livenessProbe"]["failureThreshold"] * container["livenessProbe"]["periodSeconds"] >= 60
    assert [ref["configMapRef"]["name"] for ref in container["envFrom"]] == ["kvferry-config"]
    drain_s = float(_k8s("ConfigMap", "kvferry-config")["data"]["KVFERRY_DRAIN_TIMEOUT_S"])
    unit = _parse_unit(SYSTEMD / f"kvferry-{role}.service")["Service"]
    assert pod["terminationGracePeriodSeconds"] == _seconds(unit["TimeoutStopSec"][-1]) >= drain_s + 15
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "nvidia.com/gpu" in (K8S / f"{role}.yaml").read_text()
    if role == "prefill":
        env = _env_list(container)
        assert env["KVFERRY_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["KVFERRY_BOOTSTRAP_PORT"]["value"] == str(PORTS["bootstrap"])
        assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_k8s_router_deployment():
    container = _container(_k8s("Deployment", "kvferry-router"))
    args = container["args"]
    prefill_at = args.index("--prefill")
    assert args[prefill_at + 1:prefill_at + 3] == [f"http://kvferry-prefill:{PORTS['prefill']}", str(PORTS["bootstrap"])]
    assert args[args.index("--decode") + 1] == f"http://kvferry-decode:{PORTS['decode']}"
    assert args[args.index("--port") + 1] == str(PORTS["router"])
    assert _probe(container, "readinessProbe") == ("/readiness", "http")
    assert _probe(container, "livenessProbe") == ("/liveness", "http")


# --- container image -----------------------------------------------------------------------------


def test_dockerfile():
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["kvferry"\]$', text, re.M)
    user = re.search(r"^USER (\S+)$", text, re.M).group(1)
    assert user.split(":")[0] not in ("root", "0")
    health = re.search(r"^HEALTHCHECK .*?(?<!\\)$", text, re.M | re.S).group(0)
    assert "urllib.request.urlopen" in health and "KVFERRY_PORT" in health and "/health" in health
    exposed = {int(port) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for port in line.split()}
    assert exposed == set(PORTS.values())
    copied = set(re.findall(r"^COPY (\S+) ", text, re.M)) | {"README.md"}
    allowed = {line[1:] for line in (DEPLOY / "container" / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert copied == allowed, "the allow-list must let in exactly what the Dockerfile copies"
    assert all((ROOT / name).exists() for name in copied)


# --- the guide -----------------------------------------------------------------------------------


def test_doc_ports_table_matches_files():
    rows = re.findall(r"^\| (\d+) \| (\w+) \|", DOC, re.M)
    documented = {(int(port), process) for port, process in rows}
    assert {(PORTS["router"], "router"), (PORTS["prefill"], "prefill"), (PORTS["decode"], "decode"),
            (PORTS["bootstrap"], "prefill")} <= documented
    assert "UCX_TCP_PORT_RANGE" in DOC and "bootstrap socket" in DOC


def test_doc_names_every_deploy_file_and_probe():
    listed = set(re.findall(r"^\| `(deploy/[^`]+)` \|", DOC, re.M))
    on_disk = {str(p.relative_to(ROOT)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert listed == on_disk, f"docs/deployment.md Files table: missing {sorted(on_disk - listed)}, " \
                              f"stale {sorted(listed - on_disk)}"
    for probe in ("/health", "/readiness", "/liveness", "status.podIP", "service_healthy",
                  "Type=notify", "WatchdogSec=30", "LimitMEMLOCK=infinity", "TimeoutStopSec=120",
                  "terminationGracePeriodSeconds: 120", "KVFERRY_DRAIN_TIMEOUT_S=90"):
        assert probe in DOC, f"docs/deployment.md does not mention {probe}"
