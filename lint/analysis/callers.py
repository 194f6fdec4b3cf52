"""The caller's context seen inside a helper (capability class C5): loops around every call of a function.

A helper that builds old log-probs, takes a backward or steps an optimizer has no loop of its own; whether it runs
once per update, or once per microbatch, is decided by where the module calls it. Facts propagate only when every
in-module call site agrees, and a function with no in-module call site (public entry code, called by a framework
the linter cannot see) gets none: unknown reports nothing.

- :func:`runs_per_update`: every call of the function sits in an update loop of its caller, or in a function that
  itself runs once per update, through a few levels of callers.
- :func:`caller_loops`: for each in-module call site (through the same levels), the innermost loop around it that
  the predicate accepts; None when a site has none (then the sites disagree and nothing is propagated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import libcst as cst

from rlguard.lint.analysis.grad import call_sites

if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis

DEPTH = 3  # levels of callers followed


def runs_per_update(a: "Analysis", func: cst.FunctionDef | None, depth: int = DEPTH) -> bool:
    """Whether every in-module call of ``func`` runs once per update (inside an epoch/minibatch loop or a loop
    holding an update, below any loop that gathers fresh rollouts), directly or through callers that do."""
    from rlguard.lint.analysis.loops import training

    if func is None:
        return False
    train = training(a)
    return _all_sites(a, func, depth, lambda site: bool(train.update_loops(site)), set())


def _all_sites(a: "Analysis", func: cst.FunctionDef, depth: int, at_site: Callable, seen: set[int]) -> bool:
    if depth <= 0 or id(func) in seen:
        return False
    seen = seen | {id(func)}
    sites = call_sites(a, func)
    if not sites:
        return False
    for site in sites:
        if at_site(site):
            continue
        if a.enclosing_loops(site):
            return False  # in a loop that is no update loop: the sites disagree
        outer = a.enclosing_function(site)
        if outer is None or not _all_sites(a, outer, depth - 1, at_site, seen):
            return False
    return True


def caller_loops(a: "Analysis", func: cst.FunctionDef | None, accept: Callable[[cst.For | cst.While], bool],
                 depth: int = DEPTH) -> list[tuple[cst.Call, cst.For | cst.While]] | None:
    """Each in-module call site of ``func`` (the outermost call of a chain of helpers) with the innermost loop
    around it that ``accept`` takes; None when ``func`` has no call site or one site has no such loop."""
    if func is None:
        return None
    found: list[tuple[cst.Call, cst.For | cst.While]] = []
    if not _collect(a, func, accept, depth, set(), found):
        return None
    return found or None


def _collect(a, func, accept, depth, seen, found) -> bool:
    if depth <= 0 or id(func) in seen:
        return False
    seen = seen | {id(func)}
    sites = call_sites(a, func)
    if not sites:
        return False
    for site in sites:
        loops = a.enclosing_loops(site)
        if loops:
            if not accept(loops[0]):
                return False
            found.append((site, loops[0]))
            continue
        outer = a.enclosing_function(site)
        if outer is None or not _collect(a, outer, accept, depth - 1, seen, found):
            return False
    return True
