"""Reaching definitions: which bindings may give a name, an attribute path or a dict key its value at a point.

This is the one reaching-definition query of rlguard. It walks backwards from the statement of the read through
the statements that precede it, structurally:

- a plain assignment of the key ends the walk (it kills what came before); ``x = f(x)`` read on its own right
  side reaches the *previous* ``x``, never its own statement;
- ``if``/``elif``/``else`` and ``match`` join their branches (a branch that ends in ``return``, ``raise``,
  ``break`` or ``continue`` contributes nothing to what follows); a loop or ``try`` body may not run, so the walk
  goes on past it;
- inside a loop, definitions later in the body reach the next iteration (loop-carried), unless the key is
  defined again before the read in the same iteration (a value rebound at the loop head carries nothing over);
- ``with`` bodies always run;
- a comprehension's target shadows outer names inside it; a function's parameters and then its enclosing
  scopes (module constants, closures) are where the walk ends; ``self.x`` falls back to every assignment of
  ``self.x`` in the class's methods and class body;
- a dict key ``d['k']`` is reached by stores to ``d['k']``, or by the binding of ``d`` itself (the value of the
  key is then read off that value by the caller); a call that receives ``d`` or a mutating method of ``d``
  (``update``, ``setdefault``...) in between makes the key *unknown* (:data:`ESCAPED`).

The answer is a list of :class:`~rlguard.lint.analysis.index.Def` (empty: nothing in view binds the key).
"""

from __future__ import annotations

import libcst as cst

from rlguard.lint.analysis.index import COMPREHENSIONS, Def, ModuleIndex, dotted_name, key_base

# A key path whose container was handed to code the analysis cannot see: its value is unknown.
ESCAPED = Def("<escaped>", "escaped", None, cst.Pass(), cst.Module([]), -1)
MUTATING_METHODS = frozenset({"update", "setdefault", "clear", "pop", "popitem", "__setitem__", "append",
                              "extend", "insert", "remove", "sort", "reverse", "add", "discard"})
_ENDS_FLOW = (cst.Return, cst.Raise, cst.Break, cst.Continue)


# suites up to this many statements are walked statement by statement (a plan costs more than it saves there)
_PLANNED_SUITE = 8


def _descending_below(a: list[int], b, upto: int) -> list[int]:
    """The positions of two ascending lists that lie below ``upto``, merged, highest first."""
    return sorted({j for j in a if j < upto} | {j for j in b if j < upto}, reverse=True)


