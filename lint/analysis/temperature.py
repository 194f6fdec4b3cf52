"""Temperature facts of a module: where a sampling temperature is applied to logits, and which values a loss is
computed from.

These are the module-level facts RLG007 needs beyond the literal values it resolves itself:

- :func:`temperature_expr`: whether an expression *is* a temperature (a name, attribute or dict key whose last
  component is a temperature word: ``T``-words such as ``temperature``, ``temp``, ``tau``,
  ``rollout_temperature``), so that a config symbol (``cfg["generation"]["temperature"]``,
  ``self.args.temperature``) can stand for a value that is not known;
- :func:`applies_temperature`: whether a function (or, with no function, the whole module) scales logits by a
  temperature anywhere: a division or ``div_`` by a temperature, ``/= temperature``, a temperature passed to a
  non-sampling call (a log-prob helper's temperature argument, a model wrapper's ``temperature=`` keyword), a
  logits processor or warper, or a call of a same-module helper that does any of these;
- :func:`loss_inputs`: calls whose results become a minimised loss (``loss, m = loss_fn(logits, mb)`` then
  ``loss.backward()``), so that the logits handed to an opaque loss callable count as what the trainer scores;
- :func:`autocast_region` / :func:`upcast`: the ``torch.autocast`` region a node sits in, and whether an
  expression is visibly upcast to float32 before a softmax.

Precision first: each answer errs towards "the temperature may be applied" (which silences the rule).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import libcst as cst


if TYPE_CHECKING:
    from rlguard.lint.analysis import Analysis


TEMPERATURE_WORD = re.compile(r"(?i)(\w*_)?(temperature|temp|tau|temperatures|temps)")
SAMPLING_CALL = re.compile(r"(?i)\w*(generate|sample|rollout|decode)\w*|SamplingParams|GenerationConfig|"
                           r"RequestConfig|\w*SamplingConfig")
WARPER = re.compile(r"(?i)\w*(Temperature\w*(Warper|Processor)|LogitsProcessor\w*|apply_temperature\w*|"
                    r"\w*temperature_scal\w*|scale_logits\w*)")
# ``x.to(torch.float32)``, ``x.float()``, ``x.double()``, ``x.to(dtype=torch.float32)``
FLOAT32 = re.compile(r"torch\.(float32|float|float64|double)")


def last_component(expr: cst.BaseExpression) -> str | None:
    """``cfg["generation"]["temperature"]`` -> ``temperature``; ``self.args.tau`` -> ``tau``; ``t`` -> ``t``."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return expr.attr.value
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        index = expr.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            value = index.value.evaluated_value
            return value if isinstance(value, str) else None
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "get" \
            and expr.args and isinstance(expr.args[0].value, cst.SimpleString):
        value = expr.args[0].value.evaluated_value  # cfg.get("temperature", 1.0)
        return value if isinstance(value, str) else None
    return None


def temperature_expr(expr: cst.BaseExpression | None) -> bool:
    """Is ``expr`` (or a part of an arithmetic / boolean combination of it) a temperature by its name?"""
    if expr is None:
        return False
    if isinstance(expr, (cst.BinaryOperation, cst.BooleanOperation)):
        return temperature_expr(expr.left) or temperature_expr(expr.right)
    if isinstance(expr, cst.IfExp):
        return temperature_expr(expr.body) or temperature_expr(expr.orelse)
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value in ("float", "max") \
            and expr.args:
        return any(temperature_expr(a.value) for a in expr.args)
    name = last_component(expr)
    return name is not None and TEMPERATURE_WORD.fullmatch(name) is not None


def _callee(call: cst.Call) -> str:
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else ""


def is_sampling_call(call: cst.Call) -> bool:
    return SAMPLING_CALL.fullmatch(_callee(call)) is not None


