"""The CRD's CEL rules (`x-kubernetes-validations`) evaluated with cel-python (`celpy`), as the API
server evaluates them on an InferenceService (tests/operator/test_crd_cel.py compares each with its
Python twin in tessera_operator/validation.py).

What the API server does, and this module mirrors:
- A rule's `self` is the value of the schema node that carries it; a rule under a field the document
  does not have is not evaluated (nor under each item of a list that is absent or empty).
- The object is pruned of null and unknown fields and defaulted first (validation.apply_defaults, the
  structural defaults), then converted to CEL values by the schema: `integer` as int64 (IntType, which
  refuses values past int64), `number` as double even when written `8`, int-or-string as int or string,
  objects as maps of their declared fields; `metadata` at the root shows only `name` and `generateName`.
- `matches` is RE2 (celpy's own, on google-re2: `$` is the end of the text, as on the cluster), `has`,
  `size`, `all`, `exists` are standard CEL, which celpy has. A rule calling a Kubernetes library
  function celpy lacks (quantity, url, lists, ...) fails the compile check until K8S_FUNCTIONS below
  implements it with Kubernetes' documented semantics.
- An evaluation error (a missing field, a type mismatch) refuses the object, as on the cluster.

"Compiling" a rule is celpy's parse plus the part of the API server's type check that catches real
mistakes: every identifier is `self`, `oldSelf` or a macro's variable, every `self.a.b` selects a field
the schema declares (through lists, maps and macro variables), and every function is one this
environment provides. celpy is dynamically typed, so a typo in a field name would otherwise surface
only as an evaluation error on documents that reach it.

Transition rules (those reading `oldSelf`) run only on an update: `evaluate(doc, old=previous)`
evaluates them where the node exists in both documents (list items correlated by their map keys;
items of other lists are not correlated, as on the cluster). The CRD has no transition rule today
(a test keeps that set empty until one comes with update cases).

Not modelled: the API server's cost estimate and runtime cost budget, and its skipping every rule
when the object has a type error elsewhere (here rules are evaluated regardless, so a twin can be
compared on every case).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
import lark
from celpy import celtypes

from tessera_operator.validation import apply_defaults

Schema = dict[str, Any]

# Kubernetes' CEL libraries a rule may call that celpy lacks: name -> implementation with Kubernetes'
# documented semantics. None is needed by the CRD today.
K8S_FUNCTIONS: dict[str, Any] = {}
# Macros (expanded by CEL itself) and the functions celpy provides.
_MACROS = {"has", "all", "exists", "exists_one", "map", "filter"}
_FUNCTIONS = set(celpy.evaluation.base_functions) | set(K8S_FUNCTIONS)
# What `self.metadata` shows of the object's metadata on the cluster.
_ROOT_METADATA: Schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                           "generateName": {"type": "string"}}}


class RuleCompileError(AssertionError):
    """A rule that does not parse or does not type-check against the schema."""


@dataclass(frozen=True)
class Rule:
    path: str        # the schema node carrying it: "" (the root), "spec.pools.prefill", "spec.loras[*]"
    text: str
    message: str
    transition: bool  # reads oldSelf

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.text}"


@dataclass(frozen=True)
class Outcome:
    rule: Rule
    path: str         # the node in the document: "spec.loras[0]"
    value: Any        # the node's (pruned, defaulted) Python value, for a twin
    passed: bool
    error: str | None = None  # an evaluation error (a refusal)


@dataclass(frozen=True)
class Failure:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def collect_rules(schema: Schema) -> list[tuple[Rule, Schema]]:
    """Every rule of the schema with the node that carries it, walking properties, list items
    ([*]) and map values (.*)."""
    out = []

    def walk(node: Schema, path: str) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            text = rule["rule"]
            out.append((Rule(path, text, rule.get("message", f"failed rule: {text}"),
                             "oldSelf" in _identifiers(text)), node))
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}" if path else key)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[*]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.*")

    walk(schema, "")
    return out


class CelRules:
    """The rules of one schema, compiled; `evaluate` runs those that apply to a document."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.env = celpy.Environment()
        self.rules: list[Rule] = []
        self.compile_errors: dict[Rule, str] = {}
        self._programs: dict[Rule, celpy.Runner] = {}
        self._nodes: dict[Rule, Schema] = {}
        for rule, node in collect_rules(schema):
            self.rules.append(rule)
            self._nodes[rule] = node
            try:
                self._programs[rule] = self.compile(rule, node)
            except RuleCompileError as exc:
                self.compile_errors[rule] = str(exc)

    def compile(self, rule: Rule, node: Schema) -> celpy.Runner:
        try:
            ast = self.env.compile(rule.text)
        except celpy.CELParseError as exc:
            raise RuleCompileError(f"{rule}: does not parse: {exc}") from None
        problems = _TypeCheck(node, is_root=rule.path == "").check(ast)
        if problems:
            raise RuleCompileError(f"{rule}: " + "; ".join(problems))
        return self.env.program(ast, functions=K8S_FUNCTIONS or None)

    def evaluate(self, doc: dict, old: dict | None = None) -> list[Outcome]:
        """Every rule that applies to `doc` (as submitted: pruned and defaulted here), with its result.
        Transition rules run only with `old`, where their node exists in both."""
        doc, old = prepare(doc, self.schema), (prepare(old, self.schema) if old is not None else None)
        out = []
        for rule in self.rules:
            if rule in self.compile_errors:
                raise RuleCompileError(self.compile_errors[rule])
            if rule.transition and old is None:
                continue
            node = self._nodes[rule]
            for path, value, old_value in _locations(doc, old, self.schema, rule.path):
                if rule.transition and old_value is _ABSENT:
                    continue
                try:
                    activation = {"self": to_cel(value, node, is_root=rule.path == "")}
                    if rule.transition:
                        activation["oldSelf"] = to_cel(old_value, node, is_root=rule.path == "")
                except ValueError as exc:  # an integer past int64: the API server cannot decode it either
                    out.append(Outcome(rule, path, value, False, str(exc)))
                    continue
                try:
                    result = self._programs[rule].evaluate(activation)
                except celpy.CELEvalError as exc:
                    out.append(Outcome(rule, path, value, False, str(exc.args[0] if exc.args else exc)))
                    continue
                if isinstance(result, celpy.CELEvalError):
                    out.append(Outcome(rule, path, value, False, str(result.args[0] if result.args else result)))
                elif not isinstance(result, celtypes.BoolType):
                    out.append(Outcome(rule, path, value, False, f"rule returned {type(result).__name__}, not bool"))
                else:
                    out.append(Outcome(rule, path, value, bool(result)))
        return out

    def failures(self, doc: dict, old: dict | None = None) -> list[Failure]:
        """The rules `doc` breaks, as the API server words them (path: message)."""
        return [Failure(o.path, o.rule.message) for o in self.evaluate(doc, old) if not o.passed]


