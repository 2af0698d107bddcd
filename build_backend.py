"""The PEP 517 build backend: setuptools', asking for more when the build compiles.

`FLEET_ROUTER_COMPILE=1 pip install .` compiles the request hot path with mypyc (setup.py says
which modules and why).  mypyc type-checks what it compiles, as strictly as our mypy run, so its
build environment needs what that run sees: the project's dependencies (their types) and the
`compile` extra (mypy, stubs).  A default build asks for none of it.
"""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every hook setuptools defines, unchanged

_SWITCH = "FLEET_ROUTER_COMPILE"


def _compile_requires() -> list[str]:
    project = tomllib.loads(Path("pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["compile"]]


@contextlib.contextmanager
def _interpreted() -> Iterator[None]:
    """setuptools learns its own requirements by running setup.py, before mypy can be there:
    that pass must not try to compile."""
    switch = os.environ.pop(_SWITCH, None)
    try:
        yield
    finally:
        if switch is not None:
            os.environ[_SWITCH] = switch


def _extra() -> list[str]:
    return _compile_requires() if os.environ.get(_SWITCH, "0") == "1" else []


def get_requires_for_build_wheel(config_settings: dict[str, object] | None = None) -> list[str]:
    extra = _extra()
    with _interpreted():
        return [*_setuptools.get_requires_for_build_wheel(config_settings), *extra]


def get_requires_for_build_editable(config_settings: dict[str, object] | None = None) -> list[str]:
    _refuse_compiled_editable()
    return list(_setuptools.get_requires_for_build_editable(config_settings))


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, object] | None = None,
    metadata_directory: str | None = None,
) -> str:
    _refuse_compiled_editable()
    return str(_setuptools.build_editable(wheel_directory, config_settings, metadata_directory))


def _refuse_compiled_editable() -> None:
    if os.environ.get(_SWITCH, "0") == "1":
        raise SystemExit(
            f"{_SWITCH}=1 with an editable install: compiled modules beside the sources would "
            "shadow every later edit. Install with `pip install .`, or make a compiled scratch "
            "copy with scripts/compiled_copy.py."
        )
