"""The hot-path module list that a compiled build compiles, and which build this run tests.

scripts/test runs the suite twice: here (interpreted) and in a copy compiled by
scripts/compiled_copy.py, with FLEET_ROUTER_EXPECT_COMPILED=1.  The last test makes each run
prove it tests the build it claims to: a stray extension module shadowing a source here, or a
copy that silently fell back to the sources, fails it.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from router.hotpath import MODULES, compiled_modules, hot_path_build

REPO = Path(__file__).resolve().parents[2]


def test_every_hot_path_module_is_a_router_source_file_listed_once() -> None:
    assert len(set(MODULES)) == len(MODULES)
    for name in MODULES:
        assert name.startswith("router.")
        assert (REPO / (name.replace(".", "/") + ".py")).is_file(), name


def test_the_edge_and_the_proxy_are_on_the_hot_path() -> None:
    # The modules that touch every byte of every request; a list without them would compile
    # the wrong things.
    for name in ("router.http.edge", "router.proxy.forward", "router.proxy.upstream"):
        assert name in MODULES


def test_this_run_tests_the_build_it_claims_to() -> None:
    expect_compiled = os.environ.get("FLEET_ROUTER_EXPECT_COMPILED") == "1"
    found = compiled_modules()
    wrong = [name for name, compiled in found.items() if compiled != expect_compiled]
    assert not wrong, f"expected {'compiled' if expect_compiled else 'interpreted'}: {wrong}"
    assert hot_path_build() == ("compiled" if expect_compiled else "interpreted")
    # And what is imported is what was found.
    edge = importlib.import_module("router.http.edge")
    assert str(edge.__file__).endswith(".py") != expect_compiled
