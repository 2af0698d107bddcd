"""Make a copy of this checkout with the request hot path compiled by mypyc (setup.py's HOT_PATH),
in place in the copy: its extension modules shadow the sources there, never here.

    python scripts/compiled_copy.py DIR

scripts/test runs the whole suite again in such a copy (so the compiled build is tested exactly as
the interpreted one), and benchmarks/proxy_overhead.py measures one.  The copy holds every file
git tracks or would track (uncommitted work included), without .git or ignored files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=dest,
        env={**os.environ, "FLEET_ROUTER_COMPILE": "1"},
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        sys.stderr.write(build.stdout[-20_000:] + build.stderr[-20_000:])
        raise SystemExit(f"compiling the hot path failed (exit {build.returncode})")
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(compiled_copy(Path(sys.argv[1]).resolve()))
