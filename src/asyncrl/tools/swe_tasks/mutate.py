"""Mutation operators: plausible one-spot bugs in a function, made as minimal edits of the file's text.

Each operator looks at the nodes of one function's AST and proposes edits at their source
positions; everything else in the file (formatting, comments) stays byte for byte, so the
reference patch is the line or two a human fix would touch.

    for m in find_mutations(Path("pkg/mod.py").read_text(), "pkg/mod.py"):
        m.operator, m.function, m.lineno  # "off-by-one", "Window.slide", 42
        m.source                          # the whole file with the bug

| operator | example |
|---|---|
| swap-operator | `a + b` -> `a - b`, `x *= 2` -> `x += 2`, `s | t` -> `s & t` |
| swap-comparison | `==` -> `!=`, `<` -> `>`, `in` -> `not in`, `is` -> `is not` |
| off-by-one | `<` -> `<=`, `range(n)` -> `range(n - 1)`, `xs[1:]` -> `xs[2:]`, `x > 0` -> `x > 1` |
| swap-boolean | `a and b` -> `a or b` |
| negate-condition | `if ok:` -> `if not ok:` (`if`, `elif`, conditional expression, comprehension filter) |
| drop-branch | an `if` block without `else` removed; an `else`/`elif` part removed |
| wrong-default | `def f(n=1)` -> `def f(n=2)`, `strict=True` -> `strict=False`, `sep=","` -> `sep=""` |
| swap-arguments | `f(a, b)` -> `f(b, a)` |
| swap-operands | `a - b` -> `b - a` (non-commutative operators) |
| flip-constant | `return True` -> `return False` |
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["OPERATORS", "Function", "Mutation", "find_functions", "find_mutations", "mutate_function"]

Edit = tuple[int, int, str]  # (start, end) character offsets in the file, replacement text
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef

_BINOP_TOKENS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitAnd: "&",
    ast.BitXor: "^",
}
# Each operator's replacement: one that still runs on the same operand types where it can.
_BINOP_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Add,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
    ast.BitXor: ast.BitOr,
}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)
# Comparison operators: how to find each in the text between two operands, and how to write it.
_CMP_PATTERNS: dict[type[ast.cmpop], str] = {
    ast.Eq: r"==",
    ast.NotEq: r"!=",
    ast.LtE: r"<=",
    ast.GtE: r">=",
    ast.Lt: r"<(?!=)",
    ast.Gt: r">(?!=)",
    ast.NotIn: r"\bnot\s+in\b",
    ast.In: r"\bin\b",
    ast.IsNot: r"\bis\s+not\b",
    ast.Is: r"\bis\b",
}
_CMP_TOKENS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.LtE: "<=",
    ast.GtE: ">=",
    ast.Lt: "<",
    ast.Gt: ">",
    ast.NotIn: "not in",
    ast.In: "in",
    ast.IsNot: "is not",
    ast.Is: "is",
}
_CMP_SWAP = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.LtE: ast.GtE,
    ast.GtE: ast.LtE,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_CMP_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.List, ast.Dict, ast.Set)


@dataclass(frozen=True, kw_only=True)
class Function:
    """A function or method of a file. `first_line` is what its code object's `co_firstlineno`
    reads: the line of its first decorator, else of its `def`."""

    path: str
    qualname: str
    first_line: int
    node: FunctionNode


@dataclass(frozen=True, kw_only=True)
class Mutation:
    operator: str
    path: str
    function: str  # qualname, e.g. "Window.slide"
    first_line: int  # the function's (see Function)
    lineno: int  # the first line the edit changes
    source: str  # the whole mutated file


class _Text:
    """Character offsets of AST positions (whose columns count UTF-8 bytes) in a source string."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = re.split(r"(?<=\n)", source)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        return start, self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.source[start:end]

    def operand(self, node: ast.AST) -> str:
        """The node's text, parenthesised unless it is an atom, to be placed in another context."""
        text = self.segment(node)
        return text if isinstance(node, _ATOMS) else f"({text})"


def _gap_edit(text: _Text, left: ast.AST, right: ast.AST, pattern: str, new: str) -> Edit | None:
    """Replace the token matching `pattern` between two operands (outside a comment) by `new`."""
    start, end = text.span(left)[1], text.span(right)[0]
    gap = text.source[start:end]
    m = re.search(pattern, gap.split("#", 1)[0])
    return None if m is None else (start + m.start(), start + m.end(), new)


