"""kvpoold and kvpool as an operator runs them: config checks, exit codes, signals, info."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import posix_ipc
import pytest

from kvpool.client.scheduler import SchedulerClient
from tests.conftest import wait_for
from bench.kvtest import HostKv, keyed_store


def kvpool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from kvpool.daemon.cli import operator_main; "
                           "operator_main()", *args], capture_output=True, text=True, timeout=60)


def kvpoold(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.daemon", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def shm_exists(name: str) -> bool:
    try:
        posix_ipc.SharedMemory("/" + name, 0).close_fd()
        return True
    except posix_ipc.ExistentialError:
        return False


def test_check_config_merges_file_env_and_flags(tmp_path):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text('pool_size = "1GiB"\nlease_ttl_s = 3.0\nlog_format = "json"\n')
    r = kvpoold("--config", str(cfg), "--check-config", "--pool-size", "2GiB",
                env={"KVPOOL_LEASE_TTL_S": "4", "KVPOOL_POOL_SIZE": "3GiB"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["pool_size"], out["lease_ttl_s"], out["log_format"]) == ("2GiB", 4.0, "json")


def test_bad_config_fails_at_start_naming_the_key(tmp_path):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text('pool_sise = "1GiB"\n')
    r = kvpoold("--config", str(cfg), "--check-config")
    assert r.returncode == 2 and "pool_sise" in r.stderr
    r = kvpoold("--lease-ttl-s", "-5", "--check-config")
    assert r.returncode == 2 and "lease_ttl_s" in r.stderr


def test_a_loop_cpu_the_daemon_may_not_run_on_is_refused_before_the_start_takes_anything():
    outside = max(os.sched_getaffinity(0)) + 1
    r = kvpoold("--loop-cpu", str(outside), "--check-config")
    assert r.returncode == 2, r.stderr
    assert f"loop_cpu={outside} is not a CPU kvpoold may run on" in r.stderr, r.stderr
    r = kvpoold("--loop-cpu", str(min(os.sched_getaffinity(0))), "--check-config")
    assert r.returncode == (0 if len(os.sched_getaffinity(0)) > 1 else 2), r.stderr


def test_the_documented_config_variable_names_the_file(tmp_path):
    cfg = tmp_path / "kvpool.toml"
    cfg.write_text('lease_ttl_s = 3.0\n')
    r = kvpoold("--check-config", env={"KVPOOL_CONFIG": str(cfg)})
    assert r.returncode == 0 and json.loads(r.stdout)["lease_ttl_s"] == 3.0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    r = kvpoold("--check-config", env={"KVPOOL_CONFIG_FILE": str(cfg)})      # the old spelling
    assert r.returncode == 0 and json.loads(r.stdout)["lease_ttl_s"] == 3.0, r.stderr
    assert "warning: KVPOOL_CONFIG_FILE is deprecated" in r.stderr, r.stderr
    r = kvpoold("--check-config", "--config", str(tmp_path / "none.toml"),
                env={"KVPOOL_CONFIG": str(cfg)})                              # the flag wins
    assert r.returncode == 2 and "none.toml" in r.stderr


def test_version_and_a_misspelled_variable():
    for tool in (kvpoold, kvpool):
        r = tool("--version")
        assert r.returncode == 0 and r.stdout.split(", version ")[1].strip()[0].isdigit(), r
    r = kvpoold("--check-config", env={"KVPOOL_POOL_SISE": "1GiB"})
    assert r.returncode == 0
    assert "warning: KVPOOL_POOL_SISE is not a kvpool setting (did you mean KVPOOL_POOL_SIZE?)" \
        in r.stderr, r.stderr


# Refused by --check-config and by a start alike, before the start takes anything.
def _has_cuda() -> bool:
    from kvpool.daemon import cuda
    try:
        return cuda.is_available()
    except Exception:
        return False


_REFUSED = [(["--allow-uid", "no-such-user-kvpool"], "allow_uid: no user named"),
            (["--allow-gid", "no-such-group-kvpool"], "allow_gid: no group named"),
            (["--pool-size", "100TiB"], "pool_size: the pool needs"),
            (["--pool-size", "5MiB", "--extent-size", "4MiB"], "too small for extent_size"),
            (["--events-topic", "{model}"], "events_topic"),
            (["--remote-store", "mooncake://"], "remote_store"),
            pytest.param(["--cuda", "on"], "cuda=on but CUDA is not available",
                         marks=pytest.mark.skipif(_has_cuda(), reason="CUDA is available")),
            (["--peer-timeout-ms", "5"], "expected a whole number from 100 to 600000")]


@pytest.mark.parametrize("args,message", _REFUSED, ids=["allow-uid", "allow-gid", "pool-size",
                                                          "extent-size", "events-topic",
                                                          "remote-store", "cuda",
                                                          "peer-timeout"])
def test_check_config_refuses_what_a_start_refuses_and_the_start_leaves_nothing(
        args, message, tmp_path):
    name = f"kvpool-refused-{os.getpid()}"
    common = ["--socket", str(tmp_path / "k.sock"), "--pool-name", name, "--metrics-port", "0"]
    if "--pool-size" not in args:
        common += ["--pool-size", "16MiB", "--extent-size", "1MiB"]
    checked = kvpoold(*common, *args, "--check-config")
    started = kvpoold(*common, *args)
    for r in (checked, started):
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not shm_exists(name) and not (tmp_path / "k.sock").exists()


def _held_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


# Starts that fail once they have taken something: each exits 3 with one line that names
# what to change, and takes back what it took.
_FAILED_STARTS = {
    "metrics port taken": lambda tmp, port: (["--metrics-port", str(port)], "metrics_port"),
    "events endpoint": lambda tmp, port: (["--events-endpoint", f"tcp://127.0.0.1:{port}"],
                                          "events_endpoint: cannot bind"),
    "disk path": lambda tmp, port: (["--disk-path", str(tmp / "a-file")], "disk_path"),
    "trace file": lambda tmp, port: (["--trace", str(tmp / "no-dir" / "t")],
                                     "trace: cannot open"),
}


@pytest.mark.parametrize("keep_pool", [False, True], ids=["", "keep-pool"])
@pytest.mark.parametrize("case", list(_FAILED_STARTS))
def test_a_start_that_fails_after_taking_the_pool_leaves_nothing_behind(case, keep_pool,
                                                                         tmp_path):
    (tmp_path / "a-file").write_text("")
    name = f"kvpool-failed-{os.getpid()}"
    held = _held_port()
    try:
        args, message = _FAILED_STARTS[case](tmp_path, held.getsockname()[1])
        r = kvpoold("--socket", str(tmp_path / "k.sock"), "--pool-name", name, "--pool-size",
                    "16MiB", "--extent-size", "1MiB", "--cuda", "off", "--metrics-port", "0",
                    *(["--keep-pool"] if keep_pool else []), *args)
    finally:
        held.close()
    assert r.returncode == 3 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not shm_exists(name), "a failed start left its new pool in /dev/shm"
    assert not (tmp_path / "k.sock").exists()


def test_a_failed_start_keeps_an_adopted_pool_the_operator_keeps(tmp_path):
    name = f"kvpool-adopted-{os.getpid()}"
    common = ["--socket", str(tmp_path / "k.sock"), "--pool-name", name, "--pool-size", "16MiB",
              "--extent-size", "1MiB", "--cuda", "off", "--metrics-port", "0", "--keep-pool"]
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.daemon", *common],
                            stderr=subprocess.PIPE, text=True)
    try:
        r = kvpool("ping", "--socket", str(tmp_path / "k.sock"), "--wait", "60")
        assert r.returncode == 0, r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    try:
        assert shm_exists(name)
        held = _held_port()
        try:
            r = kvpoold(*common, "--metrics-port", str(held.getsockname()[1]))
        finally:
            held.close()
        assert r.returncode == 3 and "metrics_port" in r.stderr, r.stderr
        assert shm_exists(name), "a failed start dropped the cache the operator keeps"
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + name)


def test_a_stop_signal_during_the_start_leaves_nothing_behind(tmp_path):
    """SIGTERM (systemd's stop) while the pool is being reserved, before the server's loop
    handles signals: the start is abandoned cleanly (exit 0), the new pool unlinked although
    the operator keeps pools (``--keep-pool`` keeps only a pool a start adopted). A signal
    that comes once the daemon serves (a loaded machine can let the 512 MiB reservation finish
    first) gets a normal stop, which keeps the pool: that try is cleaned up and made again."""
    name = f"kvpool-sigterm-{os.getpid()}"
    outcomes = []
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-m", "kvpool.daemon", "--socket",
                                 str(tmp_path / "k.sock"), "--pool-name", name, "--pool-size",
                                 "512MiB", "--cuda", "off", "--metrics-port", "0",
                                 "--keep-pool"], stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: shm_exists(name) or proc.poll() is not None, 60,
                     "the daemon to create its pool", every_s=0.002)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            left = shm_exists(name)
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory("/" + name)
        assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
        if "before serving" in err:
            assert not left, "the stopped start left its pool in /dev/shm"
            return
        assert "pool kept for the next start" in err, err[-3000:]   # a normal stop
        outcomes.append(attempt)
    raise AssertionError(f"the signal came after the start in all {len(outcomes)} tries")


def test_second_daemon_on_the_same_pool_or_socket_fails_to_start(daemon, tmp_path):
    r = kvpoold("--socket", str(tmp_path / "other.sock"), "--pool-name", daemon.pool_name,
                "--pool-size", daemon.pool_size, "--extent-size", "1MiB", "--cuda", "off")
    assert r.returncode == 3 and "owned by another running kvpoold" in r.stderr
    r = kvpoold("--socket", daemon.socket, "--pool-name", daemon.pool_name + "-b",
                "--pool-size", "16MiB", "--extent-size", "1MiB", "--cuda", "off")
    assert r.returncode != 0 and "another daemon is serving" in r.stderr
    assert not shm_exists(daemon.pool_name + "-b")


def test_ping_and_info(daemon):
    r = kvpool("ping", "--socket", daemon.socket)
    assert r.returncode == 0 and "pong from kvpoold" in r.stdout
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config(), name="tp0")
    r = kvpool("info", "--socket", daemon.socket)
    assert r.returncode == 0, r.stderr
    assert "pool" in r.stdout and "tp0" in r.stdout and "hit rate" not in r.stdout
    r = kvpool("info", "--socket", daemon.socket, "--json")
    info = json.loads(r.stdout)
    assert info["pool_bytes"] > 0 and info["free_bytes"] == info["pool_bytes"]
    assert [c["role"] for c in info["clients"] if c["name"] == "tp0"] == ["worker"]
    worker.close()
    kv.close()


def test_operator_commands_do_not_count_themselves_as_clients(daemon):
    """The README's check "kvpool info shows no client connected" can be seen: info and top
    connect as operators and list engines' schedulers and workers only."""
    r = kvpool("info", "--socket", daemon.socket)
    assert r.returncode == 0, r.stderr
    assert "clients    none connected" in r.stdout, r.stdout
    r = kvpool("info", "--socket", daemon.socket, "--json")
    assert json.loads(r.stdout)["clients"] == []
    r = kvpool("top", "--socket", daemon.socket, "--iterations", "1")
    assert r.returncode == 0 and "clients  0   engines 0" in r.stdout, r.stdout + r.stderr
    kv = HostKv()
    worker, _ = kv.register(daemon.client_config(), name="tp0")
    try:
        r = kvpool("info", "--socket", daemon.socket)
        assert "clients    1" in r.stdout and "tp0" in r.stdout and "kvpool-cli" not in r.stdout
    finally:
        worker.close()
        kv.close()


def test_ping_wait_answers_once_a_starting_daemon_serves(daemon_factory, tmp_path):
    """``kvpool ping --wait`` started before the daemon: it waits (saying so), then pongs."""
    d = daemon_factory(start=False)
    ping = subprocess.Popen([sys.executable, "-c", "from kvpool.daemon.cli import operator_main;"
                             " operator_main()", "ping", "--socket", d.socket, "--wait", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ping.poll() is not None or ping.stderr.readline(), 30,
                 "ping --wait to say it waits")
        assert ping.poll() is None, "ping --wait gave up on a daemon that had not started"
        d.start()
        out, err = ping.communicate(timeout=60)
    finally:
        if ping.poll() is None:
            ping.kill()
    assert ping.returncode == 0 and out.startswith("pong from kvpoold"), out + err


def test_ping_wait_does_not_wait_on_a_socket_it_may_not_open(daemon, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the ping as another user (setpriv)")
    os.chmod(os.path.dirname(daemon.socket), 0o700)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", "from kvpool.daemon.cli import operator_main; "
                        "operator_main()", "ping", "--socket", daemon.socket, "--wait", "60"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "permission denied" in r.stderr, r.stderr
    assert "waiting" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_operator_commands_fail_cleanly_without_a_daemon(tmp_path):
    for cmd in ("ping", "info"):
        r = kvpool(cmd, "--socket", str(tmp_path / "none.sock"), "--timeout-ms", "300")
        assert r.returncode == 1 and "not reachable" in r.stderr and "Traceback" not in r.stderr


def test_sigterm_stops_cleanly_and_unlinks_the_pool(daemon):
    kv = HostKv()
    worker, reg = kv.register(daemon.client_config())
    sched = SchedulerClient(daemon.client_config())
    keyed_store(sched, worker, reg, kv.namespace, list(range(64)),
                kv.keys(list(range(64 * 16))))                 # still in flight, maybe
    assert daemon.stop(signal.SIGTERM) == 0
    assert not os.path.exists(daemon.socket)
    assert not shm_exists(daemon.pool_name)
    worker.close(); sched.close(); kv.close()


def test_keep_pool_survives_a_clean_restart(daemon_factory):
    d = daemon_factory(extra=["--keep-pool"])
    kv = HostKv()
    worker, reg = kv.register(d.client_config())
    sched = SchedulerClient(d.client_config())
    keys = kv.keys(list(range(48)))
    assert worker.wait([keyed_store(sched, worker, reg, kv.namespace, [0, 1, 2], keys)],
                       10)[0].ok
    worker.close(); sched.close()
    assert d.stop(signal.SIGINT) == 0
    assert shm_exists(d.pool_name)
    d.restart()
    sched = SchedulerClient(d.client_config())
    hits = wait_for(lambda: sched.lookup(kv.namespace, [keys]).hits, 10, "lookups after restart")
    assert hits == [3] and sched.info().adopted_blocks == 3
    sched.close(); kv.close()
