"""The deploy/ artifacts: each is parsed and the fields that make kvpool work are checked.

Shared /dev/shm and IPC, a shared PID namespace for CUDA IPC, the socket directory and its
group, memlock, GPU visibility, the socket mode and a non-root user; every ``KVPOOL_*`` setting
and the example TOML must be valid ``DaemonConfig`` input; every metric the dashboard queries
must be one the daemon exports. PyYAML is a test-only dependency (``[test]`` extra): the
manifests are YAML for Kubernetes and compose, and a hand-rolled reader would only test itself.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpool.daemon.metrics import Metrics
from kvpool.daemon.remote_url import DEFAULT_METADATA_PORT, parse_remote_url
from kvpool.shared.config import DaemonConfig, build_config, env_layer, parse_size, toml_layer
from kvpool.shared.protocol import PoolInfo, TierInfo

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SOCKET = "/run/kvpool/kvpoold.sock"
GID = 2001


# ---- helpers ---------------------------------------------------------------------------------

def unit_file(path: Path) -> dict[str, list[tuple[str, str]]]:
    """systemd unit → {section: [(key, value), ...]} (keys may repeat, so not configparser)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path}: {line!r} outside a section"
        current.append((key.strip(), value.strip()))
    return sections


def values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def k8s_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?", str(q))
    assert m, f"not a memory quantity: {q!r}"
    mult = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
            "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]
    return int(m.group(1)) * mult


def env_of(container: dict) -> dict[str, str]:
    env = container.get("env", container.get("environment", {}))
    if isinstance(env, dict):   # compose's map form
        return {k: str(v) for k, v in env.items()}
    return {e["name"]: str(e["value"]) for e in env}


def kvpool_config(env: dict[str, str]) -> DaemonConfig:
    """The daemon's config from a container's KVPOOL_* variables: unknown names and bad values
    fail here, as they would at the daemon's start."""
    unknown = {k for k in env if k.startswith("KVPOOL_")} - {
        f"KVPOOL_{f.upper()}" for f in DaemonConfig.__struct_fields__}
    assert not unknown, f"not DaemonConfig settings: {unknown}"
    return build_config(DaemonConfig, env_layer(DaemonConfig, env))


def mounts(container: dict) -> dict[str, str]:
    """mountPath -> volume name (Kubernetes)."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def connector_socket(args: list[str]) -> str:
    """The kvpool socket named in vLLM's --kv-transfer-config."""
    flag = next(a for a in args if a.startswith("--kv-transfer-config="))
    cfg = json.loads(flag.split("=", 1)[1])
    assert cfg["kv_connector_module_path"] == "kvpool.client.vllm"
    assert cfg["kv_role"] == "kv_both"
    return cfg["kv_connector_extra_config"]["socket"]


# ---- systemd ---------------------------------------------------------------------------------

UNIT = DEPLOY / "systemd" / "kvpoold.service"
TOML = DEPLOY / "systemd" / "kvpoold.toml"


def test_systemd_unit_fields():
    unit = unit_file(UNIT)
    svc = dict(unit["Service"])
    assert svc["LimitMEMLOCK"] == "infinity"
    assert svc["RuntimeDirectory"] == "kvpool" and svc["RuntimeDirectoryMode"] == "0750"
    assert svc["User"] == "kvpool" and svc["Group"] == "kvpool"
    assert svc["Restart"] == "on-failure"
    assert svc["RemoveIPC"] == "no"
    assert "/dev/shm" in svc["ReadWritePaths"].split()
    assert svc["StateDirectory"] == "kvpool" and svc["StateDirectoryMode"] == "0700"
    assert f"--config /etc/kvpool/{TOML.name}" in svc["ExecStart"]
    # Options that hide /dev/nvidia* or the host's /dev/shm, or delete the pool on stop.
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
                "MemoryDenyWriteExecute", "PrivateIPC", "DynamicUser", "PrivateNetwork"):
        assert key not in svc, f"{key} breaks CUDA, the shm pool or the endpoints"
    assert "StartLimitBurst" in dict(unit["Unit"])
    assert dict(unit["Install"])["WantedBy"] == "multi-user.target"
    users = (DEPLOY / "systemd" / "kvpool.sysusers.conf").read_text()
    assert re.search(r"^g\s+kvpool\b", users, re.M) and re.search(r"^u\s+kvpool\b", users, re.M)