def _int_value(node: ast.AST) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


# Operators: each yields candidate edit lists for one node.


def _swap_operator(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
        old, new = _BINOP_TOKENS[type(node.op)], _BINOP_TOKENS[_BINOP_SWAP[type(node.op)]]
        edit = _gap_edit(text, node.left, node.right, re.escape(old) + r"(?![*/<>=])", new)
        if edit:
            yield [edit]
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAP:
        old, new = _BINOP_TOKENS[type(node.op)], _BINOP_TOKENS[_BINOP_SWAP[type(node.op)]]
        edit = _gap_edit(text, node.target, node.value, re.escape(old + "="), new + "=")
        if edit:
            yield [edit]


def _compare_edits(node: ast.AST, text: _Text, table: dict) -> Iterator[list[Edit]]:
    if not isinstance(node, ast.Compare):
        return
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        if type(op) in table:
            new = _CMP_TOKENS[table[type(op)]]
            edit = _gap_edit(text, operands[i], operands[i + 1], _CMP_PATTERNS[type(op)], new)
            if edit:
                yield [edit]


def _swap_comparison(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    yield from _compare_edits(node, text, _CMP_SWAP)


def _off_by_one(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    yield from _compare_edits(node, text, _CMP_BOUNDARY)
    bounds: list[ast.AST] = []
    if isinstance(node, ast.Compare):
        bounds = [n for n in (node.left, *node.comparators) if _int_value(n) is not None]
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
        bounds = [b for b in (node.slice.lower, node.slice.upper) if b is not None]
    elif isinstance(node, ast.Subscript) and _int_value(node.slice) is not None:
        bounds = [node.slice]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        bounds = [a for a in node.args[:2] if not isinstance(a, ast.Starred)]
    for bound in bounds:
        start, end = text.span(bound)
        value = _int_value(bound)
        if value is not None:
            yield from ([(start, end, str(value + d))] for d in (1, -1))
        else:
            yield from ([(start, end, f"{text.operand(bound)} {sign} 1")] for sign in "+-")


def _swap_boolean(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    if isinstance(node, ast.BoolOp):
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        edits = [_gap_edit(text, a, b, rf"\b{old}\b", new) for a, b in zip(node.values, node.values[1:])]
        if all(edits):
            yield [e for e in edits if e]


def _negate_condition(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    tests: list[ast.expr] = []
    if isinstance(node, ast.If | ast.IfExp):
        tests = [node.test]
    elif isinstance(node, ast.comprehension):
        tests = list(node.ifs)
    for test in tests:
        start, end = text.span(test)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            yield [(start, end, text.operand(test.operand))]
        else:
            yield [(start, end, f"not {text.operand(test)}")]


def _statement_lines(text: _Text, first: ast.stmt, last: ast.stmt) -> tuple[int, int] | None:
    """The span of the whole lines from `first` to `last`, if no other code shares them."""
    start, end = text.span(first)[0], text.span(last)[1]
    line_start, line_end = text.starts[first.lineno - 1], text.starts[last.end_lineno]  # type: ignore[index]
    before, after = text.source[line_start:start], text.source[end:line_end]
    if before.strip() or after.split("#", 1)[0].strip():
        return None
    return line_start, line_end


def _drop_branch(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    for name in ("body", "orelse", "finalbody"):
        block = getattr(node, name, None)
        if not isinstance(block, list) or len(block) < 2:
            continue
        for stmt in block:
            if isinstance(stmt, ast.If) and not stmt.orelse:
                lines = _statement_lines(text, stmt, stmt)
                if lines:
                    yield [(*lines, "")]
    if isinstance(node, ast.If) and node.orelse:
        body_end = _statement_lines(text, node.body[-1], node.body[-1])
        branch_end = _statement_lines(text, node.orelse[-1], node.orelse[-1])
        if body_end and branch_end:
            yield [(body_end[1], branch_end[1], "")]


def _defaults(fn: FunctionNode) -> list[ast.expr]:
    return [d for d in (*fn.args.defaults, *fn.args.kw_defaults) if d is not None]


def _wrong_default(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return
    for default in _defaults(node):
        start, end = text.span(default)
        value = _int_value(default)
        if isinstance(default, ast.Constant) and isinstance(default.value, bool):
            yield [(start, end, str(not default.value))]
        elif value is not None:
            yield from ([(start, end, str(value + d))] for d in (1, -1))
        elif isinstance(default, ast.Constant) and isinstance(default.value, str) and default.value:
            yield [(start, end, "''")]


def _swap_pair(text: _Text, a: ast.AST, b: ast.AST) -> list[Edit] | None:
    if text.segment(a) == text.segment(b):
        return None
    return [(*text.span(a), text.operand(b)), (*text.span(b), text.operand(a))]


def _swap_arguments(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    if (
        isinstance(node, ast.Call)
        and len(node.args) >= 2
        and not any(isinstance(a, ast.Starred) for a in node.args[:2])
    ):
        edits = _swap_pair(text, node.args[0], node.args[1])
        if edits:
            yield edits


def _swap_operands(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE):
        edits = _swap_pair(text, node.left, node.right)
        if edits:
            yield edits


def _flip_constant(node: ast.AST, text: _Text) -> Iterator[list[Edit]]:
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield [(*text.span(node), str(not node.value))]


OPERATORS: dict[str, Callable[[ast.AST, _Text], Iterator[list[Edit]]]] = {
    "swap-operator": _swap_operator,
    "swap-comparison": _swap_comparison,
    "off-by-one": _off_by_one,
    "swap-boolean": _swap_boolean,
    "negate-condition": _negate_condition,
    "drop-branch": _drop_branch,
    "wrong-default": _wrong_default,
    "swap-arguments": _swap_arguments,
    "swap-operands": _swap_operands,
    "flip-constant": _flip_constant,
}


def find_functions(tree: ast.Module, path: str) -> list[Function]:
    """Every function and method of a module (nested ones too), in source order."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                qualname = prefix + child.name
                found.append(Function(path=path, qualname=qualname, first_line=first, node=child))
                visit(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return sorted(found, key=lambda f: f.first_line)


def _own_nodes(fn: FunctionNode) -> Iterator[ast.AST]:
    """The function node, its defaults and every node of its body outside nested functions and
    classes (those are functions of their own). Decorators are evaluated outside the call."""
    yield fn
    stack: list[ast.AST] = [*_defaults(fn), *fn.body]
    while stack:
        node = stack.pop()
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node
            stack.extend(ast.iter_child_nodes(node))


def _apply(source: str, edits: list[Edit]) -> str:
    for start, end, new in sorted(edits, reverse=True):
        source = source[:start] + new + source[end:]
    return source


def mutate_function(
    source: str, fn: Function, operators: tuple[str, ...] = tuple(OPERATORS)
) -> list[Mutation]:
    """The distinct mutants of one function that parse and change its meaning, by operator, then
    in source order."""
    return _mutants(_Text(source), ast.dump(ast.parse(source)), fn, operators)


def _mutants(text: _Text, original: str, fn: Function, operators: tuple[str, ...]) -> list[Mutation]:
    source = text.source
    seen: set[str] = set()
    mutations: list[Mutation] = []
    for name in operators:
        found = [edits for node in _own_nodes(fn.node) for edits in OPERATORS[name](node, text)]
        for edits in sorted(found):
            mutated = _apply(source, edits)
            if mutated in seen:
                continue
            seen.add(mutated)
            try:
                changed = ast.dump(ast.parse(mutated)) != original
            except SyntaxError:
                continue
            if changed:
                lineno = source.count("\n", 0, min(e[0] for e in edits)) + 1
                mutations.append(
                    Mutation(
                        operator=name,
                        path=fn.path,
                        function=fn.qualname,
                        first_line=fn.first_line,
                        lineno=lineno,
                        source=mutated,
                    )
                )
    return mutations


def find_mutations(source: str, path: str, operators: tuple[str, ...] = tuple(OPERATORS)) -> list[Mutation]:
    """The mutants of every function of a file."""
    unknown = sorted(set(operators) - set(OPERATORS))
    if unknown:
        raise ValueError(f"unknown mutation operators {unknown}; choose from {list(OPERATORS)}")
    tree = ast.parse(source)
    text, original = _Text(source), ast.dump(tree)
    return [m for fn in find_functions(tree, path) for m in _mutants(text, original, fn, operators)]
