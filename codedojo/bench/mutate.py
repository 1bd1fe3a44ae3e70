"""Procedural bugs with libcst: find mutation sites in a module, apply exactly one.

A site is (kind, index): the index-th node of that kind in traversal order, so finding and
applying walk the same tree the same way and need no positions to agree. Only code inside
function bodies is mutated (module-level constants and decorators break imports, not
behaviour), never annotations, decorators or docstrings. `remove_body` is the feature kind:
the function keeps its signature and docstring and raises NotImplementedError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

_BIN_SWAP: dict[type, type] = {
    cst.Add: cst.Subtract, cst.Subtract: cst.Add, cst.Multiply: cst.Divide, cst.Divide: cst.Multiply,
    cst.FloorDivide: cst.Divide, cst.Modulo: cst.FloorDivide, cst.BitAnd: cst.BitOr,
    cst.BitOr: cst.BitAnd, cst.LeftShift: cst.RightShift, cst.RightShift: cst.LeftShift,
}
_AUG_SWAP: dict[type, type] = {
    cst.AddAssign: cst.SubtractAssign, cst.SubtractAssign: cst.AddAssign,
    cst.MultiplyAssign: cst.DivideAssign,
}
_CMP_SWAP: dict[type, type] = {
    cst.LessThan: cst.LessThanEqual, cst.LessThanEqual: cst.LessThan,
    cst.GreaterThan: cst.GreaterThanEqual, cst.GreaterThanEqual: cst.GreaterThan,
    cst.Equal: cst.NotEqual, cst.NotEqual: cst.Equal, cst.In: cst.NotIn, cst.NotIn: cst.In,
    cst.Is: cst.IsNot, cst.IsNot: cst.Is,
}
KINDS = (
    "operator_swap", "invert_condition", "remove_condition", "off_by_one", "remove_statement",
    "wrong_constant", "swap_arguments", "broken_exception", "remove_body",
)


@dataclass(frozen=True)
class Site:
    kind: str
    index: int
    line: int
    before: str  # the node's code before the mutation (for logs and dedup, never for statements)
    function: str  # qualified name of the enclosing function


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _not(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
        return expr.expression.with_changes(lpar=[], rpar=[])
    return cst.UnaryOperation(
        operator=cst.Not(), expression=expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    )


class _Mutator(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, target: tuple[str, int] | None):
        super().__init__()
        self.target = target
        self.sites: list[Site] = []
        self.applied: Site | None = None
        self._counts = dict.fromkeys(KINDS, 0)
        self._stack: list[cst.CSTNode] = []
        self._names: list[str] = []
        self._func = 0
        self._skip = 0
        self._ctx_index = 0  # inside a subscript / range(...) where an integer is an index

    # Generic traversal bookkeeping -------------------------------------------------------
    def on_visit(self, node: cst.CSTNode) -> bool:
        self._stack.append(node)
        if isinstance(node, (cst.Annotation, cst.Decorator, cst.Parameters)):
            self._skip += 1  # (a parameter's default is evaluated at the def, not in the body)
        elif isinstance(node, cst.FunctionDef):
            self._func += 1
            self._names.append(node.name.value)
        elif isinstance(node, cst.ClassDef):
            self._names.append(node.name.value)
        elif isinstance(node, cst.Subscript) or (
            isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "range"
        ):
            self._ctx_index += 1
        return True

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):  # type: ignore[override]
        self._stack.pop()
        parent = self._stack[-1] if self._stack else None
        result: cst.CSTNode | cst.RemovalSentinel = updated
        if isinstance(original, cst.FunctionDef):
            if self._func == 1 and self._skip == 0:
                result = self._offer("remove_body", original, updated, parent)
            self._func -= 1
            self._names.pop()
            return result
        if isinstance(original, cst.ClassDef):
            self._names.pop()
        elif isinstance(original, (cst.Annotation, cst.Decorator, cst.Parameters)):
            self._skip -= 1
        elif isinstance(original, cst.Subscript) or (
            isinstance(original, cst.Call) and isinstance(original.func, cst.Name) and original.func.value == "range"
        ):
            self._ctx_index -= 1
        if self._func == 0 or self._skip:
            return updated
        for kind in _HANDLERS_BY_TYPE.get(type(original), ()):
            result = self._offer(kind, original, result, parent)  # type: ignore[arg-type]
            if result is not updated:
                break
        return result

    def _offer(self, kind: str, original: cst.CSTNode, updated: cst.CSTNode, parent: cst.CSTNode | None):
        check, mutate = _HANDLERS[kind]
        if not check(self, original, parent):
            return updated
        index = self._counts[kind]
        self._counts[kind] += 1
        if self.target is None:
            pos = self.get_metadata(PositionProvider, original)
            code = cst.Module(body=[]).code_for_node(original)
            self.sites.append(Site(kind, index, pos.start.line, code.strip()[:200], ".".join(self._names)))
            return updated
        if self.target == (kind, index) and self.applied is None:
            pos = self.get_metadata(PositionProvider, original)
            code = cst.Module(body=[]).code_for_node(original)
            self.applied = Site(kind, index, pos.start.line, code.strip()[:200], ".".join(self._names))
            return mutate(self, updated, parent)
        return updated


# Handlers: (applies(mutator, node, parent), mutate(mutator, node, parent)) ------------------

def _binop_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    if isinstance(n, cst.BinaryOperation):
        return type(n.operator) in _BIN_SWAP
    if isinstance(n, cst.Comparison):
        return type(n.comparisons[0].operator) in _CMP_SWAP
    if isinstance(n, cst.AugAssign):
        return type(n.operator) in _AUG_SWAP
    if isinstance(n, cst.BooleanOperation):
        return True
    return False


def _binop_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    if isinstance(n, cst.BinaryOperation):
        op = _BIN_SWAP[type(n.operator)]()
        return n.with_changes(operator=op.with_changes(
            whitespace_before=n.operator.whitespace_before, whitespace_after=n.operator.whitespace_after))
    if isinstance(n, cst.Comparison):
        first = n.comparisons[0]
        old = first.operator
        new = _CMP_SWAP[type(old)]()
        if hasattr(old, "whitespace_before") and hasattr(new, "whitespace_before"):
            new = new.with_changes(whitespace_before=old.whitespace_before, whitespace_after=old.whitespace_after)
        return n.with_changes(comparisons=[first.with_changes(operator=new), *n.comparisons[1:]])
    if isinstance(n, cst.AugAssign):
        return n.with_changes(operator=_AUG_SWAP[type(n.operator)]())
    assert isinstance(n, cst.BooleanOperation)
    new_op = cst.Or() if isinstance(n.operator, cst.And) else cst.And()
    return n.with_changes(operator=new_op)


def _cond_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    return isinstance(n, (cst.If, cst.While, cst.IfExp))


def _cond_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    return n.with_changes(test=_not(n.test))  # type: ignore[attr-defined]


def _rmcond_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    return isinstance(n, cst.BooleanOperation)


def _rmcond_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    assert isinstance(n, cst.BooleanOperation)
    return n.left.with_changes(lpar=n.lpar, rpar=n.rpar) if n.lpar else n.left


def _int_index_ctx(m: _Mutator, p: cst.CSTNode | None) -> bool:
    if m._ctx_index > 0:
        return True
    if isinstance(p, cst.BinaryOperation) and isinstance(p.operator, (cst.Add, cst.Subtract)):
        return True
    return isinstance(p, cst.ComparisonTarget)


def _obo_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    return isinstance(n, cst.Integer) and _int_index_ctx(m, p)


def _obo_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    assert isinstance(n, cst.Integer)
    v = int(n.value, 0)
    return n.with_changes(value=str(v + 1 if v <= 0 or m._counts["off_by_one"] % 2 else v - 1))


def _const_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    if isinstance(n, cst.Name) and n.value in ("True", "False"):
        return True
    return isinstance(n, cst.Integer) and not _int_index_ctx(m, p) and not isinstance(p, cst.UnaryOperation)


def _const_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    if isinstance(n, cst.Name):
        return n.with_changes(value="False" if n.value == "True" else "True")
    assert isinstance(n, cst.Integer)
    v = int(n.value, 0)
    return n.with_changes(value={0: "1", 1: "0"}.get(v, str(v * 2)))


def _stmt_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    if not isinstance(n, cst.SimpleStatementLine) or not isinstance(p, cst.IndentedBlock):
        return False
    if len(p.body) < 2 or _is_docstring(n) or (p.body[0] is n and _is_docstring(n)):
        return False
    small = n.body[0]
    if isinstance(small, cst.Expr):
        return isinstance(small.value, cst.Call)
    return isinstance(small, (cst.Assign, cst.AugAssign, cst.Return))


def _stmt_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None):
    return cst.RemoveFromParent()


def _args_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    if not isinstance(n, cst.Call) or len(n.args) < 2:
        return False
    a, b = n.args[0], n.args[1]
    if a.keyword or b.keyword or a.star or b.star:
        return False
    code = cst.Module(body=[]).code_for_node
    return code(a.value) != code(b.value)


def _args_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    assert isinstance(n, cst.Call)
    a, b = n.args[0], n.args[1]
    return n.with_changes(args=[a.with_changes(value=b.value), b.with_changes(value=a.value), *n.args[2:]])


def _exc_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    if isinstance(n, cst.ExceptHandler):
        return n.type is not None
    return (
        isinstance(n, cst.SimpleStatementLine)
        and isinstance(n.body[0], cst.Raise)
        and n.body[0].exc is not None
        and isinstance(p, cst.IndentedBlock)
    )


def _exc_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    if isinstance(n, cst.ExceptHandler):
        code = cst.Module(body=[]).code_for_node(n.type)  # type: ignore[arg-type]
        wrong = "UnicodeError" if "ZeroDivisionError" in code else "ZeroDivisionError"
        return n.with_changes(type=cst.Name(wrong))
    assert isinstance(n, cst.SimpleStatementLine)
    return n.with_changes(body=[cst.Pass()])


def _body_ok(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> bool:
    if not isinstance(n, cst.FunctionDef) or not isinstance(n.body, cst.IndentedBlock):
        return False
    body = n.body.body
    return len(body) >= 3 and _is_docstring(body[0]) and not n.name.value.startswith("__")


def _body_mut(m: _Mutator, n: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode:
    assert isinstance(n, cst.FunctionDef) and isinstance(n.body, cst.IndentedBlock)
    raise_line = cst.parse_statement("raise NotImplementedError\n")
    return n.with_changes(body=n.body.with_changes(body=[n.body.body[0], raise_line]))


_Handler = tuple[Callable[..., bool], Callable[..., object]]
_HANDLERS: dict[str, _Handler] = {
    "operator_swap": (_binop_ok, _binop_mut),
    "invert_condition": (_cond_ok, _cond_mut),
    "remove_condition": (_rmcond_ok, _rmcond_mut),
    "off_by_one": (_obo_ok, _obo_mut),
    "remove_statement": (_stmt_ok, _stmt_mut),
    "wrong_constant": (_const_ok, _const_mut),
    "swap_arguments": (_args_ok, _args_mut),
    "broken_exception": (_exc_ok, _exc_mut),
    "remove_body": (_body_ok, _body_mut),
}
_HANDLERS_BY_TYPE: dict[type, tuple[str, ...]] = {
    cst.BinaryOperation: ("operator_swap",),
    cst.Comparison: ("operator_swap",),
    cst.AugAssign: ("operator_swap",),
    cst.BooleanOperation: ("operator_swap", "remove_condition"),
    cst.If: ("invert_condition",),
    cst.While: ("invert_condition",),
    cst.IfExp: ("invert_condition",),
    cst.Integer: ("off_by_one", "wrong_constant"),
    cst.Name: ("wrong_constant",),
    cst.SimpleStatementLine: ("remove_statement", "broken_exception"),
    cst.Call: ("swap_arguments",),
    cst.ExceptHandler: ("broken_exception",),
}


def find_sites(source: str) -> list[Site]:
    """Every mutation site in a module, in a stable order."""
    m = _Mutator(None)
    MetadataWrapper(cst.parse_module(source)).visit(m)
    return m.sites


def apply_site(source: str, kind: str, index: int) -> tuple[str, Site]:
    """The module with the one mutation applied; raises ValueError when the site is absent."""
    if kind not in _HANDLERS:
        raise ValueError(f"unknown mutation kind {kind!r}")
    m = _Mutator((kind, index))
    out = MetadataWrapper(cst.parse_module(source)).visit(m)
    if m.applied is None:
        raise ValueError(f"no {kind} site #{index} in this module")
    code = out.code
    compile(code, "<mutant>", "exec")  # a mutant that does not parse is our bug, not the task's
    return code, m.applied
