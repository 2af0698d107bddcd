"""The Dockerfile, checked by reading it (no Docker engine here) and by building its wheel.

The wheel is built from a copy of exactly the files the Dockerfile COPYs, so a package file that the
image would miss (a module outside the COPY set, a data file setuptools leaves out) fails here.
"""

from __future__ import annotations

import fnmatch
import importlib
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.manifests import DOCKERFILE, REPO

ENTRYPOINTS = ("fleet-router", "fleet-replica")
# Build artefacts beside the sources (bytecode; extension modules of an in-place compiled copy).
_BUILT = (".pyc", ".so")


def _instructions() -> list[dict[str, str]]:
    return list(DockerfileParser(path=str(DOCKERFILE)).structure)


def _final_stage() -> list[dict[str, str]]:
    instructions = _instructions()
    last_from = max(i for i, ins in enumerate(instructions) if ins["instruction"] == "FROM")
    return instructions[last_from:]


def _context_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY/ADD from the build context (not --from a stage)."""
    out = []
    for ins in _instructions():
        if ins["instruction"] not in ("COPY", "ADD"):
            continue
        words = ins["value"].split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_runtime_stage_is_slim_python_311_and_runs_as_a_numeric_non_root_user() -> None:
    stage = _final_stage()
    assert stage[0]["value"].split()[0].startswith("python:3.11-slim")
    users = [ins["value"].strip() for ins in stage if ins["instruction"] == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert user.isdigit() and int(user) != 0
    k8s_uid = 10001  # deploy/k8s runs the image with this runAsUser
    assert int(user) == k8s_uid


def test_every_stage_uses_python_311_slim() -> None:
    froms = [ins["value"].split()[0] for ins in _instructions() if ins["instruction"] == "FROM"]
    assert froms and all(image.startswith("python:3.11-slim") for image in froms)


def test_healthcheck_and_default_command() -> None:
    stage = _final_stage()
    checks = [ins["value"] for ins in stage if ins["instruction"] == "HEALTHCHECK"]
    assert len(checks) == 1 and "HEALTHCHECK_URL" in checks[0]
    cmd = [ins["value"] for ins in stage if ins["instruction"] == "CMD"]
    assert cmd and cmd[-1].lstrip('[ "').startswith("fleet-router")
    # No ENTRYPOINT: `command:` in compose / `command:` in a pod spec picks the program.
    assert not [ins for ins in stage if ins["instruction"] == "ENTRYPOINT"]


def test_installs_the_package_with_the_kv_events_extra() -> None:
    runs = " ".join(ins["value"] for ins in _instructions() if ins["instruction"] == "RUN")
    assert 'pip install ".[kv-events]"' in runs
    assert "kv-events" in _pyproject()["project"]["optional-dependencies"]


def test_the_image_compiles_the_hot_path_in_the_build_stage_only() -> None:
    instructions = _instructions()
    runtime_from = max(i for i, ins in enumerate(instructions) if ins["instruction"] == "FROM")
    build_runs = " ".join(
        ins["value"] for ins in instructions[:runtime_from] if ins["instruction"] == "RUN"
    )
    runtime_runs = " ".join(
        ins["value"] for ins in instructions[runtime_from:] if ins["instruction"] == "RUN"
    )
    assert 'FLEET_ROUTER_COMPILE=1 pip install ".[kv-events]"' in build_runs
    assert "gcc" in build_runs  # mypyc's output is C
    assert "gcc" not in runtime_runs  # the runtime stage copies the built venv only
    # The build's own files go into the context, or pip builds without them.
    copied = " ".join(ins["value"] for ins in instructions if ins["instruction"] == "COPY")
    assert "setup.py" in copied and "build_backend.py" in copied


def test_copied_paths_exist_and_are_not_docker_ignored() -> None:
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = _context_copies()
    assert copies
    for sources, _ in copies:
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repo"
            assert not any(fnmatch.fnmatch(source.rstrip("/"), pat) for pat in ignore), source


@pytest.mark.parametrize("script", ENTRYPOINTS)
def test_entrypoint_is_a_declared_console_script_that_imports(script: str) -> None:
    target = _pyproject()["project"]["scripts"].get(script)
    assert target, f"{script} is not in [project.scripts]"
    module_name, _, func = target.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, func))


def test_wheel_built_from_the_copied_files_has_every_package_file_and_entrypoint(
    tmp_path: Path,
) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for sources, dest in _context_copies():
        for source in sources:
            src = REPO / source
            target = context / (Path(source).name if dest in ("./", ".") else dest.lstrip("./"))
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, target)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(context)],
        check=True,
        timeout=90,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(
            zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")
        )
    for script in ENTRYPOINTS:
        assert f"{script} = " in entry_points
    # Every file of the installed packages (code and data, e.g. sim profiles) is in the wheel.
    packages = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    roots = {p.rstrip("*") for p in packages}
    missing = []
    for root in roots:
        for path in (REPO / root).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in _BUILT:
                continue
            rel = path.relative_to(REPO).as_posix()
            package_dir = path.parent
            if not (package_dir / "__init__.py").exists():
                continue  # not inside a package (e.g. replicas/vllm: a shell recipe)
            if rel not in names:
                missing.append(rel)
    assert not missing, f"files the image would lack: {missing}"
