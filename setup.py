"""fleet-router's build: pure Python by default; with FLEET_ROUTER_COMPILE=1 the request hot
path is compiled to C extension modules by mypyc (it ships with mypy).

Why: every proxied request runs through these modules, and once the I/O is as lean as it gets
(two reads, two writes, under one epoll wake-up per request) what is left of the router's CPU is
mostly the interpreter executing them.  Compiled, they cost about a fifth less CPU per request
(BENCHMARKS.md, "Gateway overhead").  The code is the same: mypyc compiles the strictly typed
modules as they are, and the test suite runs against both builds (scripts/test).

    FLEET_ROUTER_COMPILE=1 pip install .                       # a compiled install (the image's)
    FLEET_ROUTER_COMPILE=1 python setup.py build_ext --inplace # compiled in place (a scratch copy:
                                                               # the .so files shadow the sources)

Metadata lives in pyproject.toml.
"""

from __future__ import annotations

import os

from setuptools import setup

from router.hotpath import MODULES

# router.hotpath names the modules (and imports nothing, so it can be read before a build).
HOT_PATH = [name.replace(".", "/") + ".py" for name in MODULES]


def _ext_modules() -> list[object]:
    if os.environ.get("FLEET_ROUTER_COMPILE", "0") != "1":
        return []
    from mypyc.build import mypycify  # only a compiled build needs mypy

    return list(mypycify(HOT_PATH, opt_level="3"))


setup(ext_modules=_ext_modules())