def _direct(a: "Analysis", scope: cst.CSTNode) -> tuple[bool, list[cst.Call]]:
    """(scope applies a temperature by itself, the calls in it)."""
    types = (cst.BinaryOperation, cst.AugAssign, cst.Call)
    calls = []
    for node in (a.nodes(*types) if scope is a.module else a.index.descendants(scope, *types)):
        if isinstance(node, cst.BinaryOperation):
            if isinstance(node.operator, cst.Divide) and temperature_expr(node.right):
                return True, calls
        elif isinstance(node, cst.AugAssign):
            if isinstance(node.operator, cst.DivideAssign) and temperature_expr(node.value):
                return True, calls
        else:
            callee = _callee(node)
            if WARPER.fullmatch(callee):
                return True, calls
            if callee in ("div", "div_", "true_divide") and node.args and temperature_expr(node.args[0].value):
                return True, calls
            if not is_sampling_call(node):
                for arg in node.args:
                    if arg.keyword is not None and TEMPERATURE_WORD.fullmatch(arg.keyword.value):
                        return True, calls
                    if arg.keyword is None and temperature_expr(arg.value):
                        return True, calls
            calls.append(node)
    return False, calls


def applies_temperature(a: "Analysis", scope: cst.CSTNode | None = None, depth: int = 2) -> bool:
    """Does ``scope`` (a function; the module when None) scale logits by a temperature anywhere, directly or
    through a same-module helper it calls (``depth`` levels)?"""
    scope = scope if scope is not None else a.module
    cache = a.facet("temperature_applied", lambda an: {})
    key = (id(scope), depth)
    if key in cache:
        return cache[key]
    cache[key] = False  # recursion guard
    found, calls = _direct(a, scope)
    if not found and depth > 0 and scope is not a.module:
        for call in calls:
            func = a.callee(call)
            if func is not None and func is not scope and applies_temperature(a, func, depth - 1):
                found = True
                break
    cache[key] = found
    return found


def loss_inputs(a: "Analysis") -> list[cst.Call]:
    """Calls whose result (or its first element) becomes a value that is ``.backward()``-ed, through names,
    arithmetic and ``(loss, metrics)`` unpacking in the same function."""
    def build(an: "Analysis") -> list[cst.Call]:
        from rlguard.lint.analysis.roles import backward_calls, backward_loss

        found: list[cst.Call] = []
        seen: set[int] = set()
        for call in backward_calls(an):
            loss = backward_loss(call)
            todo = [(loss, None, call, 8)] if loss is not None else []
            while todo:
                expr, key, at, depth = todo.pop()
                if depth < 0:
                    continue
                if key is not None:  # the value of ``key`` before ``at``
                    for d in an.flow.reaching(key, at):
                        if id(d) in seen:
                            continue
                        seen.add(id(d))
                        if d.kind == "assign" and d.value is not None and d.element in (None, 0):
                            todo.append((d.value, None, d.stmt, depth - 1))
                        elif d.kind == "aug":  # ``loss *= c`` keeps the previous value
                            todo.append((None, d.key, d.stmt, depth - 1))
                    continue
                if expr is None or id(expr) in seen:
                    continue
                seen.add(id(expr))
                if isinstance(expr, cst.BinaryOperation):
                    todo += [(expr.left, None, at, depth - 1), (expr.right, None, at, depth - 1)]
                elif isinstance(expr, cst.UnaryOperation):
                    todo.append((expr.expression, None, at, depth - 1))
                elif isinstance(expr, cst.Call):
                    if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in ("mean", "sum", "float"):
                        todo.append((expr.func.value, None, at, depth - 1))
                    else:
                        found.append(expr)
                elif isinstance(expr, cst.Name):
                    todo.append((None, expr.value, expr, depth - 1))
        return found
    return a.facet("temperature_loss_inputs", build)


def autocast_region(a: "Analysis", node: cst.CSTNode) -> cst.With | None:
    """The innermost ``with torch.autocast(...)`` / ``with <x>autocast<y>`` block around ``node`` in its
    function, or None."""
    for anc in a.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if isinstance(anc, cst.With):
            for item in anc.items:
                text = a.code(item.item)
                if "autocast" in text.lower() and "enabled=False" not in text.replace(" ", ""):
                    return anc
    return None


def upcast(a: "Analysis", expr: cst.BaseExpression) -> bool:
    """Is ``expr`` visibly cast to float32 or wider (``.float()``, ``.to(torch.float32)``, ``dtype=`` keyword)?"""
    text = a.code(expr)
    return ".float()" in text or ".double()" in text or FLOAT32.search(text) is not None
