"""The project imports the same way from anywhere: from the checkout's root (where its ``kvpool/``
folder is found first), from elsewhere, installed editable or not; and its own scripts need no
``sys.path`` edits for it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

# Drops the editable install's finder, as a plain ``pip install .`` has none: what is left is
# the checkout's root on sys.path (the working directory of ``python -c``).
_NO_EDITABLE = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                "if 'editable' not in repr(f).lower()]; ")


def test_the_checkout_root_imports_every_package_of_its_own():
    code = _NO_EDITABLE + ("import kvpool.client.scheduler, kvpool.daemon.pool, "
                           "kvpool.shared.config, kvpool.client.vllm.keys as k; print(k.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == ROOT / "client" / "vllm" / "keys.py"


def test_no_script_edits_sys_path():
    edits = []
    for path in [*ROOT.glob("bench/**/*.py"), *ROOT.glob("tests/**/*.py"),
                 *ROOT.glob("daemon/*.py"), *ROOT.glob("client/**/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"sys\.path\.(insert|append)\(|sys\.path\s*=", line):
                edits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not edits, "run scripts as `python -m bench.NAME` from the root instead:\n" + \
        "\n".join(edits)