def test_example_toml_is_valid_and_documents_every_setting():
    raw = toml_layer(TOML)
    config = build_config(DaemonConfig, raw)
    assert config.socket == SOCKET and config.socket_mode == "0660"
    assert config.keep_pool
    assert config.metrics_host == "127.0.0.1"
    missing = set(DaemonConfig.__struct_fields__) - set(raw)
    assert not missing, f"deploy/systemd/kvpoold.toml does not document {sorted(missing)}"


def test_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    # verify insists the ExecStart binary exists; point it at one that does.
    text = UNIT.read_text().replace("/usr/local/bin/kvpoold", shutil.which("true") or "/bin/true")
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True,
                       timeout=60)
    out = (r.stdout + r.stderr).strip()
    if r.returncode != 0 and ("Failed to" in out and "bus" in out.lower()):
        pytest.skip(f"systemd-analyze cannot run here: {out[:200]}")
    assert r.returncode == 0 and not out, out


# ---- container image -------------------------------------------------------------------------

def test_dockerfile():
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    stages = re.split(r"^FROM ", text, flags=re.M)
    daemon = next(s for s in stages if s.startswith("${CUDA_IMAGE} AS kvpoold"))
    assert stages[-1] is daemon, "the daemon image must be the default (last) stage"
    users = re.findall(r"^USER (\S+)", daemon, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert f"--gid {GID} kvpool" in daemon and f"USER {GID}:{GID}" in daemon
    assert re.search(r'^ENTRYPOINT \["kvpoold"\]', daemon, re.M)
    assert f"KVPOOL_SOCKET={SOCKET}" in daemon and "KVPOOL_SOCKET_MODE=0660" in daemon
    # The remote tier: the Mooncake extra (which brings mooncake_master) and its libraries.
    assert '"/src/kvpool[mooncake]"' in daemon
    for lib in ("libibverbs1", "librdmacm1", "libnuma1"):
        assert lib in daemon, f"{lib}: Mooncake's binaries load it even over TCP"
    # Both images install kvpool from its source: setup.py builds the scheduler's index probe
    # and the daemon's index writer; the daemon image has a compiler while it does, and fails
    # its build if the writer did not compile (the Python writer costs a third more loop time).
    for stage in stages[1:]:
        copies = re.findall(r"^COPY (pyproject.toml .*)$", stage, re.M)
        assert copies and "setup.py" in copies[0].split(), (stage.split()[2], copies)
    build = next(r for r in re.findall(r"^RUN (?:.*\\\n)*.*$", daemon, re.M)
                 if "/src/kvpool[mooncake]" in r)
    assert build.index("gcc") < build.index("pip install") < build.index("_index_writer") \
        < build.index("purge"), build
    for compiled in ("_pool_records", "_slot_record", "_lru"):   # the store path's C pieces
        assert build.index("pip install") < build.index(compiled) < build.index("purge"), \
            f"the daemon image does not check that {compiled} compiled"


# ---- compose ---------------------------------------------------------------------------------

def test_compose_shares_ipc_pid_socket_and_gpus():
    doc = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    kv, vllm = doc["services"]["kvpoold"], doc["services"]["vllm"]
    config = kvpool_config(env_of(kv))
    assert kv["ipc"] == "shareable"
    assert vllm["ipc"] == "service:kvpoold" and vllm["pid"] == "service:kvpoold"
    assert kv["ulimits"]["memlock"] == -1
    assert parse_size(kv["shm_size"].upper().replace("GB", "GiB")) > parse_size(config.pool_size)
    run_dir = [v for v in kv["volumes"] if v.endswith(":/run/kvpool")]
    assert run_dir and run_dir[0] in vllm["volumes"]
    assert run_dir[0].split(":")[0] in doc["volumes"]
    assert config.socket == SOCKET == connector_socket(vllm["command"])
    assert config.socket_mode == "0660" and str(GID) in [str(g) for g in vllm["group_add"]]
    assert vllm["depends_on"]["kvpoold"]["condition"] == "service_healthy"
    for svc in (kv, vllm):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    published = {p.rsplit(":", 1)[-1] for p in kv["ports"]}
    assert str(config.metrics_port) in published
    assert all(p.startswith("127.0.0.1:") for p in kv["ports"]), "keep metrics/events local"


# ---- Kubernetes ------------------------------------------------------------------------------

def test_pod_with_native_sidecar():
    pod = yaml.safe_load((DEPLOY / "kubernetes" / "pod-sidecar.yaml").read_text())
    spec = pod["spec"]
    (kv,) = [c for c in spec["initContainers"] if c["name"] == "kvpoold"]
    (vllm,) = spec["containers"]
    assert kv["restartPolicy"] == "Always", "native sidecar: init container that keeps running"
    assert spec["shareProcessNamespace"] is True, "CUDA IPC needs one PID namespace"
    assert GID in spec["securityContext"]["supplementalGroups"]
    config = kvpool_config(env_of(kv))
    assert config.socket == SOCKET == connector_socket(vllm["args"])
    assert config.socket_mode == "0660"

    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in (kv, vllm):
        assert volumes[mounts(c)["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert "emptyDir" in volumes[mounts(c)["/run/kvpool"]]
    assert mounts(kv)["/dev/shm"] == mounts(vllm)["/dev/shm"]
    assert mounts(kv)["/run/kvpool"] == mounts(vllm)["/run/kvpool"]
    shm = k8s_bytes(volumes[mounts(kv)["/dev/shm"]]["emptyDir"]["sizeLimit"])
    pool = parse_size(config.pool_size)
    assert shm > pool
    # tmpfs pages are charged to the container that touches them first: the daemon.
    assert k8s_bytes(kv["resources"]["limits"]["memory"]) > pool

    assert env_of(kv)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in kv.get("resources", {}).get("limits", {})
    assert int(vllm["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    ctx = kv["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == GID
    ports = {p["name"]: p["containerPort"] for p in kv["ports"]}
    assert ports["metrics"] == config.metrics_port and config.metrics_host == "0.0.0.0"
    for probe in ("startupProbe", "livenessProbe"):
        assert kv[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_daemonset_and_its_engine():
    ds, engine = yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    assert ds["kind"] == "DaemonSet" and engine["kind"] == "Deployment"
    spec, espec = ds["spec"]["template"]["spec"], engine["spec"]["template"]["spec"]
    for s in (spec, espec):
        assert s["hostIPC"] is True and s["hostPID"] is True
    (kv,) = spec["containers"]
    (vllm,) = espec["containers"]
    config = kvpool_config(env_of(kv))
    assert config.socket == SOCKET == connector_socket(vllm["args"])
    assert config.socket_mode == "0660" and config.keep_pool
    assert GID in espec["securityContext"]["supplementalGroups"]
    for s, c in ((spec, kv), (espec, vllm)):
        vols = {v["name"]: v for v in s["volumes"]}
        assert vols[mounts(c)["/run/kvpool"]]["hostPath"]["path"] == "/run/kvpool"
    (init,) = spec["initContainers"]
    assert f"chown {GID}:{GID} /run/kvpool" in " ".join(init["command"])
    # The pool (tmpfs, charged to the daemon) and the memory it lends to the Mooncake Store.
    assert k8s_bytes(kv["resources"]["limits"]["memory"]) > (
        parse_size(config.pool_size) + parse_size(config.remote_segment_size))
    assert env_of(kv)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in kv["resources"].get("limits", {})
    assert kv["securityContext"]["runAsNonRoot"] is True


def _master_flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--"))


def test_mooncake_master_deployment_service_and_daemonset_flag():
    dep, svc = yaml.safe_load_all((DEPLOY / "kubernetes" / "mooncake-master.yaml").read_text())
    assert dep["kind"] == "Deployment" and svc["kind"] == "Service"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (master,) = pod["spec"]["containers"]
    assert master["command"] == ["mooncake_master"]
    flags = _master_flags(master["args"])
    assert flags["enable_http_metadata_server"] == "true"
    named = {p["name"]: p["containerPort"] for p in master["ports"]}
    assert named["rpc"] == int(flags["rpc_port"])
    assert named["metadata"] == int(flags["http_metadata_server_port"]) == DEFAULT_METADATA_PORT
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["rpc"]["targetPort"] == "rpc" and svc_ports["metadata"]["targetPort"] == "metadata"
    assert master["securityContext"]["runAsNonRoot"] is True

    ds, _ = yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    (kv,) = ds["spec"]["template"]["spec"]["containers"]
    url = parse_remote_url(kvpool_config(env_of(kv)).remote_store)
    name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
    assert url.master_host == f"{name}.{ns}.svc.cluster.local" and ns == ds["metadata"]["namespace"]
    assert url.rpc_port == svc_ports["rpc"]["port"] and url.protocol == "tcp"
    assert url.metadata == f"http://{url.master_host}:{svc_ports['metadata']['port']}/metadata"


def test_compose_remote_tier_two_hosts_and_a_master():
    doc = yaml.safe_load((DEPLOY / "compose" / "remote-tier.yml").read_text())
    services = doc["services"]
    master = services["mooncake-master"]
    assert master["entrypoint"] == ["mooncake_master"]
    flags = _master_flags(master["command"])
    assert flags["enable_http_metadata_server"] == "true"
    hosts = [services["kvpoold-a"], services["kvpoold-b"]]
    run_dirs = set()
    for kv in hosts:
        config = kvpool_config(env_of(kv))
        url = parse_remote_url(config.remote_store)
        assert url.master_host == "mooncake-master" and url.rpc_port == int(flags["rpc_port"])
        assert url.metadata == (f"http://mooncake-master:{flags['http_metadata_server_port']}"
                                f"/metadata")
        assert kv["depends_on"]["mooncake-master"]["condition"] == "service_healthy"
        assert kv["ipc"] == "shareable", "each host its own /dev/shm"
        assert parse_size(kv["shm_size"].upper().replace("GB", "GiB")) > parse_size(config.pool_size)
        assert parse_size(kv["mem_limit"].upper().replace("G", "GiB")) > (
            parse_size(config.pool_size) + parse_size(config.remote_segment_size))
        assert config.cuda == "off" and parse_size(config.remote_segment_size) > 0
        (run,) = [v for v in kv["volumes"] if v.endswith(":/run/kvpool")]
        run_dirs.add(run)
        assert all(p.startswith("127.0.0.1:") for p in kv["ports"])
    assert len(run_dirs) == 2, "each host its own socket directory"


# ---- Grafana ---------------------------------------------------------------------------------

def test_dashboard_queries_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "kvpool-dashboard.json").read_text())
    metrics = Metrics()
    disk = TierInfo("disk", True, "/var/lib/kvpool/disk", 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    metrics.update_from_info(PoolInfo("d", 0.0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, [],
                                      tiers=[disk]))
    metrics.observe_store(1, 0.001)
    metrics.count_error(1)
    exported = set(re.findall(r"^(kvpool_\w+?)(?:\{| )", metrics.render().decode(), re.M))
    queried = set()
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            queried |= set(re.findall(r"\bkvpool_\w+", t["expr"]))
    assert queried, "no queries found"
    assert queried <= exported, f"dashboard queries unknown metrics: {queried - exported}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance"}