# --- the document as the API server hands it to CEL ------------------------------------------------

_ABSENT = object()


def prepare(doc: dict, schema: Schema) -> dict:
    """A copy of `doc` with null fields pruned and the structural defaults applied (the API server's order)."""
    out = _prune_nulls(copy.deepcopy(doc), schema)
    apply_defaults(out, schema)
    return out


def _prune_nulls(value: Any, schema: Schema) -> Any:
    """Null values of fields that are not `nullable` are dropped (and then defaulted), as on the cluster."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
        for key in list(value):
            sub = props.get(key, extra)
            if value[key] is None and sub is not None and not sub.get("nullable"):
                del value[key]
            elif sub is not None:
                value[key] = _prune_nulls(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune_nulls(v, schema["items"]) for v in value]
    return value


def to_cel(value: Any, schema: Schema, *, is_root: bool = False) -> Any:
    """A JSON value as a CEL value of its schema's type. A value of the wrong type (which the API
    server's structural check refuses) is converted as plain JSON, so rules can still be compared."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if schema.get("x-kubernetes-int-or-string"):
        if is_int:
            return celtypes.IntType(value)
        if isinstance(value, str):
            return celtypes.StringType(value)
    kind = schema.get("type")
    if kind == "integer" and is_int:
        return celtypes.IntType(value)  # int64: IntType raises past its range
    if kind == "number" and (is_int or isinstance(value, float)):
        return celtypes.DoubleType(float(value))
    if kind == "string" and isinstance(value, str):
        return celtypes.StringType(value)
    if kind == "boolean" and isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "array" and isinstance(value, list) and isinstance(schema.get("items"), dict):
        return celtypes.ListType([to_cel(v, schema["items"]) for v in value])
    if kind == "object" and isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if is_root:
            props = {**(props or {}), "metadata": _ROOT_METADATA}
        if props is not None:  # unknown fields are pruned
            return celtypes.MapType({celtypes.StringType(k): to_cel(v, props[k]) for k, v in value.items()
                                     if k in props})
        if isinstance(extra, dict):
            return celtypes.MapType({celtypes.StringType(k): to_cel(v, extra) for k, v in value.items()})
    return celpy.json_to_cel(value)


