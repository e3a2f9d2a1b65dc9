"""Hard-link torch's installed files from one venv into another of the same Python.

Both of CI's venvs carry the same CPU build of torch 2.13.0 (750 MB); linking the second copy
instead of unpacking it keeps the install inside a small CI disk. Only what torch's RECORD lists
under site-packages is linked (its console scripts point at the other venv's python); pip then
finds torch installed and leaves it. Does nothing, and says why, where the link cannot be made.

    python .ci/link-torch.py FROM_VENV TO_VENV
"""

import os
import sys
from pathlib import Path


def site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    return found[0] if len(found) == 1 else None


def main(source_venv: str, target_venv: str) -> int:
    source, target = site_packages(Path(source_venv)), site_packages(Path(target_venv))
    if source is None or target is None or source.parent.name != target.parent.name:
        print(f"link-torch: no single matching site-packages in {source_venv} and {target_venv}")
        return 0
    dist_infos = sorted(source.glob("torch-*.dist-info"))
    if len(dist_infos) != 1:
        print(f"link-torch: no torch installed in {source_venv}")
        return 0
    if list(target.glob("torch-*.dist-info")):
        print(f"link-torch: {target_venv} has torch already")
        return 0
    record = (dist_infos[0] / "RECORD").read_text().splitlines()
    relative_paths = [line.rsplit(",", 2)[0] for line in record if line]
    linked = 0
    try:
        for relative in relative_paths:
            if relative.startswith("..") or not (source / relative).is_file():
                continue
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            os.link(source / relative, target / relative)
            linked += 1
    except OSError as error:
        # A half-linked torch would look installed to pip: take it all back.
        for relative in relative_paths:
            if not relative.startswith(".."):
                (target / relative).unlink(missing_ok=True)
        print(f"link-torch: cannot link ({error}); pip will install torch")
        return 0
    print(f"link-torch: {linked} files of {dist_infos[0].name} linked into {target_venv}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
