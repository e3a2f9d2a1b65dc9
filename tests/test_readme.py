"""The README stays true: its quick start and its example run as pasted, its tables match the
code."""

import ast
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

from kvpool.daemon.cli import settings_table

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_settings_table_matches_the_config():
    m = re.search(r"<!-- settings table.*?-->\n(.*?)\n<!-- end settings table -->", README, re.S)
    assert m, "README lost its settings table markers"
    assert m.group(1).strip() == settings_table().strip(), \
        "README settings table is stale: paste kvpool.daemon.cli.settings_table() into it"


# The README installs kvpool with a plain ``pip install .``, which has no editable finder: run
# from the checkout's root, its kvpool/ folder comes first on sys.path and must do on its own.
_AS_PLAIN_INSTALL = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                     "if 'editable' not in repr(f).lower()]\n")


def test_python_example_runs_again_and_again_from_any_directory(daemon_factory, tmp_path):
    """Pasted into ``python``, three times against one daemon (the second run finds its blocks
    pooled), once in the checkout's root."""
    daemon = daemon_factory(subdir="kvpool")     # the default socket under XDG_RUNTIME_DIR
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert len([line for line in code.strip().splitlines() if line.strip()]) <= 20
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    assert daemon.socket == str(tmp_path / "kvpool" / "kvpoold.sock")
    for run, cwd in enumerate((tmp_path, ROOT, tmp_path)):
        prelude = _AS_PLAIN_INSTALL if cwd == ROOT else ""
        r = subprocess.run([sys.executable, "-"], input=prelude + code + "\nmem.close()\n"
                           "print('example ok')\n", capture_output=True, text=True,
                           timeout=120, cwd=cwd, env=env)
        assert r.returncode == 0 and "example ok" in r.stdout, \
            f"run {run + 1} (in {cwd}) failed:\n{r.stderr[-3000:]}"


def test_every_connector_key_is_documented():
    from kvpool.client.vllm import CONNECTOR_KEYS
    from kvpool.shared.config import ClientConfig

    section = README[README.index("**`kv_connector_extra_config` keys**"):]
    section = section[:section.index("\n\n", section.index("| key |"))]
    documented = set(re.findall(r"^\| `(\w+)`(?: / `(\w+)`)?", section, re.M))
    documented = {k for pair in documented for k in pair if k}
    want = set(CONNECTOR_KEYS) | set(ClientConfig.__struct_fields__)
    assert documented == want, (f"undocumented: {sorted(want - documented)}, "
                                f"documented but unknown: {sorted(documented - want)}")


# Names the README gives in backticks that are not kvpool's: vLLM's (its connector API, its
# schedulers, its KV events and their config), systemd's and Kubernetes'. Anything else it
# names must exist in this checkout.
EXTERNAL_NAMES = {"Scheduler", "AsyncScheduler", "MambaSpec", "KVConnectorBase_V1", "SupportsHMA",
                  "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventsConfig",
                  "WAITING_FOR_REMOTE_KVS", "LLM", "schedule()",
                  "DeviceAllow", "DynamicUser", "ExecStart", "ExecStartPre",
                  "MemoryDenyWriteExecute", "NoNewPrivileges", "PrivateDevices", "ProtectClock",
                  "ProtectSystem", "RuntimeDirectory", "Memory", "Recreate"}
_PACKAGES = {"kvpool.shared": "shared", "kvpool.daemon": "daemon", "kvpool.client": "client"}


def _source_index() -> tuple[dict[str, Path], dict[str, set[str]], dict[str, set[str]]]:
    """Without importing anything (the connector's modules import vLLM): the module name of
    every source file, the names each defines at top level, the attributes of every class."""
    modules: dict[str, Path] = {"kvpool": ROOT / "kvpool" / "__init__.py"}
    for package, folder in _PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    top: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        top[name] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top[name].add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    top[name].update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(node, ast.ClassDef):
                attrs = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attrs.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        attrs.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return modules, top, classes


