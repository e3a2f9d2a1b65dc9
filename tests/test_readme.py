"""The README stays true: its settings table matches the code, its example runs."""

import os
import re
import subprocess
import sys
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


def test_every_file_in_the_module_map_exists():
    section = README[README.index("**Module map.**"):README.index("**Life of one store**")]
    named = set(re.findall(r"`((?:shared|daemon|client|bench|deploy|tests)/[\w./]*)`", section))
    assert len(named) > 30, sorted(named)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the README's module map names files that do not exist: {missing}"


def test_a_newcomer_reaches_the_first_command_early():
    first = README.split("\n").index("```bash") + 1
    assert first <= 40, f"the first command is on line {first + 1}"
    assert "kvpoold" in README[:README.index("## Architecture")]
