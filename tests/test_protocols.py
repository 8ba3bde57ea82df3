"""The contract is what the code says: every member of the store, the prompt's cache or the decode step that a method
file uses is named in the protocol it codes against (``protocols.Store``, ``protocols.PromptCache``, ``protocols.DecodeStep``), and no
method file writes an attribute of a store or a cache (state goes through the store's methods, ``aux`` and
``cache.state``).

The check reads the method files' syntax (no import, no run): a name is a store when a parameter is annotated so
(``Store``, ``KVStore``), is called ``store``, or is bound from one (``store.cache`` is a cache; ``cache.stores`` a
list of stores, whose elements a ``for`` or a comprehension binds); a cache when annotated ``PromptCache`` /
``MethodCache`` or called ``cache``; a step when annotated ``DecodeStep``. A planted misuse shows the check fails.
"""
from __future__ import annotations

import ast
import textwrap
import typing
from pathlib import Path

import pytest

from luka_bench.methods import protocols

METHODS = Path(__file__).resolve().parents[1] / "luka_bench" / "methods"
# the infrastructure below and beside the contract: it implements the protocols (store, cache, glue) or is pure
# numerics; every other file of the package is a method file (or a method's own helper module) and is checked
INFRA = {"__init__", "attention", "protocols", "base", "positions", "store", "cache", "hf", "policies", "pages", "layered",
         "kmeans", "cpu_kernel", "triton_kernel", "owned", "packed", "rope", "stacked",
         "stacked_packed", "stack_rules"}

STORE, CACHE, STEP, STORES = "Store", "PromptCache", "DecodeStep", "list[Store]"
_ANNOTATED = {"Store": STORE, "KVStore": STORE, "PromptCache": CACHE, "MethodCache": CACHE, "DecodeStep": STEP,
              "Step": STEP}
_NAMED = {"store": STORE, "cache": CACHE}


