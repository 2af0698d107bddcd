"""`fleet-router policies`: every registered policy, one a line, the default marked."""

from __future__ import annotations

import pytest

from router.cli import main
from router.policies import DEFAULT_POLICY, POLICIES


def test_policies_lists_every_name_and_marks_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(POLICIES)
    assert [line for line in lines if line.endswith("(default)")] == [f"{DEFAULT_POLICY} (default)"]