def _locations(doc: Any, old: Any, schema: Schema, rule_path: str) -> Iterator[tuple[str, Any, Any]]:
    """(concrete path, value, old value or _ABSENT) of every node of `doc` at the schema path `rule_path`."""
    steps = _steps(rule_path)

    def walk(value: Any, old_value: Any, node: Schema, i: int, path: str) -> Iterator[tuple[str, Any, Any]]:
        if i == len(steps):
            yield path, value, old_value
            return
        step = steps[i]
        if step == "[*]":
            if not isinstance(value, list):
                return
            keys = node.get("x-kubernetes-list-map-keys") if node.get("x-kubernetes-list-type") == "map" else None
            for n, item in enumerate(value):
                before = _ABSENT
                if keys and isinstance(old_value, list) and isinstance(item, dict):
                    before = next((o for o in old_value if isinstance(o, dict)
                                   and all(o.get(k) == item.get(k) for k in keys)), _ABSENT)
                yield from walk(item, before, node["items"], i + 1, f"{path}[{n}]")
        elif step == "*":
            if not isinstance(value, dict):
                return
            for key, item in value.items():
                before = old_value.get(key, _ABSENT) if isinstance(old_value, dict) else _ABSENT
                yield from walk(item, before, node["additionalProperties"], i + 1, _join(path, key))
        elif isinstance(value, dict) and step in value:
            before = old_value.get(step, _ABSENT) if isinstance(old_value, dict) else _ABSENT
            yield from walk(value[step], before, node["properties"][step], i + 1, _join(path, step))

    yield from walk(doc, old if old is not None else _ABSENT, schema, 0, "")


def _steps(rule_path: str) -> list[str]:
    steps: list[str] = []
    for part in rule_path.replace("[*]", ".[*]").split("."):
        if part:
            steps.append(part)
    return steps


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --- the compile-time check --------------------------------------------------------------------------

def _identifiers(text: str) -> set[str]:
    try:
        tree = celpy.Environment().compile(text)
    except celpy.CELParseError:
        return set()
    return {str(t) for t in tree.scan_values(lambda v: isinstance(v, lark.Token) and v.type == "IDENT")}


_DYNAMIC: Schema = {}  # a value whose type the check does not know (a literal, a function's result)


