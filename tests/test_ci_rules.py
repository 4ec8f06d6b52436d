"""Under CI=true a skipped test fails the run (the conftest hook), elsewhere it skips."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.mark.parametrize(("ci", "expect"), [("true", {"failed": 1}), ("", {"skipped": 1})])
def test_skip_fails_only_under_ci(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
                                  ci: str, expect: dict[str, int]) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile("import pytest\n\ndef test_needs_a_tool():\n"
                        "    pytest.skip('the tool is not installed')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(**expect)
    if ci:
        result.stdout.fnmatch_lines(["*skipped under CI=true*the tool is not installed*"])
