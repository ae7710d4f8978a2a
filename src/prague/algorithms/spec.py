"""The description of one method: everything the CLI, the bench, the simulator and the docs need to know.

Each method package (``prague/algorithms/<name>/__init__.py``) defines one :class:`Method`: its name,
a one-line summary, the paper it comes from, its options (a frozen dataclass whose fields are declared
with :func:`option`), the option that ``NAME:VARIANT`` sets, the extra fields it reports in
``algorithm_stats``, and where its runtime class and its simulator model live. The registry
(:mod:`prague.algorithms.registry`) lists the descriptions; ``prague run``/``worker``/``bench``/
``simulate``/``methods`` and the README's method table are all derived from them.

This module and the method descriptions import neither torch nor the simulator: ``prague --help``
and ``prague methods`` read them without loading either, and a worker process loads only its own
method's runtime class (:meth:`Method.runtime_class`), never a simulator model.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from prague.errors import ConfigError, unknown_choice


#: What every method built on P-Reduce's communicator cache reports (:class:`prague.comm.preduce.CommStats`).
COMM_REPORTS: dict[str, str] = {
    "preduces": "P-Reduce operations this worker took part in",
    "communicators_created": "members-only communicators built",
    "communicator_create_s": "seconds spent building them",
    "communicators_evicted": "communicators shut down by the LRU cache",
}


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, run_seed: bool = False) -> Any:
    """Declare one field of a method's options dataclass: its default, help text and, for a name-valued
    option, the valid names (checked by :meth:`Method.make_options` with a message listing them).
    ``run_seed``: a seed whose value 0 stands for the run's ``--seed`` (resolved by ``make_options``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "run_seed": run_seed})


class Options:
    """Base of every method's options dataclass: a name-valued option (declared with ``choices``) is
    checked when the options are built, with a message listing the valid names. Subclasses that add
    checks of their own call ``super().__post_init__()`` first."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise unknown_choice(f"value of --{f.name.replace('_', '-')}", value, choices)

    def check_job(self, nproc: int) -> None:
        """Raise ConfigError unless these options make sense for a job of ``nproc`` workers (a group
        larger than the job, ranks outside it...). Called before any process starts; a method whose
        options depend on the job's size overrides it."""

    def equal_shares(self) -> bool:
        """Whether every rank must run every step (a collective over all ranks, a fixed schedule), so that
        under a job-wide ``--budget`` each rank takes the same share of the batches; False for a method
        whose workers may run different numbers of steps, which then take batches from a shared counter
        and a fast worker does more of the work (:mod:`prague.workload.budget`). True unless overridden."""
        return True

    def check_model(self, state_elements: Callable[[], int]) -> None:
        """Raise ConfigError unless these options fit the model to be trained, whose flat state has
        ``state_elements()`` elements. Called by the launcher once the data set is loaded, before any
        worker starts; ``state_elements`` builds the model, so only a method whose options depend on
        the model's size (and overrides this) calls it."""


#: The most workers a job may have: ranks travel as 32-bit integers (torch.distributed, the Group
#: Generator's protocol), and checking a job's options must stay quick however large it is.
MAX_NPROC = 1 << 20


def check_nproc(nproc: int) -> None:
    """Raise ConfigError unless ``nproc`` is a number of workers a job can have (1..MAX_NPROC)."""
    if not 1 <= nproc <= MAX_NPROC:
        raise ConfigError(f"--nproc must be in 1..{MAX_NPROC}, got {nproc}")


def check_seconds(flag: str, value: float) -> None:
    """Raise ConfigError unless ``value`` is a time a worker can wait: a finite number of seconds > 0,
    at most what Python's threads can wait (``threading.TIMEOUT_MAX``, about 292 years)."""
    if not 0 < value <= threading.TIMEOUT_MAX:
        raise ConfigError(f"{flag} must be a number of seconds > 0 and at most {threading.TIMEOUT_MAX:.3g}, "
                          f"got {value!r}")


