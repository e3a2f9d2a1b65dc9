"""The README stays true: its settings table matches the code, its example runs."""

import re
import subprocess
import sys
from pathlib import Path

from kvpool.daemon.cli import settings_table

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_settings_table_matches_the_config():
    m = re.search(r"<!-- settings table.*?-->\n(.*?)\n<!-- end settings table -->", README, re.S)
    assert m, "README lost its settings table markers"
    assert m.group(1).strip() == settings_table().strip(), \
        "README settings table is stale: paste kvpool.daemon.cli.settings_table() into it"


def test_python_example_runs_against_a_daemon(daemon, tmp_path):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    code = code.replace("config.ClientConfig()", f"config.ClientConfig(socket={daemon.socket!r})")
    script = tmp_path / "example.py"
    script.write_text(code + "\nmem.close()\nprint('example ok')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "example ok" in r.stdout, r.stderr
    assert len([line for line in code.strip().splitlines() if line.strip()]) <= 17


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


ROOT = Path(__file__).parent.parent


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
