"""``install()``: rlguard's contracts around verl's policy losses, advantage estimators, ``agg_loss`` and
``kl_penalty``, in the process that calls it (a Ray worker included).

    from rlguard.integrations import verl as rlguard_verl
    rlguard_verl.install(mode="raise")          # or RLGUARD_VERL=raise in the environment of every process

What is wrapped (in ``verl.trainer.ppo.core_algos``, where every trainer path of verl looks them up):

- every entry of ``POLICY_LOSS_REGISTRY`` and ``ADV_ESTIMATOR_REGISTRY``, and every later registration:
  ``register_policy_loss`` / ``register_adv_est`` are wrapped, and so are ``get_policy_loss_fn`` /
  ``get_adv_estimator_fn``, which wrap on lookup an entry registered through a decorator taken before
  ``install()`` (``from verl.trainer.ppo.core_algos import register_adv_est`` at the top of a user's module);
- ``agg_loss`` and ``kl_penalty``;
- the same functions wherever a loaded ``verl.*`` module holds them under a name of its own (``from
  ...core_algos import agg_loss`` in ``verl.workers.utils.losses``; ``core_algos.compute_grpo_outcome_advantage``,
  which ``compute_advantage`` calls directly for GRPO and GAE). Modules imported later read the wrapped ones.

A wrapped function calls the original exactly once with the same arguments and returns exactly what it
returned: the checks draw no random numbers and write no tensor (parameters after N steps are bit-identical
with the integration on and off). A violation raises ``ContractViolation`` (``mode="raise"``) or is logged once
per code and place on the ``rlguard.contracts`` logger (``"warn"``), naming the function (``verl policy loss
'vanilla'``) and, in a Ray worker, its rank and role (``_context``). An error of rlguard's own code inside a
wrapper is logged once and switches that function's checks off (``Installation.switched_off``); it is never
raised into the run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
from enum import Enum
from typing import Any, Callable

from rlguard.catalog import LENGTH_BIAS
from rlguard.contracts import ContractViolation
from rlguard.contracts import get_mode
from rlguard.contracts import mode as contracts_mode
from rlguard.contracts.settings import parse_mode
from rlguard.integrations.verl import checks
from rlguard.integrations.verl._context import describe_place

_log = logging.getLogger("rlguard.contracts")

ENV_VAR = "RLGUARD_VERL"  # raise | warn | off: read when this package is imported (worker_setup imports it)
MODES = ("raise", "warn", "off")
CORE = "verl.trainer.ppo.core_algos"
# agg_loss's modes that average per-sequence token means (RLG010): a long episode's tokens weigh less each
LENGTH_BIASED_MODES = ("seq-mean-token-mean",)

_INSTALLED: "Installation | None" = None


def core_algos():
    """verl's ``core_algos``, imported here and not before (the package's import stays free of verl)."""
    import importlib

    return importlib.import_module(CORE)


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class NotCheckable(Exception):
    """A function that does not take the arguments verl passes by name (a user's own signature): not checked."""


def _is_wrapped(fn: Any) -> bool:
    return getattr(fn, "__rlguard_verl__", None) is not None


class Installation:
    """The wrappers of one process: their mode, cadence and bookkeeping (what to restore, what is off)."""

    def __init__(self, mode: str, check_every: int, group_relative: dict | None) -> None:
        self.mode = mode
        self.check_every = check_every
        self.group_relative = dict(group_relative or {})
        self.switched_off: dict[str, str] = {}  # function (as messages name it) -> the internal error
        self.noted: set[tuple[str, str]] = set()  # (loss_agg_mode, place) already noted as length-biased
        self._checkers: dict[str, Any] = {}  # function -> its contract, built at its first call
        self._active: list[str] = []  # the wrapped functions running now (agg_loss names its caller)
        self._restore: list[tuple[Any, str, Any, Any]] = []  # (object, attribute, original, wrapper)
        self._by_original: dict[int, Any] = {}  # id(original) -> its wrapper

    def configure(self, mode: str, check_every: int, group_relative: dict | None) -> None:
        self.mode, self.check_every = mode, check_every
        if group_relative is not None:
            self.group_relative = dict(group_relative)
        self._checkers.clear()  # rebuilt at the next call, with the new cadence and groups

    # -- rlguard's own failures ---------------------------------------------------------------------------------
    def _switch_off(self, function: str, exc: BaseException) -> None:
        if function in self.switched_off:
            return
        self.switched_off[function] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, NotCheckable):
            _log.warning("rlguard: %s is not checked: %s", function, exc)
        else:
            _log.error("rlguard: internal error in the checks of %s (%s: %s); they are switched off for the rest "
                       "of the run, training goes on", function, type(exc).__name__, exc)

    def _safely(self, function: str, fn: Callable, *args):
        """``fn(*args)``, rlguard's own work for ``function``: None (and that function's checks off) if it fails."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - rlguard's own failure must not stop the run it watches
            self._switch_off(function, exc)
            return None

    # -- one wrapper ---------------------------------------------------------------------------------------------
    def wrap(self, function: str, fn: Callable, names: tuple[str, ...], required: int,
             make_checker: Callable[[str], Any], before: Callable[[dict], None] | None = None) -> Callable:
        """``fn`` with the checker ``make_checker(where)`` around each call; ``names``: the arguments it reads,
        the first ``required`` of them always passed by verl; ``before(values)``: a note taken before the call
        (agg_loss's length bias)."""
        signature = _signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.mode == "off" or function in self.switched_off or signature is None:
                return fn(*args, **kwargs)
            values = self._safely(function, self._values, function, signature, args, kwargs, names, required)
            if values is None:
                return fn(*args, **kwargs)
            checker = self._checkers.get(function)
            if checker is None:
                checker = self._safely(function, self._build, function, make_checker)
                if checker is None:
                    return fn(*args, **kwargs)
            if before is not None:
                self._safely(function, before, values)
            return self._run(function, checker, values, fn, args, kwargs)

        wrapper.__rlguard_verl__ = function
        self._by_original[id(fn)] = wrapper
        return wrapper

    def _build(self, function: str, make_checker: Callable[[str], Any]):
        """The function's contract, named with where it runs (known at its first call: the worker's rank and
        role)."""
        checker = make_checker(function + describe_place())
        self._checkers[function] = checker
        return checker

    def _values(self, function: str, signature: inspect.Signature, args: tuple, kwargs: dict,
                names: tuple[str, ...], required: int) -> dict | None:
        """The arguments ``names`` of this call (None: not checkable; the call itself then reports a wrong call)."""
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        extra = next((bound.arguments[p.name] for p in signature.parameters.values()
                      if p.kind is p.VAR_KEYWORD and p.name in bound.arguments), {})
        values = {}
        for name in names:
            if name in bound.arguments:
                values[name] = bound.arguments[name]
            elif name in extra:
                values[name] = extra[name]
            elif signature.parameters.get(name) is not None and signature.parameters[name].default is not \
                    inspect.Parameter.empty:
                values[name] = signature.parameters[name].default
        if any(getattr(v, "is_nested", False) for v in values.values()):
            return None  # nested (jagged) tensors: verl pads them before its math; nothing to compare here
        missing = [n for n in names[:required] if n not in values]
        if missing:  # a function that does not take verl's argument names: say so once, check nothing
            raise NotCheckable(f"it takes no argument {missing[0]!r}, which verl passes by that name")
        return values

    def _run(self, function: str, checker, values: dict, fn: Callable, args: tuple, kwargs: dict):
        """The checker around one call of ``fn``; ``fn``'s own result or exception, whatever rlguard does."""
        outer = get_mode()
        call: dict = {}

        def body():
            call["ran"] = True
            try:
                with contracts_mode(outer):  # verl's code (and the user's own contracts) in the user's mode
                    call["out"] = fn(*args, **kwargs)
            except BaseException as exc:
                call["error"] = exc
                raise
            return call["out"]

        self._active.append(function)
        try:
            with contracts_mode(self.mode):
                checker(body=body, **values)
        except ContractViolation:
            raise
        except BaseException as exc:
            if "error" in call:  # verl's own error, whatever rlguard did around it
                if exc is call["error"]:
                    raise
                raise call["error"]  # noqa: B904 - rlguard failed while reporting it: verl's error is the news
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self._switch_off(function, exc)
            if "ran" not in call:
                return fn(*args, **kwargs)
        finally:
            self._active.pop()
        return call["out"]

    # -- the kinds of function -----------------------------------------------------------------------------------
    def policy_loss(self, name: str, fn: Callable) -> Callable:
        check_every = self.check_every
        return self.wrap(f"verl policy loss {name!r}", fn, checks.POLICY_LOSS_ARGS, 4,
                         lambda where: checks.policy_loss_checker(where, check_every))

    def estimator(self, name: str, fn: Callable) -> Callable:
        function = f"verl advantage estimator {name!r}"

        def make(where: str):
            weighting = checks.group_weighting(name, fn, self.group_relative)
            return checks.estimator_checker(where, weighting, self.check_every)

        return self.wrap(function, fn, checks.ESTIMATOR_ARGS, 2, make)

    def agg_loss(self, fn: Callable) -> Callable:
        return self.wrap("verl agg_loss", fn, (*checks.AGG_LOSS_ARGS, "loss_agg_mode"), 2,
                         lambda where: _without(checks.agg_loss_checker(where, self.check_every), "loss_agg_mode"),
                         before=self._note_length_bias)

    def kl_penalty(self, fn: Callable) -> Callable:
        return self.wrap("verl kl_penalty", fn, checks.KL_PENALTY_ARGS, 2,
                         lambda where: checks.kl_penalty_checker(where, self.check_every))

    def _note_length_bias(self, values: dict) -> None:
        """RLG010, once per mode and caller: information, never a violation (a deliberate setting in verl)."""
        mode = values.get("loss_agg_mode")
        if mode not in LENGTH_BIASED_MODES:
            return
        callers = [f for f in self._active if f != "verl agg_loss"]
        place = callers[-1] if callers else "verl agg_loss"
        if (mode, place) in self.noted:
            return
        self.noted.add((mode, place))
        _log.warning("rlguard: %s note: %s aggregates with loss_agg_mode=%r, a mean over sequences of per-sequence "
                     "token means: each token of a long response weighs less than a token of a short one "
                     "(length bias). 'token-mean' (or 'seq-mean-token-sum-norm') weighs every token alike; see "
                     "docs/rules/%s.md", LENGTH_BIAS, place, mode, LENGTH_BIAS)

    # -- patching verl -------------------------------------------------------------------------------------------
    def patch(self, core) -> None:
        for name, fn in list(core.POLICY_LOSS_REGISTRY.items()):
            if not _is_wrapped(fn):
                core.POLICY_LOSS_REGISTRY[name] = self.policy_loss(name, fn)
        for name, fn in list(core.ADV_ESTIMATOR_REGISTRY.items()):
            if not _is_wrapped(fn):
                core.ADV_ESTIMATOR_REGISTRY[name] = self.estimator(name, fn)
        self.agg_loss(core.agg_loss)
        self.kl_penalty(core.kl_penalty)
        self._by_original[id(core.register_policy_loss)] = self._registering(
            core, core.register_policy_loss, core.POLICY_LOSS_REGISTRY, self.policy_loss)
        self._by_original[id(core.register_adv_est)] = self._registering(
            core, core.register_adv_est, core.ADV_ESTIMATOR_REGISTRY, self.estimator)
        self._by_original[id(core.get_policy_loss_fn)] = self._looking_up(
            core.get_policy_loss_fn, core.POLICY_LOSS_REGISTRY, self.policy_loss)
        self._by_original[id(core.get_adv_estimator_fn)] = self._looking_up(
            core.get_adv_estimator_fn, core.ADV_ESTIMATOR_REGISTRY, self.estimator)
        for module in [m for n, m in list(sys.modules.items()) if n == "verl" or n.startswith("verl.")]:
            self._replace_in(module)

    def _replace_in(self, module) -> None:
        """Every attribute of ``module`` that is a wrapped original -> its wrapper (restored by ``uninstall``)."""
        for attr, value in list(vars(module).items()):
            wrapper = self._by_original.get(id(value))
            if wrapper is not None and callable(value):
                setattr(module, attr, wrapper)
                self._restore.append((module, attr, value, wrapper))

    def _registering(self, core, register: Callable, registry: dict, wrap: Callable) -> Callable:
        """verl's ``register_*`` decorator, registering the function wrapped (and returning it unwrapped, as
        verl does: the user's module keeps their own function)."""

        @functools.wraps(register)
        def registering(name_or_enum):
            name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum

            def decorator(fn):
                current = registry.get(name)
                if current is not None and getattr(current, "__wrapped__", None) is fn:
                    return fn  # the same function again: verl accepts it, and it is wrapped already
                if _is_wrapped(current):  # verl compares a re-registration with the original, not the wrapper
                    registry[name] = current.__wrapped__
                try:
                    register(name_or_enum)(fn)  # verl's own checks and registration
                except Exception:
                    if _is_wrapped(current):
                        registry[name] = current
                    raise
                registry[name] = wrap(name, registry[name])
                return fn

            return decorator

        registering.__rlguard_verl__ = "register"
        return registering

    def _looking_up(self, lookup: Callable, registry: dict, wrap: Callable) -> Callable:
        """verl's ``get_*_fn``: an entry registered unwrapped (through a decorator taken before ``install``) is
        wrapped on the way out, and kept wrapped in the registry."""

        @functools.wraps(lookup)
        def looking_up(name_or_enum):
            fn = lookup(name_or_enum)
            if _is_wrapped(fn):
                return fn
            name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
            wrapped = wrap(name, fn)
            if registry.get(name) is fn:
                registry[name] = wrapped
            return wrapped

        looking_up.__rlguard_verl__ = "lookup"
        return looking_up

    def unpatch(self, core) -> None:
        for registry in (core.POLICY_LOSS_REGISTRY, core.ADV_ESTIMATOR_REGISTRY):
            for name, fn in list(registry.items()):
                if _is_wrapped(fn):
                    registry[name] = fn.__wrapped__
        for module, attr, original, wrapper in reversed(self._restore):
            if getattr(module, attr, None) is wrapper:
                setattr(module, attr, original)
        # a verl module imported while installed took the wrappers themselves (from core_algos import agg_loss)
        for module in [m for n, m in list(sys.modules.items()) if n == "verl" or n.startswith("verl.")]:
            for attr, value in list(vars(module).items()):
                if _is_wrapped(value) and callable(value):
                    setattr(module, attr, value.__wrapped__)
        self._restore.clear()
        self._by_original.clear()
        self._checkers.clear()
        self.mode = "off"  # a wrapper someone still holds calls straight through


def _without(checker, name: str):
    """``checker`` taking (and ignoring) the argument ``name`` too: agg_loss reads its mode for the note only."""

    def call(body, **values):
        values.pop(name, None)
        return checker(body=body, **values)

    return call


def _mode(mode: str) -> str:
    parsed = parse_mode(mode)
    if parsed is None:
        raise ValueError(f"rlguard.integrations.verl mode must be one of {MODES}, got {mode!r}")
    return parsed


def install(mode: str = "raise", *, check_every: int = 1, group_relative: dict | None = None) -> Installation:
    """Wrap verl's policy losses, advantage estimators, ``agg_loss`` and ``kl_penalty`` in this process.

    ``mode``: "raise" (a violation raises ``ContractViolation``), "warn" (logged once per code and place),
    "off" (the wrappers call straight through). ``check_every``: the value checks (NaN scans, group means) on
    every N-th call of each function only; shapes and autograd are checked on every call. ``group_relative``:
    estimator name -> "sequence", "token" or None, for an estimator of your own whose advantages are (or are
    not) centred per ``index`` group (default: verl's own as ``checks.GROUP_RELATIVE`` says; yours when it takes
    ``index``). Calling it again changes the settings of the one installation; ``uninstall()`` removes it.
    """
    global _INSTALLED
    mode = _mode(mode)
    if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
        raise ValueError(f"check_every must be a positive int, got {check_every!r}")
    core = core_algos()
    if _INSTALLED is not None:
        _INSTALLED.configure(mode, check_every, group_relative)
        return _INSTALLED
    installation = Installation(mode, check_every, group_relative)
    installation.patch(core)
    _INSTALLED = installation
    return installation


def uninstall() -> None:
    """Put verl's own functions back (registries and module attributes)."""
    global _INSTALLED
    if _INSTALLED is not None:
        _INSTALLED.unpatch(core_algos())
        _INSTALLED = None


def installed() -> Installation | None:
    """The installation of this process, or None."""
    return _INSTALLED


@contextlib.contextmanager
def checking(mode: str = "raise", **settings):
    """``with checking("raise"): ...``: installed for the block, uninstalled after it (tests, notebooks)."""
    installation = install(mode, **settings)
    try:
        yield installation
    finally:
        uninstall()


def install_from_environment() -> Installation | None:
    """``install(mode)`` when ``RLGUARD_VERL`` says raise/warn (what a Ray worker's environment carries); None
    when it is unset or off. An unusable verl is logged, not raised: turning the checks on must not stop a run."""
    raw = os.environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    mode = parse_mode(raw)
    if mode is None:
        _log.warning("rlguard: %s=%r is not one of %s; using 'raise'", ENV_VAR, raw, "/".join(MODES))
        mode = "raise"
    if mode == "off":
        return None
    try:
        return install(mode)
    except ImportError as exc:
        _log.error("rlguard: %s=%s but the verl integration cannot install: %s", ENV_VAR, raw, exc)
        return None


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: every Ray worker process (verl's TaskRunner, actor, rollout, ref and
    critic workers) installs the checks at start, in the mode ``RLGUARD_VERL`` gives it::

        ray.init(runtime_env={"env_vars": {"RLGUARD_VERL": "raise"},
                              "worker_process_setup_hook": "rlguard.integrations.verl.worker_setup"})
    """
    install_from_environment()