class Flow:
    """Reaching definitions over one module's index (memoised)."""

    def __init__(self, index: ModuleIndex):
        self.index = index
        self._memo: dict[tuple, tuple[tuple[Def, ...], bool]] = {}
        self._through: dict[int, bool] = {}
        self._escaping: dict[int, frozenset[str]] = {}
        self._reaching: dict[tuple, list[Def]] = {}
        self._owners: dict[int, cst.CSTNode | None] = {}
        self._bound: dict[int, object] = {}
        self._bases: dict[int, frozenset[str]] = {}
        self._plans: dict[int, tuple[list[int], dict[str, list[int]]]] = {}

    # ----- the query --------------------------------------------------------------------------------------
    def reaching(self, key: str, at: cst.CSTNode) -> list[Def]:
        """The definitions of ``key`` that may reach the point ``at`` (an expression or a statement)."""
        if not key:
            return []
        index = self.index
        scope = index.scope_node(at)
        if type(scope) in _INNER_SCOPES:
            comp = self._comprehension_def(key, at)
            if comp is not None:
                return [comp]
        stmt = index.statement_of(at)
        memo_key = (key, id(stmt), id(scope))
        hit = self._reaching.get(memo_key)
        if hit is None:
            base = key_base(key)
            if (base == key or base in ("self", "cls")) and type(scope) not in _INNER_SCOPES and \
                    base not in self._rebound_bases(scope):
                # nothing in this scope binds the name (its parameters aside): the walk back would find nothing
                # on the way up, so go straight to what the top of the scope gives (parameters, enclosing scopes)
                hit = self._finish([], key, scope, at)
            else:
                hit = self._walk_back(key, at, stmt, scope)
            self._reaching[memo_key] = hit
        return list(hit)

    def _rebound_bases(self, scope: cst.CSTNode):
        """Key bases that some statement of ``scope`` binds (parameters excluded); everything for a scope the
        index does not know (then the shortcut is never taken)."""
        hit = self._bound.get(id(scope))
        if hit is None:
            info = self.index.scopes.get(id(scope))
            hit = _EVERYTHING if info is None else frozenset(
                key_base(k) for k, defs in info.defs.items() if any(d.kind != "param" for d in defs))
            self._bound[id(scope)] = hit
        return hit

    def _walk_back(self, key: str, at: cst.CSTNode, stmt: cst.CSTNode, scope: cst.CSTNode) -> list[Def]:
        index = self.index
        found: list[Def] = []
        node = stmt
        loops_seen: set[int] = set()
        while True:
            pos = index.position.get(id(node))
            if pos is None:  # the module itself
                return self._finish(found, key, scope, at)
            suite, i = pos
            defs, definite = self._suite_back(suite, i, key)
            found += defs
            if definite:
                return _dedupe(found)
            owner = self._owner(suite)
            if owner is None or owner is scope or isinstance(owner, (cst.FunctionDef, cst.ClassDef, cst.Module)):
                return self._finish(found, key, scope, at)
            if isinstance(owner, (cst.For, cst.While)) and id(owner) not in loops_seen and self._in_body(owner, suite):
                loops_seen.add(id(owner))
                if isinstance(owner, cst.For) and self._binds(owner, key):
                    # the target is bound at the head of every iteration
                    found += [d for d in self.index.stmt_defs.get(id(owner), ()) if d.key == key]
                    return _dedupe(found)
                carried, _ = self._suite_end(owner.body, key)
                found += carried
            node = owner

    def reaching_values(self, key: str, at: cst.CSTNode) -> list[Def]:
        """Like :meth:`reaching`, without parameters and imports (the bindings that carry an expression)."""
        return [d for d in self.reaching(key, at) if d.kind not in ("param", "import")]

    # ----- walking suites ---------------------------------------------------------------------------------------
    def _suite_back(self, suite: cst.CSTNode, upto: int, key: str) -> tuple[list[Def], bool]:
        """Definitions of ``key`` reaching the point before statement ``upto`` of ``suite`` from inside it."""
        found: list[Def] = []
        body = suite.body
        through = self._through
        base = key_base(key)
        # a plain name (or self./cls. attribute) can only be bound by a statement that binds its base; a deeper
        # key path may also change when its container escapes into a call, so those statements are all asked
        plain = base == key or base in ("self", "cls")
        if plain and upto > _PLANNED_SUITE:
            # only the statements that bind the base or end the flow can matter: visit those alone
            stops, binders = self._suite_plan(suite)
            for j in _descending_below(stops, binders.get(base, ()), upto):
                stmt = body[j]
                if not through[id(stmt)]:
                    return found, True
                defs, definite = self._statement(stmt, key)
                found += defs
                if definite:
                    return found, True
            return found, False
        bases = self._bases
        for j in range(upto - 1, -1, -1):
            stmt = body[j]
            falls = through.get(id(stmt))
            if falls is None:
                falls = self.falls_through(stmt)
            if not falls:
                return found, True  # the read is unreachable from here on this path
            if plain:
                bound = bases.get(id(stmt))
                if bound is None:
                    bound = self._bases_of(stmt)
                if base not in bound:
                    continue
            defs, definite = self._statement(stmt, key)
            found += defs
            if definite:
                return found, True
        return found, False

    def _suite_plan(self, suite: cst.CSTNode) -> tuple[list[int], dict[str, list[int]]]:
        """Per suite, once: the positions of its statements that do not fall through, and for each key base the
        positions of the statements that bind it (everything inside them included)."""
        plan = self._plans.get(id(suite))
        if plan is None:
            stops: list[int] = []
            binders: dict[str, list[int]] = {}
            for j, stmt in enumerate(suite.body):
                if not self.falls_through(stmt):
                    stops.append(j)
                bound = self._bases.get(id(stmt))
                for b in (bound if bound is not None else self._bases_of(stmt)):
                    binders.setdefault(b, []).append(j)
            plan = self._plans[id(suite)] = (stops, binders)
        return plan

    def _bases_of(self, stmt: cst.CSTNode) -> frozenset[str]:
        """Key bases that ``stmt`` (with everything inside it) binds."""
        index = self.index
        out = set(index.defined_inside.get(id(stmt), ()))
        out.update(key_base(d.key) for d in index.stmt_defs.get(id(stmt), ()))
        if type(stmt) in (cst.SimpleStatementLine, cst.SimpleStatementSuite):
            for small in stmt.body:
                out.update(key_base(d.key) for d in index.stmt_defs.get(id(small), ()))
        hit = self._bases[id(stmt)] = frozenset(out)
        return hit

    def _suite_end(self, suite: cst.CSTNode, key: str) -> tuple[list[Def], bool]:
        """Definitions reaching the end of ``suite`` (a block or a statement list), and whether ``key`` is
        definitely bound there (vacuously when the suite never falls through)."""
        memo_key = (id(suite), key, "end")
        hit = self._memo.get(memo_key)
        if hit is not None:
            return list(hit[0]), hit[1]
        if isinstance(suite, (cst.IndentedBlock, cst.SimpleStatementSuite, cst.SimpleStatementLine, cst.Module)):
            defs, definite = self._suite_back(suite, len(suite.body), key)
        else:
            defs, definite = self._statement(suite, key)
        self._memo[memo_key] = (tuple(defs), definite)
        return defs, definite

    def _statement(self, stmt: cst.CSTNode, key: str) -> tuple[list[Def], bool]:
        """Definitions of ``key`` by ``stmt`` that reach its end, and whether it definitely binds ``key``."""
        index = self.index
        if type(stmt) is cst.SimpleStatementLine:
            return self._suite_end(stmt, key)
        base = key_base(key)
        path = base != key and base not in ("self", "cls")  # a key path whose container may escape
        compound = index.defined_inside.get(id(stmt))
        if compound is not None:  # a compound statement
            if base in compound or (path and self._escapes_in(stmt, base)):
                return self._compound(stmt, key)
            return [], False
        here = index.stmt_defs.get(id(stmt))
        if not here:
            if path and self._escapes(stmt, base):
                return [ESCAPED], True
            return [], False
        if type(stmt) in (cst.FunctionDef, cst.ClassDef):
            defs = [d for d in here if d.key == key]
            return defs, bool(defs)
        defs = [d for d in here if d.key == key]
        if defs:
            return [defs[-1]], True
        if base != key:
            whole = [d for d in here if _is_prefix(d.key, key)]
            if whole:
                return [whole[-1]], True  # the container itself is rebound: its value holds the key
            if path and self._escapes(stmt, base):
                return [ESCAPED], True
        return [], False

    def _compound(self, stmt: cst.CSTNode, key: str) -> tuple[list[Def], bool]:
        memo_key = (id(stmt), key, "stmt")
        hit = self._memo.get(memo_key)
        if hit is not None:
            return list(hit[0]), hit[1]
        if isinstance(stmt, cst.If):
            branches = [stmt.body, stmt.orelse.body if isinstance(stmt.orelse, cst.Else) else stmt.orelse]
            defs, definite = self._join(branches, key)
        elif isinstance(stmt, (cst.For, cst.While)):
            defs, _ = self._suite_end(stmt.body, key)
            if isinstance(stmt, cst.For):
                defs += [d for d in self.index.stmt_defs.get(id(stmt), ()) if d.key == key]
            if stmt.orelse is not None:
                more, _ = self._suite_end(stmt.orelse.body, key)
                defs += more
            definite = False
        elif isinstance(stmt, cst.With):
            defs, definite = self._suite_end(stmt.body, key)
            if not definite:
                defs += [d for d in self.index.stmt_defs.get(id(stmt), ()) if d.key == key]
                definite = any(d.key == key for d in self.index.stmt_defs.get(id(stmt), ()))
        elif isinstance(stmt, cst.Try) or type(stmt).__name__ == "TryStar":
            defs, definite = self._suite_end(stmt.body, key)
            for handler in stmt.handlers:
                more, handler_definite = self._suite_end(handler.body, key)
                defs += more
                definite = definite and handler_definite
            if stmt.orelse is not None:
                more, _ = self._suite_end(stmt.orelse.body, key)
                defs += more
            if stmt.finalbody is not None:
                more, final_definite = self._suite_end(stmt.finalbody.body, key)
                if final_definite:
                    defs, definite = more, True
                else:
                    defs += more
        elif isinstance(stmt, cst.Match):
            defs, _ = self._join([case.body for case in stmt.cases], key)
            definite = False
        else:
            defs, definite = [], False
        self._memo[memo_key] = (tuple(defs), definite)
        return defs, definite

    def _join(self, branches, key: str) -> tuple[list[Def], bool]:
        defs: list[Def] = []
        definite = True
        for branch in branches:
            if branch is None:
                definite = False
                continue
            more, branch_definite = self._suite_end(branch, key)
            defs += more
            definite = definite and branch_definite
        return defs, definite

    # ----- control flow ---------------------------------------------------------------------------------------
    def falls_through(self, stmt: cst.CSTNode) -> bool:
        """Whether running ``stmt`` can continue with the next statement (not after ``return``, ``raise``...)."""
        hit = self._through.get(id(stmt))
        if hit is None:
            hit = self._through[id(stmt)] = self._falls_through(stmt)
        return hit

    def _falls_through(self, stmt: cst.CSTNode) -> bool:
        if isinstance(stmt, _ENDS_FLOW):
            return False
        if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite, cst.IndentedBlock)):
            return all(self.falls_through(s) for s in stmt.body)
        if isinstance(stmt, cst.If):
            if stmt.orelse is None:
                return True
            other = stmt.orelse.body if isinstance(stmt.orelse, cst.Else) else stmt.orelse
            return self.falls_through(stmt.body) or self.falls_through(other)
        if isinstance(stmt, cst.With):
            return self.falls_through(stmt.body)
        return True

    # ----- helpers ---------------------------------------------------------------------------------------------
    def _owner(self, suite: cst.CSTNode) -> cst.CSTNode | None:
        """The statement whose part ``suite`` is (a SimpleStatementLine for its small statements, the compound
        statement for a block), or None at the module's top."""
        if type(suite) is cst.SimpleStatementLine:
            return suite
        if type(suite) is cst.Module:
            return None
        hit = self._owners.get(id(suite), _NO_OWNER)
        if hit is not _NO_OWNER:
            return hit
        found = None
        for anc in self.index.ancestors(suite):
            if id(anc) in self.index.position or type(anc) in (cst.FunctionDef, cst.ClassDef, cst.Module):
                found = anc
                break
        self._owners[id(suite)] = found
        return found

    @staticmethod
    def _in_body(loop: cst.For | cst.While, suite: cst.CSTNode) -> bool:
        return suite is loop.body

    def _binds(self, stmt: cst.CSTNode, key: str) -> bool:
        return any(d.key == key for d in self.index.stmt_defs.get(id(stmt), ()))

    def _comprehension_def(self, key: str, at: cst.CSTNode) -> Def | None:
        if "." in key or "[" in key:
            return None
        index = self.index
        for anc in index.ancestors(at):
            if isinstance(anc, COMPREHENSIONS + (cst.Lambda,)):
                info = index.scopes.get(id(anc))
                defs = info.defs.get(key) if info is not None else None
                if defs:
                    return defs[-1]
            elif isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Module)) or id(anc) in index.position:
                return None
        return None

    def _finish(self, found: list[Def], key: str, scope: cst.CSTNode, at: cst.CSTNode) -> list[Def]:
        """At the top of the scope: parameters, then the enclosing scopes (and ``self.x`` in the class)."""
        index = self.index
        if key.startswith(("self.", "cls.")):
            cls = index.enclosing_class(at)
            if cls is not None:
                # assignments in the other methods (this method's own were walked above), then class attributes
                here = index.function_scope(at).node
                attr = key.split("[", 1)[0]
                class_defs = index.class_defs.get(id(cls), {})
                for k in dict.fromkeys((key, attr)):
                    found += [d for d in class_defs.get(k, ()) if index.function_scope(d.stmt).node is not here]
                if attr == key:
                    found += index.scopes[id(cls)].defs.get(key.split(".", 1)[1], [])
            return _dedupe(found)
        base = key_base(key)
        info = index.scopes.get(id(scope))
        while info is not None:
            if isinstance(info.node, cst.ClassDef) and info.node is not scope:
                info = info.parent  # class bodies are not visible from their methods
                continue
            if base in info.params:
                if base == key:
                    found += [d for d in info.defs.get(key, ()) if d.kind == "param"]
                return _dedupe(found)
            if info.node is not scope:
                defs = info.defs.get(key, [])
                if defs:
                    found += defs
                    return _dedupe(found)
                if base != key and info.defs.get(base):
                    found += info.defs[base]
                    return _dedupe(found)
            info = info.parent
        return _dedupe(found)

    def _escapes(self, stmt: cst.CSTNode, base: str) -> bool:
        """Whether the small statement ``stmt`` hands the container ``base`` to other code."""
        names = self._escaping.get(id(stmt))
        if names is None:
            names = self._escaping[id(stmt)] = _escaping_names(self.index, stmt)
        return base in names

    def _escapes_in(self, stmt: cst.CSTNode, base: str) -> bool:
        return any(self._escapes(small, base) for small in self.index.descendants(stmt, *_SMALL))


