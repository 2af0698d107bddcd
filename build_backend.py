"""The PEP 517 build backend: setuptools', asking for mypy too when the build compiles.

`FLEET_ROUTER_COMPILE=1 pip install .` compiles the request hot path with mypyc (setup.py says
which modules and why); only such a build needs mypy, so a default build does not download it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every hook setuptools defines, unchanged

_SWITCH = "FLEET_ROUTER_COMPILE"
_COMPILE_REQUIRES = ["mypy>=1.8"]


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
    return _COMPILE_REQUIRES if os.environ.get(_SWITCH, "0") == "1" else []


def get_requires_for_build_wheel(config_settings: dict[str, object] | None = None) -> list[str]:
    extra = _extra()
    with _interpreted():
        return [*_setuptools.get_requires_for_build_wheel(config_settings), *extra]


def get_requires_for_build_editable(config_settings: dict[str, object] | None = None) -> list[str]:
    extra = _extra()
    with _interpreted():
        return [*_setuptools.get_requires_for_build_editable(config_settings), *extra]
