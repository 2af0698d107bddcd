"""The in-tree build backend (build_backend.py): what a compiled build asks for, and the one
combination it refuses.  Its hooks run as a PEP 517 frontend runs them: in a process of their
own, in the project's directory.  The compiled build itself is exercised by scripts/test, which
builds the wheel the image's way (scripts/compiled_copy.py) and runs the whole suite on it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[2]


def _hook(name: str, *, compile_switch: bool, args: tuple[str, ...] = ()) -> tuple[int, Any, str]:
    """(exit code, the hook's result as JSON, stderr) of `build_backend.<name>(*args)`."""
    env = {k: v for k, v in os.environ.items() if k != "FLEET_ROUTER_COMPILE"}
    if compile_switch:
        env["FLEET_ROUTER_COMPILE"] = "1"
    code = (
        "import json, os, sys; sys.path.insert(0, os.getcwd()); import build_backend; "
        f"result = build_backend.{name}(*sys.argv[1:]); "
        "print(json.dumps({'result': result, 'switch': os.environ.get('FLEET_ROUTER_COMPILE')}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = orjson.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else None
    return done.returncode, out, done.stderr


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_pyproject_names_the_in_tree_backend() -> None:
    system = _pyproject()["build-system"]
    assert system["build-backend"] == "build_backend" and system["backend-path"] == ["."]


def test_a_default_build_asks_for_nothing_more() -> None:
    for hook in ("get_requires_for_build_wheel", "get_requires_for_build_editable"):
        rc, out, err = _hook(hook, compile_switch=False)
        assert rc == 0, err
        assert not any(r.startswith(("mypy", "aiohttp")) for r in out["result"]), out


def test_a_compiled_build_asks_for_mypy_and_the_dependencies_types() -> None:
    rc, out, err = _hook("get_requires_for_build_wheel", compile_switch=True)
    assert rc == 0, err
    project = _pyproject()["project"]
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["compile"]]:
        assert requirement in out["result"]
    assert any(r.startswith("mypy") for r in out["result"])
    # setup.py ran without compiling to answer (mypy is not yet there in a fresh build
    # environment), and the switch is back for the build itself.
    assert out["switch"] == "1"


def test_a_compiled_editable_install_is_refused(tmp_path: Path) -> None:
    for hook, args in (
        ("get_requires_for_build_editable", ()),
        ("build_editable", (str(tmp_path),)),
    ):
        rc, _, err = _hook(hook, compile_switch=True, args=args)
        assert rc != 0 and "shadow every later edit" in err, (hook, err[-2000:])
    assert not any(tmp_path.iterdir())  # nothing was built
