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

import dataclasses
import re
from typing import TYPE_CHECKING

import libcst as cst

from rlguard.lint.analysis.alignment import gather_site
from rlguard.lint.analysis.index import dotted_name, key_of
from rlguard.lint.analysis.provenance import models, objects

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
        if _applies(node):
            return True, calls
        if isinstance(node, cst.Call):
            calls.append(node)
    return False, calls


def _applies(node: cst.CSTNode) -> bool:
    """Whether the node scales logits by a temperature (a division by one, a warper, a temperature handed to a
    call that does not sample)."""
    if isinstance(node, cst.BinaryOperation):
        return isinstance(node.operator, cst.Divide) and temperature_expr(node.right)
    if isinstance(node, cst.AugAssign):
        return isinstance(node.operator, cst.DivideAssign) and temperature_expr(node.value)
    if not isinstance(node, cst.Call):
        return False
    callee = _callee(node)
    if WARPER.fullmatch(callee):
        return True
    if callee in ("div", "div_", "true_divide") and node.args and temperature_expr(node.args[0].value):
        return True
    if not is_sampling_call(node):
        for arg in node.args:
            if arg.keyword is not None and TEMPERATURE_WORD.fullmatch(arg.keyword.value):
                return True
            if arg.keyword is None and temperature_expr(arg.value):
                return True
    return False


def applications(a: "Analysis") -> list[cst.CSTNode]:
    """Every node of the module that applies a temperature (:func:`_applies`)."""
    return a.facet("temperature_applications", lambda an: [
        n for n in an.nodes(cst.BinaryOperation, cst.AugAssign, cst.Call) if _applies(n)])


def may_reach(a: "Analysis", func: cst.FunctionDef, model_roots: frozenset | None, depth: int = 3) -> bool:
    """Whether a temperature the module applies may reach the logits ``func`` computes from a model forward of its
    own: it is applied in ``func`` or a helper it calls (:func:`applies_temperature`), handed to ``func`` by a
    call of it (through ``depth`` levels of callers), applied outside any function, or handed to a call that
    builds the model ``func`` runs (``self.policy = Wrapper(model, temperature=t)``; when that model is unknown,
    to any call whose value is bound). An application elsewhere (another scorer's logits, a loss coefficient,
    a sampler's settings) does not touch these logits."""
    from rlguard.lint.analysis.grad import call_sites

    if applies_temperature(a, func):
        return True
    todo, seen = [(func, depth)], {id(func)}
    while todo:
        f, d = todo.pop()
        for site in call_sites(a, f):
            if _applies(site):
                return True
            outer = a.enclosing_function(site)
            if outer is not None and id(outer) not in seen and d > 0:
                seen.add(id(outer))
                todo.append((outer, d - 1))
    if model_roots is not None:
        model_roots = _with_arguments(a, func, model_roots)
    for node in applications(a):
        if a.enclosing_function(node) is None:
            return True
        if isinstance(node, cst.Call):
            stmt = a.index.statement_of(node)
            bound = {d.key for d in a.index.stmt_defs.get(id(stmt), ())}
            if not bound:
                continue
            built = objects(a).value(node)
            built = {o.key for o in built} if isinstance(built, frozenset) else set()
            if model_roots is None or (bound | built) & model_roots:
                return True
    return False


def _with_arguments(a: "Analysis", func: cst.FunctionDef, roots: frozenset) -> frozenset:
    """``roots`` with, for each of ``func``'s parameters among them, the objects its callers in the module hand
    it (the model a scorer is given is the one its caller runs)."""
    from rlguard.lint.analysis.grad import call_sites
    from rlguard.lint.analysis.index import params_of

    cls = a.enclosing_class(func)
    prefix = f"{cls.name.value}." if cls is not None else ""
    prefix += f"{func.name.value}:"
    names = [r[len(prefix):] for r in roots if isinstance(r, str) and r.startswith(prefix)]
    if not names:
        return roots
    positional = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
    if cls is not None and positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    found = set(roots)
    for site in call_sites(a, func):
        plain = [arg for arg in site.args if arg.keyword is None and not arg.star]
        for name in names:
            value = next((arg.value for arg in site.args if arg.keyword is not None and arg.keyword.value == name),
                         None)
            if value is None and name in positional and positional.index(name) < len(plain):
                value = plain[positional.index(name)].value
            if value is None:
                continue
            objs = objects(a).value(value)
            if isinstance(objs, frozenset):
                found |= {o.key for o in objs}
            key = key_of(value)
            if key is not None:
                found.add(key)
    return frozenset(found)


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
            loss = backward_loss(call, an)
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