def check_address(flag: str, address: str) -> None:
    """Raise ConfigError unless ``address`` is ``host:port`` (an IPv6 host in brackets), port in 1..65535."""
    host, sep, port = address.rpartition(":")
    if host.startswith("["):
        ok_host = host.endswith("]") and len(host) > 2 and ":" in host
    else:
        ok_host = bool(host) and ":" not in host
    ok_host = ok_host and not any(c.isspace() for c in host)
    if not (sep and ok_host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{flag} must be host:port with a port in 1..65535 (an IPv6 host in brackets, "
                          f"[::1]:50051), got {address!r}")


def check_group_size(options: Any, nproc: int) -> None:
    """For options with a ``group_size``: one larger than the job is an error, unless it is the default,
    which shrinks to the job (a 2-worker job with the default of 3 averages in pairs)."""
    size = options.group_size
    default = next(f.default for f in dataclasses.fields(options) if f.name == "group_size")
    if size > nproc and size != default:
        raise ConfigError(f"--group-size {size} is larger than the job (--nproc {nproc}); use at most {nproc}")


@dataclass(frozen=True)
class OptionInfo:
    """One option of one method, as the CLI and ``prague methods`` show it."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None
    run_seed: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check_value(self, method: str, value: Any) -> Any:
        """``value`` as this option takes it through the Python API (an int for a float option becomes a
        float); raises ConfigError naming the option, its type and its flag, as the CLI would."""
        kind = self.type
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
              isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            article = "an" if kind is int else "a"
            raise ConfigError(f"option {self.name} of method {method!r} takes {article} {kind.__name__} (the CLI's "
                              f"{self.flag}), got {value!r} ({type(value).__name__})")
        return float(value) if kind is float else value


def _scalar_type(hint: Any) -> type:
    """``int``, ``float``, ``str`` or ``bool`` from a field's resolved annotation."""
    if isinstance(hint, type):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type):
        return args[0]
    raise TypeError(f"option type {hint!r} is not a plain scalar type")


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Method:
    """One synchronisation method, described once.

    ``runtime`` and ``sim`` are ``"module:Class"`` paths, imported only when asked for, so describing
    a method costs nothing and a worker never imports a simulator model (nor the simulator a runtime
    class). ``reports`` maps each field the method adds to ``algorithm_stats`` to what it means; the
    runtime reports them per worker, the simulator for the whole job (counts summed over workers).
    ``sim_reports``: the fields only the simulator model reports (what it models and a run cannot
    measure, such as a queue's utilisation). ``survives_failures``: the survivors of a crashed or hung
    worker train on without it (:mod:`prague.runtime.liveness`); otherwise the launcher stops the job.
    ``sgd_only``: the method applies SGD's update rule itself (the parameter servers' shards), so the
    workers' optimizer must be SGD. ``worker_imports``: modules the method's workers import even when they
    do not train (emulated compute), which the worker fork server then preloads once for all of them
    (:func:`prague.runtime.forkserver.prestart`).
    """

    name: str
    summary: str
    paper: str
    options: type
    runtime: str
    sim: str
    variant_option: str | None = None
    reports: Mapping[str, str] = field(default_factory=dict)
    sim_reports: Mapping[str, str] = field(default_factory=dict)
    survives_failures: bool = False
    variant_runtimes: Mapping[str, str] = field(default_factory=dict)
    variant_sims: Mapping[str, str] = field(default_factory=dict)
    plain_default: bool = False
    sgd_only: bool = False
    worker_imports: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(f"{self.name}: options must be a dataclass type, got {self.options!r}")
        names = {o.name for o in self.option_infos}
        if self.variant_option is not None:
            if self.variant_option not in names:
                raise TypeError(f"{self.name}: variant option {self.variant_option!r} is not one of {sorted(names)}")
            if not self.variants:
                raise TypeError(f"{self.name}: the variant option {self.variant_option!r} declares no choices")
        for table in (self.variant_runtimes, self.variant_sims):
            unknown = sorted(set(table) - set(self.variants))
            if unknown:
                raise TypeError(f"{self.name}: {unknown} are not variants ({', '.join(self.variants) or 'none'})")

    @cached_property
    def option_infos(self) -> tuple[OptionInfo, ...]:
        hints = typing.get_type_hints(self.options)
        return tuple(
            OptionInfo(f.name, _scalar_type(hints[f.name]), f.default, str(f.metadata.get("help", "")),
                       f.metadata.get("choices"), bool(f.metadata.get("run_seed", False)))
            for f in dataclasses.fields(self.options)
        )

    @property
    def variants(self) -> tuple[str, ...]:
        """The names ``NAME:VARIANT`` accepts (empty for a method without variants)."""
        for info in self.option_infos:
            if info.name == self.variant_option:
                return info.choices or ()
        return ()

    @property
    def default_variant(self) -> str | None:
        for info in self.option_infos:
            if info.name == self.variant_option:
                return str(info.default)
        return None

    def make_options(self, values: Mapping[str, Any] | None = None, variant: str | None = None,
                     seed: int | None = None) -> Any:
        """This method's options from ``values`` (names it does not declare, and ``None`` values, are
        ignored) with ``variant`` applied; raises ConfigError naming the bad value and the valid ones.
        With the run's ``seed``, every seed option declared ``run_seed`` that is 0 (or not given) takes
        it, so the launcher, every worker (under torchrun too) and the simulator draw from the same seed."""
        declared = {o.name: o for o in self.option_infos}
        kwargs = {k: declared[k].check_value(self.name, v) for k, v in (values or {}).items()
                  if k in declared and v is not None}
        if variant is not None:
            if self.variant_option is None:
                raise ConfigError(f"method {self.name!r} has no variants, got {self.name}:{variant}; "
                                  f"use plain {self.name!r}")
            kwargs[self.variant_option] = variant
        if variant is not None and variant not in self.variants:
            raise unknown_choice(f"variant of {self.name}", variant, self.variants)
        try:
            options = self.options(**kwargs)
        except TypeError as exc:  # a value of the wrong type given through the Python API
            raise ConfigError(f"invalid options for method {self.name!r}: {exc}") from None
        return options if seed is None else self.seeded(options, seed)

    def seeded(self, options: Any, seed: int) -> Any:
        """``options`` with every seed option declared ``run_seed`` that is 0 set to the run's ``seed``:
        what the method runs with, so the launcher, every worker and the simulator draw alike."""
        changes = {o.name: seed for o in self.option_infos if o.run_seed and not getattr(options, o.name)}
        return dataclasses.replace(options, **changes) if changes else options

    def check_job(self, options: Any, nproc: int) -> None:
        """Raise ConfigError unless ``options`` fit a job of ``nproc`` workers (:meth:`Options.check_job`)."""
        check_nproc(nproc)
        check = getattr(options, "check_job", None)
        if check is not None:
            check(nproc)

    def variant_of(self, options: Any) -> str | None:
        """The variant ``options`` select, or None for a method without variants (and for the default
        variant of a method whose default is plain, :attr:`plain_default`)."""
        if self.variant_option is None:
            return None
        variant = str(getattr(options, self.variant_option))
        return None if self.plain_default and variant == self.default_variant else variant

    def label(self, options: Any) -> str:
        """``NAME`` or ``NAME:VARIANT``: how bench tables name a run."""
        variant = self.variant_of(options)
        return self.name if variant is None else f"{self.name}:{variant}"

    def runtime_class(self, variant: str | None = None) -> Any:
        """The :class:`prague.algorithms.api.Algorithm` subclass of ``variant`` (default: the method's own;
        imports torch and the runtime)."""
        return _load(self.variant_runtimes.get(variant or "", self.runtime))

    def sim_class(self, variant: str | None = None) -> Any:
        """The :class:`prague.sim.method.SimMethod` subclass of ``variant`` (imports the simulator)."""
        return _load(self.variant_sims.get(variant or "", self.sim))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (``prague methods --json``)."""
        return {
            "name": self.name,
            "summary": self.summary,
            "paper": self.paper,
            "variant_option": self.variant_option,
            "variants": list(self.variants),
            "default_variant": self.default_variant,
            "options": [
                {"name": o.name, "flag": o.flag, "type": o.type.__name__, "default": o.default, "help": o.help,
                 "choices": list(o.choices) if o.choices is not None else None, "run_seed": o.run_seed}
                for o in self.option_infos
            ],
            "reports": dict(self.reports),
            "sim_reports": dict(self.sim_reports),
        }