def protocol_members(proto: type) -> set[str]:
    """The public members a protocol names, its bases' included (``Store`` extends ``attention.HeldKV``)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (object, typing.Protocol, typing.Generic) or cls.__module__ == "typing":
            continue
        names |= {k for k in vars(cls) if not k.startswith("_")}
        names |= {k for k in getattr(cls, "__annotations__", {}) if not k.startswith("_")}
    return names


MEMBERS = {STORE: protocol_members(protocols.Store), CACHE: protocol_members(protocols.PromptCache),
           STEP: protocol_members(protocols.DecodeStep)}


def _annotation_kind(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.Attribute):
        return _ANNOTATED.get(node.attr)
    if isinstance(node, ast.Name):
        return _ANNOTATED.get(node.id)
    return None


class _Checker(ast.NodeVisitor):
    """Walks one file; ``problems`` lists (line, text) of every use outside the protocols and every attribute write."""

    def __init__(self, members: dict[str, set[str]]) -> None:
        self.members = members
        self.problems: list[tuple[int, str]] = []
        self.scopes: list[dict[str, str]] = [{}]

    # -- what kind an expression is ---------------------------------------------------------------------------
    def kind(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return _NAMED.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = self.kind(node.value)
            if owner == STORE and node.attr == "cache":
                return CACHE
            if owner == CACHE and node.attr == "stores":
                return STORES
            return None
        if isinstance(node, ast.Subscript) and self.kind(node.value) == STORES and not isinstance(node.slice, ast.Slice):
            return STORE
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            self._bind_generators(node.generators)
            kind = self.kind(node.elt)
            self.scopes.pop()
            return STORES if kind == STORE else None
        return None

    def _bind_generators(self, generators: list[ast.comprehension]) -> None:
        self.scopes.append({})
        for gen in generators:
            if isinstance(gen.target, ast.Name) and self.kind(gen.iter) == STORES:
                self.scopes[-1][gen.target.id] = STORE

    # -- scopes ---------------------------------------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        args = node.args
        scope = {}
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            kind = _annotation_kind(a.annotation)
            scope[a.arg] = kind if kind is not None else _NAMED.get(a.arg, "other")
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.scopes.append({a.arg: _NAMED.get(a.arg, "other") for a in node.args.args})
        self.generic_visit(node)
        self.scopes.pop()

    def _comprehension(self, node) -> None:
        self._bind_generators(node.generators)
        self.generic_visit(node)
        self.scopes.pop()

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.target, ast.Name):
            self.scopes[-1][node.target.id] = STORE if self.kind(node.iter) == STORES else "other"
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        kind = self.kind(node.value)
        for target in node.targets:
            self._target(target, kind)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        kind = _annotation_kind(node.annotation) or (self.kind(node.value) if node.value is not None else None)
        self._target(node.target, kind)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target, None)
        self.generic_visit(node)

    def _target(self, target: ast.expr, kind: str | None) -> None:
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = kind or "other"
        elif isinstance(target, ast.Attribute):
            owner = self.kind(target.value)
            if owner in (STORE, CACHE):
                self.problems.append((target.lineno, f"writes {ast.unparse(target)} (an attribute of the {owner})"))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._target(t, None)

    # -- uses -------------------------------------------------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = self.kind(node.value)
        if owner in self.members and node.attr not in self.members[owner]:
            self.problems.append((node.lineno, f"uses {ast.unparse(node)}: '{node.attr}' is not named by {owner}"))
        self.generic_visit(node)


def check_source(source: str, members: dict[str, set[str]] | None = None) -> list[tuple[int, str]]:
    checker = _Checker(MEMBERS if members is None else members)
    checker.visit(ast.parse(source))
    return checker.problems


def method_files() -> list[Path]:
    return sorted(p for p in METHODS.glob("*.py") if p.stem not in INFRA)


def test_the_method_files_are_found():
    names = {p.stem for p in method_files()}
    assert {"snapkv", "h2o", "luka_clustered", "lychee", "scorer", "streaming_llm", "finch"} <= names


@pytest.mark.parametrize("path", method_files(), ids=lambda p: p.stem)
def test_a_method_file_uses_only_what_the_protocols_name_and_writes_no_store_attribute(path):
    problems = check_source(path.read_text())
    assert not problems, f"{path.name}: " + "; ".join(f"line {n}: {text}" for n, text in problems)


PLANTED = textwrap.dedent('''
    class P(LayerPolicy):
        def after_step(self, store: Store) -> None:
            store.{use}
''')


@pytest.mark.parametrize("use, found", [
    ("_k.zero_()", "'_k' is not named by Store"),
    ("allocated_bytes()", "'allocated_bytes' is not named by Store"),
    ("cache.method", "'method' is not named by PromptCache"),
    ("n = 3", "writes store.n"),
    ("cache.phase = 'decode'", "writes store.cache.phase"),
])
def test_the_check_fails_on_a_planted_misuse(use, found):
    problems = check_source(PLANTED.format(use=use))
    assert any(found in text for _, text in problems), problems


def test_the_check_follows_stores_through_the_cache_and_loops():
    source = textwrap.dedent('''
        def after_prefill_cache(self, cache):
            for s in cache.stores:
                s.secret()
            ours = [t for t in cache.stores if t.n]
            ours[0].hidden
            x = store.cache.stores[1]
            x.other = 1
        def step(self, store, query, scaling, step: DecodeStep):
            step.nothing
    ''')
    found = [text for _, text in check_source(source)]
    assert any("'secret'" in t for t in found) and any("'hidden'" in t for t in found)
    assert any("writes x.other" in t for t in found) and any("'nothing' is not named by DecodeStep" in t for t in found)
    assert not any("'n'" in t or "'stores'" in t for t in found)


CORE = {STORE: protocol_members(protocols.CoreStore), CACHE: protocol_members(protocols.CorePromptCache), STEP: set()}


@pytest.mark.parametrize("stem", ["knorm", "snapkv", "pyramidkv", "adakv", "laser_kv", "full"])
def test_a_prefill_scorer_needs_only_the_core_tier(stem):
    """The core tier is enough for a prefill scorer: its file uses no capability's member."""
    problems = check_source((METHODS / f"{stem}.py").read_text(), CORE)
    assert not problems, problems


def test_the_core_tier_is_small_and_inside_the_whole_contract():
    assert CORE[STORE] < MEMBERS[STORE] and CORE[CACHE] < MEMBERS[CACHE]
    assert len(CORE[STORE]) + len(CORE[CACHE]) <= 25