class _TypeCheck:
    """Resolves every `self...` selection against the schema, as the API server's compile does."""

    def __init__(self, node: Schema, *, is_root: bool) -> None:
        self.self_schema = node
        if is_root:
            self.self_schema = {**node, "properties": {**node.get("properties", {}), "metadata": _ROOT_METADATA}}
        self.problems: list[str] = []

    def check(self, tree: lark.Tree) -> list[str]:
        self._expr(tree, {"self": self.self_schema, "oldSelf": self.self_schema})
        return self.problems

    def _expr(self, tree: Any, scope: dict[str, Schema]) -> None:
        if not isinstance(tree, lark.Tree):
            return
        if tree.data == "member":
            self._member(tree, scope)
            return
        for child in tree.children:
            self._expr(child, scope)

    def _member(self, tree: lark.Tree, scope: dict[str, Schema]) -> Schema:
        """The schema of a `member` node's value (_DYNAMIC when unknown)."""
        (child,) = tree.children
        if child.data == "primary":
            return self._primary(child, scope)
        if child.data == "member_dot":
            receiver, field = child.children
            return self._select(self._member(receiver, scope), str(field), receiver)
        if child.data == "member_dot_arg":
            receiver, method, *args = child.children
            target = self._member(receiver, scope)
            exprs = args[0].children if args else []
            return self._call(str(method), exprs, scope, target)
        if child.data == "member_index":
            receiver, index = child.children
            target = self._member(receiver, scope)
            self._expr(index, scope)
            if target.get("type") == "array":
                return target.get("items", _DYNAMIC)
            if isinstance(target.get("additionalProperties"), dict):
                return target["additionalProperties"]
            return _DYNAMIC
        self._expr(child, scope)  # member_object (message construction) and the like
        return _DYNAMIC

    def _primary(self, tree: lark.Tree, scope: dict[str, Schema]) -> Schema:
        (child,) = tree.children
        if isinstance(child, lark.Tree) and child.data == "ident":
            name = str(child.children[0])
            if name not in scope:
                self.problems.append(f"undeclared reference to {name!r}")
                return _DYNAMIC
            return scope[name]
        if isinstance(child, lark.Tree) and child.data == "ident_arg":
            name, *args = child.children
            exprs = args[0].children if args else []
            if str(name) == "has":
                if len(exprs) != 1 or not self._is_selection(exprs[0]):
                    self.problems.append("has() takes one field selection")
                for expr in exprs:
                    self._expr(expr, scope)
                return {"type": "boolean"}
            return self._call(str(name), exprs, scope, None)
        self._expr(child, scope)
        return _DYNAMIC

    def _call(self, name: str, exprs: list, scope: dict[str, Schema], target: Schema | None) -> Schema:
        if name in _MACROS and target is not None:
            if len(exprs) < 2 or len(exprs) > 3:
                self.problems.append(f"{name}() takes a variable and an expression")
                return _DYNAMIC
            variable = _bare_identifier(exprs[0])
            if variable is None:
                self.problems.append(f"{name}(): the first argument must be a variable name")
                return _DYNAMIC
            if target.get("type") == "array":
                element = target.get("items", _DYNAMIC)
            elif target.get("type") == "object" and target is not _DYNAMIC:
                element = {"type": "string"}  # a map's macros range over its keys
            else:
                element = _DYNAMIC
            for expr in exprs[1:]:
                self._expr(expr, {**scope, variable: element})
            return _DYNAMIC
        if name not in _FUNCTIONS:
            self.problems.append(f"unknown function {name!r} (celpy lacks it: implement it in K8S_FUNCTIONS)")
        for expr in exprs:
            self._expr(expr, scope)
        return _DYNAMIC

    def _select(self, target: Schema, field: str, receiver: lark.Tree) -> Schema:
        if target is _DYNAMIC:
            return _DYNAMIC
        props = target.get("properties")
        if props is not None:
            if field not in props:
                self.problems.append(f"undefined field {field!r} (known: {', '.join(props)})")
                return _DYNAMIC
            return props[field]
        if isinstance(target.get("additionalProperties"), dict):
            return target["additionalProperties"]
        if target.get("type") == "object" and target.get("x-kubernetes-preserve-unknown-fields"):
            return _DYNAMIC
        self.problems.append(f"cannot select {field!r} from a {target.get('type', 'value')}")
        return _DYNAMIC

    @staticmethod
    def _is_selection(expr: Any) -> bool:
        members = [t for t in expr.iter_subtrees() if t.data in ("member_dot", "member_index")]
        return bool(members)


def _bare_identifier(expr: Any) -> str | None:
    """`x` when the expression is just an identifier."""
    idents = [t for t in expr.iter_subtrees() if t.data == "ident"]
    others = [t for t in expr.iter_subtrees() if t.data not in
              ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary",
               "member", "primary", "ident")]
    if len(idents) == 1 and not others:
        return str(idents[0].children[0])
    return None