# ----- following logits back to the model call and the temperature they were divided by ---------------------
# (RLG007's questions; kept here so that rules stay queries)


def inplace_divisions(ctx: Analysis) -> list[cst.Call]:
    """The module's ``x.div_(t)`` calls (listed once: ``divisor`` asks at every name it follows)."""
    hit = ctx.cache.get("inplace_divisions")
    if hit is None:
        hit = ctx.cache["inplace_divisions"] = [
            c for c in ctx.nodes(cst.Call) if isinstance(c.func, cst.Attribute) and c.func.attr.value == "div_"]
    return hit


def logits_divisor(ctx: Analysis, expr: cst.BaseExpression, site: cst.CSTNode, depth: int = 10):
    """Follow logits back to the model call: (reached a model call?, the temperature it was divided by on the
    way, also when the chain ends elsewhere: the scores of a generation divided in place)."""
    divisor = None
    while depth > 0 and expr is not None:
        depth -= 1
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
            divisor = divisor or expr.right
            expr = expr.left
        elif isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Call):
            if is_model_call(ctx, expr):
                return True, divisor
            func = expr.func
            if isinstance(func, cst.Attribute) and not ctx.is_module_function(expr):
                if func.attr.value in ("div", "div_") and expr.args:
                    divisor = divisor or expr.args[0].value
                elif func.attr.value not in ("log_softmax", "float", "to", "contiguous", "softmax", "detach",
                                             "squeeze", "clone"):
                    return False, None
                expr = func.value
            elif ctx.call_name(expr) in ("torch.log_softmax", "torch.nn.functional.log_softmax") and expr.args:
                expr = expr.args[0].value
            else:
                return False, divisor
        elif isinstance(expr, (cst.Name, cst.Attribute)):
            name = dotted_name(expr)
            if isinstance(expr, cst.Attribute) and (name is None or not name.startswith("self.")):
                expr = expr.value
                continue
            assigns = all_assignments(ctx, name, expr) if name else []
            for a in assigns:  # logits /= t or logits.div_(t) before the site
                if a.kind == "aug" and isinstance(a.op, cst.DivideAssign) and isinstance(a.stmt, cst.AugAssign):
                    divisor = divisor or a.stmt.value
            for call in inplace_divisions(ctx):
                f = call.func
                if dotted_name(f.value) == name and call.args and \
                        ctx.index.function_scope(call) is ctx.index.function_scope(expr) and \
                        not ctx.index.in_other_branch(call, site):
                    divisor = divisor or call.args[0].value
            plain = [a for a in plain_reaching(ctx, name, expr)] if name else []
            if len(plain) > 1 and all(p.value is not None for p in plain) and len(plain) <= 4:
                branches = [logits_divisor(ctx, p.value, site, depth) for p in plain]
                if not any(r for r, _ in branches):
                    return False, None
                return True, divisor or next((d for _, d in branches if d is not None), None)
            if len(plain) != 1 or plain[0].value is None:
                return False, divisor
            expr = plain[0].value
        else:
            return False, divisor
    return False, divisor


def is_model_call(ctx: Analysis, call: cst.Call) -> bool:
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "__call__"):
        func = func.value
    return isinstance(func, (cst.Name, cst.Attribute)) and models(ctx).model(func) is not None


def plain_reaching(ctx: Analysis, key: str, at: cst.CSTNode):
    """The plain assignments of ``key`` that reach ``at`` (augmented ones keep the layout and are looked through)."""
    return [d for d in ctx.flow.reaching(key, at) if d.kind == "assign"]


def all_assignments(ctx: Analysis, key: str, at: cst.CSTNode):
    """Every binding of ``key`` visible from ``at``: in its function, the class's methods for ``self.x``, the
    module for a name the function does not bind."""
    if key.startswith("self."):
        cls = ctx.enclosing_class(at)
        return list(ctx.index.class_defs.get(id(cls), {}).get(key, [])) if cls is not None else []
    scope = ctx.index.function_scope(at)
    found = [d for d in scope.defs.get(key, []) if d.kind != "param"]
    if not found and key not in scope.params:
        found = [d for d in ctx.index.scopes[id(ctx.module)].defs.get(key, []) if d.kind != "param"]
    return found


