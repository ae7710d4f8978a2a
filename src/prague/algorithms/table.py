"""The methods as people read them: ``prague methods`` and the README's method table, both from the
registry (:mod:`prague.algorithms.registry`)."""

from __future__ import annotations

from prague.algorithms.registry import METHODS


def methods_markdown() -> str:
    """The README's table: name, variants, what one worker does per iteration."""
    rows = ["| name | variants | what one worker does per iteration |", "| --- | --- | --- |"]
    for m in METHODS.values():
        variants = ", ".join(f"`{m.name}:{v}`" + (" (default)" if v == m.default_variant else "")
                             for v in m.variants) or "-"
        rows.append(f"| `{m.name}` | {variants} | {m.summary} |")
    return "\n".join(rows)


def methods_text() -> str:
    """``prague methods``: every method with its paper, variants and options (defaults and help)."""
    out: list[str] = []
    for m in METHODS.values():
        out.append(f"{m.name}  ({m.paper})")
        if m.variants:
            out.append(f"  variants: {', '.join(m.variants)} (default {m.default_variant}; {m.name}:VARIANT)")
        for o in m.option_infos:
            choices = f" {{{','.join(o.choices)}}}" if o.choices else ""
            out.append(f"  {o.flag}{choices} = {o.default!r}: {o.help}")
        out.append("")
    return "\n".join(out).rstrip()