_SMALL = (cst.Expr, cst.Assign, cst.AugAssign, cst.AnnAssign, cst.Return)
_INNER_SCOPES = frozenset(COMPREHENSIONS) | {cst.Lambda}


class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


_EVERYTHING = _Everything()
_NO_OWNER = object()


def _escaping_names(index: ModuleIndex, stmt: cst.CSTNode) -> frozenset[str]:
    """Names ``stmt`` passes to calls as whole arguments, or whose mutating methods it calls."""
    names: set[str] = set()
    calls = index.descendants(stmt, cst.Call)
    if type(stmt) is cst.Call:
        calls = [stmt, *calls]
    for call in calls:
        for arg in call.args:
            if type(arg.value) is cst.Name:
                names.add(arg.value.value)
        func = call.func
        if type(func) is cst.Attribute and func.attr.value in MUTATING_METHODS:
            base = dotted_name(func.value)
            if base is not None:
                names.add(base)
    names.discard("self")
    names.discard("cls")
    return frozenset(names)


def _is_prefix(container: str, key: str) -> bool:
    return key.startswith(container) and key[len(container):len(container) + 1] in (".", "[")


def _dedupe(defs: list[Def]) -> list[Def]:
    seen: set[int] = set()
    out = []
    for d in defs:
        if id(d) not in seen:
            seen.add(id(d))
            out.append(d)
    return out
