"""MkDocs hook: show the docstrings' reStructuredText markup the way Sphinx would.

The docstrings in ``src/`` cite other objects with Sphinx roles, which mkdocstrings renders as the role's
name followed by the target in code (``:meth:<code>step</code>``): this hook drops the role's name and,
for a target written with ``~``, keeps its last component. A paragraph that introduces a literal block
ends in ``::``, of which Sphinx shows one colon: so does this hook.
"""

from __future__ import annotations

import re
from typing import Any

_LITERAL_INTRO = re.compile(r"::(</p>\s*<pre)")
_ROLE = re.compile(r":(?:meth|class|func|mod|data|attr|exc|obj|const):(<code>)(~?)([\w.]+)(</code>)")


def _shown(match: re.Match[str]) -> str:
    target = match.group(3).rsplit(".", 1)[-1] if match.group(2) else match.group(3)
    return f"{match.group(1)}{target}{match.group(4)}"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _LITERAL_INTRO.sub(r":\1", _ROLE.sub(_shown, html))
