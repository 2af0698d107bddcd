"""Make a copy of this checkout with the request hot path compiled by mypyc (setup.py), its
extension modules beside the sources in the copy (where they shadow them), never here.

    python scripts/compiled_copy.py DIR

The extension modules come from a wheel built the way the image builds it: `pip` with build
isolation and FLEET_ROUTER_COMPILE=1, so the build environment is the one the image's build sees
(build_backend.py), not this one.  scripts/test runs the whole suite again in such a copy (the
compiled build tested exactly as the interpreted one), and benchmarks/proxy_overhead.py
measures one.  The copy holds every file git tracks or would track (uncommitted work included),
without .git or ignored files.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def checkout_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files (that exist: a deletion may be uncommitted)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (root / name).is_file()]


def compiled_copy(dest: Path, root: Path = ROOT) -> Path:
    """Copy `root`'s checkout to `dest` (which must be empty or absent) and compile it there."""
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise SystemExit(f"{dest} is not empty")
    for name in checkout_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    with tempfile.TemporaryDirectory(prefix="fr-wheel-") as wheel_dir:
        build = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", wheel_dir, "."],
            cwd=dest,
            env={**os.environ, "FLEET_ROUTER_COMPILE": "1"},
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            sys.stderr.write(build.stdout[-20_000:] + build.stderr[-20_000:])
            raise SystemExit(f"compiling the hot path failed (exit {build.returncode})")
        (wheel,) = Path(wheel_dir).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            extensions = [n for n in zf.namelist() if n.endswith(_EXTENSIONS)]
            if not extensions:
                raise SystemExit(f"{wheel.name} holds no extension module: nothing was compiled")
            zf.extractall(dest, members=extensions)
    # setuptools' by-products in the copy's tree: not part of a checkout.
    shutil.rmtree(dest / "build", ignore_errors=True)
    for egg_info in dest.glob("*.egg-info"):
        shutil.rmtree(egg_info)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(compiled_copy(Path(sys.argv[1]).resolve()))
