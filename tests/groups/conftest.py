"""Shared fixtures for the Group Generator tests: a ``report`` fixture whose lines appear in the summary."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_REPORT: list[str] = []


@pytest.fixture
def report() -> Callable[[str], None]:
    """Call ``report(line)`` to show ``line`` in the terminal summary (measurements, not assertions)."""
    return _REPORT.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _REPORT:
        terminalreporter.section("group generator report")
        for line in _REPORT:
            terminalreporter.write_line(line)
