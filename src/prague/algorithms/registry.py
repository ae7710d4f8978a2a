"""Every method, described once (:mod:`prague.algorithms.spec`). Adding a method is one line here.

Everything that names methods is derived from :data:`METHODS`: the flags of ``prague run``/``worker``/
``bench``/``simulate``, ``prague methods``, the README's method table, the runtime's and the
simulator's lookup. Importing this module imports no method's runtime or simulator code.
"""

from __future__ import annotations

from prague.algorithms import adpsgd, allreduce, diloco, dssync, eager_sgd, localsgd, lossy, prague, ps, ps_eager
from prague.algorithms.spec import Method, OptionInfo
from prague.errors import ConfigError, unknown_choice

METHODS: dict[str, Method] = {
    m.name: m
    for m in (allreduce.METHOD, prague.METHOD, dssync.METHOD, ps.METHOD, ps_eager.METHOD, adpsgd.METHOD,
              eager_sgd.METHOD, lossy.METHOD, localsgd.METHOD, diloco.METHOD)
}


def get_method(name: str) -> Method:
    """The method registered as ``name``; raises ConfigError listing the valid names."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise unknown_choice("method", name, METHODS) from None


def parse_method(spec: str) -> tuple[Method, str | None]:
    """``"prague:smart"`` -> (the ``prague`` method, ``"smart"``); ``"allreduce"`` -> (it, None).

    The one place a ``NAME[:VARIANT]`` string is read; the variant is checked against the method's
    variants, with a message listing them."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a method name is needed, got {spec!r}; valid: {', '.join(sorted(METHODS))}")
    name, sep, variant = spec.strip().partition(":")
    method = get_method(name)
    if not sep:
        return method, None
    if method.variant_option is None:
        raise ConfigError(f"method {name!r} has no variants, got {spec!r}; use plain {name!r}")
    if variant not in method.variants:
        raise unknown_choice(f"variant of {name}", variant, method.variants)
    return method, variant


def method_of(options: object) -> Method:
    """The method whose options dataclass ``options`` is (typed options name their method)."""
    for method in METHODS.values():
        if type(options) is method.options:
            return method
    raise ConfigError(f"{type(options).__name__} is not the options of a method; pass a method name "
                      f"({', '.join(sorted(METHODS))}) or one method's options")


def all_options() -> dict[str, list[tuple[Method, OptionInfo]]]:
    """Every option name, with the methods that declare it (a name shared by two methods is one flag)."""
    out: dict[str, list[tuple[Method, OptionInfo]]] = {}
    for method in METHODS.values():
        for info in method.option_infos:
            out.setdefault(info.name, []).append((method, info))
    return out