def key_name(expr: cst.BaseExpression) -> str | None:
    from rlguard.lint.analysis.index import key_entry, key_of

    key = key_of(expr)
    if key is None:
        return None
    entry = key_entry(key)
    return entry if entry is not None else key


def model_role(ctx: Analysis, expr: cst.BaseExpression, depth: int = 10):
    """The model whose forward ``expr`` (a logits chain) starts from, following the same steps as ``divisor``."""
    while depth > 0 and expr is not None:
        depth -= 1
        if isinstance(expr, cst.BinaryOperation):
            expr = expr.left
        elif isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Call):
            if is_model_call(ctx, expr):
                func = expr.func
                if isinstance(func, cst.Attribute) and func.attr.value in ("forward", "__call__"):
                    func = func.value
                ref = models(ctx).model(func)
                last = (dotted_name(func) or "").rsplit(".", 1)[-1]
                if ref is not None and ref.role == "reference" and last and not ctx.names.is_role(last, "ref_model"):
                    # an attribute swapped with the reference in a context manager: the name called is the policy's
                    ref = dataclasses.replace(ref, role="model")
                return ref
            if ctx.is_module_function(expr) and expr.args:  # torch.log_softmax(x, -1)
                expr = expr.args[0].value
            elif isinstance(expr.func, cst.Attribute):
                expr = expr.func.value
            elif expr.args:
                expr = expr.args[0].value
            else:
                return None
        elif isinstance(expr, (cst.Name, cst.Attribute)):
            name = dotted_name(expr)
            if isinstance(expr, cst.Attribute) and (name is None or not name.startswith("self.")):
                expr = expr.value
                continue
            plain = plain_reaching(ctx, name, expr) if name else []
            if len(plain) > 1 and len(plain) <= 4:
                return next((r for r in (model_role(ctx, p.value, depth) for p in plain if p.value is not None)
                             if r is not None), None)
            if len(plain) != 1 or plain[0].value is None:
                return None
            expr = plain[0].value
        else:
            return None
    return None


def model_call_of(ctx: Analysis, expr: cst.BaseExpression, depth: int = 10) -> cst.Call | None:
    while depth > 0 and expr is not None:
        depth -= 1
        if isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
            expr = expr.left
        elif isinstance(expr, cst.Call):
            if is_model_call(ctx, expr):
                return expr
            if ctx.is_module_function(expr) and expr.args:  # F.log_softmax(x, -1)
                expr = expr.args[0].value
            elif isinstance(expr.func, cst.Attribute):
                expr = expr.func.value
            elif expr.args:
                expr = expr.args[0].value
            else:
                return None
        elif isinstance(expr, cst.Attribute):
            name = dotted_name(expr) or ""
            if name.startswith("self.") and name.count(".") == 1:
                return None
            if expr.attr.value == "logits" and isinstance(expr.value, cst.Name):
                # ``out.logits`` with ``out = m(...)``: the call is a causal-LM forward by its output
                defs = plain_reaching(ctx, expr.value.value, expr)
                if len(defs) == 1 and isinstance(defs[0].value, cst.Call) and \
                        not ctx.is_module_function(defs[0].value) and ctx.callee(defs[0].value) is None:
                    return defs[0].value
            expr = expr.value
        elif isinstance(expr, cst.Name):
            defs = plain_reaching(ctx, expr.value, expr)
            if len(defs) != 1 or defs[0].value is None:
                return None
            expr = defs[0].value
        else:
            return None
    return None


def gathered_logp(ctx: Analysis, expr: cst.BaseExpression, depth: int = 4) -> bool:
    """``expr`` holds per-token log-probs gathered from a log-softmax (not a full distribution)."""
    while depth > 0 and expr is not None:
        depth -= 1
        if isinstance(expr, cst.Call):
            if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in ("squeeze", "float", "to") \
                    and not ctx.is_module_function(expr):
                expr = expr.func.value
                continue
            site = gather_site(ctx, expr)
            if site is None or site.logits is None:
                return False
            if site.kind == "gather":
                source = site.logits
                if isinstance(source, cst.Name):
                    defs = plain_reaching(ctx, source.value, source)
                    source = defs[0].value if len(defs) == 1 else None
                return source is not None and "log_softmax" in ctx.code(source)
            return site.kind == "categorical"
        if isinstance(expr, cst.Name):
            defs = ctx.flow.reaching(expr.value, expr)
            if len(defs) != 1 or defs[0].kind != "assign" or defs[0].value is None or defs[0].element is not None:
                return False
            expr = defs[0].value
        else:
            return False
    return False