def test_every_name_the_readme_gives_exists():
    """Paths, files, modules, ``module.attr``, classes and ``Class.attr`` that the README puts
    in backticks (or links to) exist in this checkout, so the README cannot drift from the
    code: a rename that forgets the README fails here."""
    modules, top, classes = _source_index()
    tracked = {Path(p).name for p in subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
        capture_output=True, text=True, check=True).stdout.split()}
    spans = set(re.findall(r"`([^`\n]+)`", README))
    spans |= {link for link in re.findall(r"\]\(([^)#\s]+)", README) if "://" not in link}
    missing = []
    for span in sorted(spans):
        name = span.removesuffix("()").rstrip(":")
        if span in EXTERNAL_NAMES or name in EXTERNAL_NAMES:
            continue
        if re.fullmatch(r"(shared|daemon|client|bench|deploy|tests|kvpool|\.ci)/[\w./-]*", name):
            if not (ROOT / name).exists():
                missing.append(f"path {name}")
        elif re.fullmatch(r"[\w-]+\.(py|toml|yaml|yml|json|sh|md)", name):
            if name not in tracked:
                missing.append(f"file {name}")
        elif re.fullmatch(r"kvpool(\.\w+)+", name):
            module = max((m for m in modules if name == m or name.startswith(m + ".")), key=len)
            rest = name[len(module) + 1:].split(".") if name != module else []
            if rest and rest[0] not in top[module]:
                missing.append(f"{rest[0]} in {module}")
            elif len(rest) > 1 and rest[1] not in classes.get(rest[0], set()):
                missing.append(f"{name}")
        elif re.fullmatch(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9_]*", name):
            if name not in classes:
                missing.append(f"class {name}")
        elif re.fullmatch(r"[A-Z]\w*\.\w+", name):
            cls, attr = name.split(".")
            if attr not in classes.get(cls, set()):
                missing.append(f"{name}")
    assert len(spans) > 100, len(spans)
    assert not missing, f"the README names what the code does not have: {missing}"
    # and the module map pairs each file with classes that it defines
    section = README[README.index("**Module map.**"):README.index("**Life of one store**")]
    for path, names in re.findall(r"`((?:shared|daemon|client)/[\w/]+\.py)` \(([^)]*)\)", section):
        module = next(m for m, p in modules.items() if p == ROOT / path)
        for cls in re.findall(r"`([A-Z]\w+)`", names):
            assert cls in top[module], f"the module map puts {cls} in {path}"


def test_a_newcomer_reaches_the_first_command_early():
    first = README.split("\n").index("```bash") + 1
    assert first <= 40, f"the first command is on line {first + 1}"
    assert "kvpoold" in README[:README.index("## Architecture")]


def _fresh_clone(dest: Path) -> Path:
    """The checkout's files as a clone has them (tracked and new, nothing ignored: no .venv)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def test_the_quick_start_pasted_into_a_fresh_shell_ends_with_a_pong(tmp_path):
    """The README's first block, as written, in a fresh bash, in a fresh clone, in a new virtual
    environment: pip installs kvpool (not editable), the daemon starts in the background, and
    the ping waits for it. The venv sees this one's packages (a .pth file), so the torch line
    finds torch installed and downloads nothing. Only the pool is small (64 MiB, by env) and
    /metrics off (port 9471 may be another daemon's on a shared host)."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "pip install ." in block and "kvpoold &" in block and "kvpool ping" in block, block
    clone = _fresh_clone(tmp_path / "kvpool")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    pool_name = f"kvpool-quickstart-{os.getpid()}"
    env = {**{k: v for k, v in os.environ.items() if k.startswith("PIP_")},
           "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"),
           "XDG_RUNTIME_DIR": str(run_dir), "KVPOOL_POOL_SIZE": "64MiB",
           "KVPOOL_POOL_NAME": pool_name, "KVPOOL_METRICS_PORT": "0"}
    script = block + 'kill "$!"; wait "$!"\n'
    shell = subprocess.Popen(["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=clone, env=env,
                             start_new_session=True)
    try:
        out, err = shell.communicate(script, timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert re.search(r"^pong from kvpoold \w+ in \d+ us", out, re.M), \
        f"no pong:\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    assert "Traceback" not in err, err[-5000:]
    assert not Path(f"/dev/shm/{pool_name}").exists(), "the stopped daemon left its pool"
