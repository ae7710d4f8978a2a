"""One exception hierarchy for the whole package.

Every error says what went wrong, shows the offending value and says how to fix it. The CLI turns a
:class:`ConfigError` into a one-line message and exit code 2, with no traceback.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class PragueError(Exception):
    """Base class of every error raised on purpose by prague."""


class ConfigError(PragueError, ValueError):
    """A user-supplied setting (flag, config field, spec string, file) is invalid."""


class DataError(ConfigError):
    """A data set file or directory is missing or malformed."""


#: The exit code of bad input: the command line's (one line naming the problem), and a worker's whose
#: settings cannot work (a ConfigError it raised: a pace it cannot hold, a wrong token).
EXIT_USAGE = 2
#: The exit code of ``prague run`` when the run diverged (its loss blew up; :mod:`prague.train.divergence`).
EXIT_DIVERGED = 3


#: The characters at which ``str.splitlines`` breaks a line: a value quoted in a message must not break it.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_ESCAPED = {ord(c): c.encode("unicode_escape").decode("ascii") for c in _LINE_BREAKS}


def one_line(message: object) -> str:
    """``message`` as one line: each line-breaking character a user's value may carry (a newline, a record
    separator) written as its escape, as ``repr`` would."""
    return str(message).translate(_ESCAPED)


_ERROR_LINE = re.compile(r"^(?:prague\.errors\.)?(?:ConfigError|DataError): ", re.M)


def usage_message(traceback_text: str) -> str | None:
    """The message of the last :class:`ConfigError` (or :class:`DataError`) in a published traceback, on
    one line; None when it holds none (the failure was of another kind)."""
    found = list(_ERROR_LINE.finditer(traceback_text))
    if not found:
        return None
    return " ".join(traceback_text[found[-1].end():].split())


class WorkerFailed(PragueError):
    """A worker process of a launched job exited with an error."""

    def __init__(self, rank: int, exitcode: int | None, detail: str) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.detail = detail
        super().__init__(f"worker rank {rank} failed (exit code {exitcode})\n{detail}")


class CommError(PragueError, RuntimeError):
    """A collective or point-to-point operation failed or timed out."""


def unknown_choice(kind: str, value: object, choices: Iterable[str]) -> ConfigError:
    """Build the standard error for a name that is not one of the valid choices."""
    valid = ", ".join(sorted(choices))
    return ConfigError(f"unknown {kind} {value!r}; valid choices: {valid}")
