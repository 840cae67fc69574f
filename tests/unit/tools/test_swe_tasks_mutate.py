"""Mutation operators on small snippets: each makes the bug it names, as a minimal text edit."""

from __future__ import annotations

import ast
import difflib

import pytest

from asyncrl.tools.swe_tasks.mutate import OPERATORS, find_functions, find_mutations


def changes(source: str, operator: str) -> set[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(removed lines, added lines) of each mutant the operator makes of `source`."""
    found = set()
    for m in find_mutations(source, "mod.py", (operator,)):
        diff = list(difflib.unified_diff(source.splitlines(), m.source.splitlines(), lineterm="", n=0))
        removed = tuple(line[1:].strip() for line in diff[2:] if line.startswith("-"))
        added = tuple(line[1:].strip() for line in diff[2:] if line.startswith("+"))
        found.add((removed, added))
    return found


def added(source: str, operator: str) -> set[str]:
    return {" | ".join(a) for _, a in changes(source, operator)}


def test_swap_operator_binary_and_augmented():
    src = "def f(a, b):\n    a += b  # keep this comment\n    return a * (b - 1)\n"
    assert added(src, "swap-operator") == {
        "a -= b  # keep this comment",
        "return a + (b - 1)",
        "return a * (b + 1)",
    }


def test_swap_comparison_every_kind():
    src = "def f(a, b):\n    return a == b, a < b, a in b, a is not b, a not in b\n"
    assert added(src, "swap-comparison") == {
        "return a != b, a < b, a in b, a is not b, a not in b",
        "return a == b, a > b, a in b, a is not b, a not in b",
        "return a == b, a < b, a not in b, a is not b, a not in b",
        "return a == b, a < b, a in b, a is b, a not in b",
        "return a == b, a < b, a in b, a is not b, a in b",
    }


def test_off_by_one_in_comparisons_ranges_slices_and_indexes():
    src = "def f(xs, n):\n    if n < 3:\n        return xs[1:n]\n    return [xs[-1] for i in range(n)]\n"
    got = added(src, "off-by-one")
    assert {"if n <= 3:", "if n < 4:", "if n < 2:"} <= got
    assert {"return xs[2:n]", "return xs[0:n]", "return xs[1:n + 1]", "return xs[1:n - 1]"} <= got
    assert {"return [xs[-2] for i in range(n)]", "return [xs[0] for i in range(n)]"} <= got
    assert {"return [xs[-1] for i in range(n + 1)]", "return [xs[-1] for i in range(n - 1)]"} <= got


def test_off_by_one_parenthesises_a_compound_bound():
    src = "def f(xs, n):\n    return xs[: n * 2]\n"
    assert added(src, "off-by-one") == {"return xs[: (n * 2) + 1]", "return xs[: (n * 2) - 1]"}


def test_swap_boolean_swaps_every_operator_of_the_expression():
    src = "def f(a, b, c):\n    return a and b and c\n"
    assert added(src, "swap-boolean") == {"return a or b or c"}


def test_negate_condition_adds_or_removes_not():
    src = (
        "def f(x, xs):\n    if x > 0:\n        return 1\n    elif not x:\n        return 2\n"
        "    return [y for y in xs if y] if xs else None\n"
    )
    assert added(src, "negate-condition") == {
        "if not (x > 0):",
        "elif x:",
        "return [y for y in xs if not y] if xs else None",
        "return [y for y in xs if y] if not xs else None",
    }


def test_drop_branch_removes_an_if_block_or_an_else_part():
    src = (
        "def f(x):\n    if x is None:\n        x = 0\n    if x > 0:\n        return 1\n"
        "    else:\n        return -1\n"
    )
    found = changes(src, "drop-branch")
    assert (("if x is None:", "x = 0"), ()) in found
    assert (("else:", "return -1"), ()) in found
    # the only statement of a block stays: removing it would leave the block empty
    assert not any("return 1" in removed for removed, _ in found)


def test_drop_branch_keeps_a_statement_that_shares_its_line():
    src = "def f(x):\n    y = 1; z = 2\n    if x: y = 3\n    return y\n"
    for removed, _ in changes(src, "drop-branch"):
        assert "y = 1; z = 2" not in removed


def test_wrong_default_changes_int_bool_and_string_defaults():
    src = 'def f(a, n=1, *, strict=True, sep=",", none=None):\n    return a\n'
    assert added(src, "wrong-default") == {
        'def f(a, n=2, *, strict=True, sep=",", none=None):',
        'def f(a, n=0, *, strict=True, sep=",", none=None):',
        'def f(a, n=1, *, strict=False, sep=",", none=None):',
        "def f(a, n=1, *, strict=True, sep='', none=None):",
    }


def test_swap_arguments_and_operands_parenthesise_what_they_move():
    src = "def f(a, b):\n    return g(a + 1, b), (a - 1) / b\n"
    assert added(src, "swap-arguments") == {"return g(b, (a + 1)), (a - 1) / b"}
    assert added(src, "swap-operands") == {
        "return g(a + 1, b), (b) / (a - 1)",
        "return g(a + 1, b), (1 - a) / b",
    }


def test_identical_operands_make_no_mutant():
    src = "def f(a):\n    return g(a, a), a - a\n"
    assert added(src, "swap-arguments") == set()
    assert added(src, "swap-operands") == set()


def test_flip_constant():
    src = "def f(x):\n    if x:\n        return True\n    return False\n"
    assert added(src, "flip-constant") == {"return False", "return True"}


def test_edits_keep_the_rest_of_the_file_byte_for_byte():
    src = (
        "# -*- coding: utf-8 -*-\n"
        "def f(s):\n"
        "    t = 'héllo wörld'  # ünïcode\n"
        "    return s + t\r\n"
        "\n"
        "\n"
        "X = 1\n"
    )
    (m,) = find_mutations(src, "mod.py", ("swap-operator",))
    assert m.source == src.replace("s + t", "s - t")
    assert m.lineno == 4


def test_functions_methods_and_nested_functions_are_attributed_to_themselves():
    src = (
        "import functools\n\n\nclass A:\n    @functools.cache\n    def m(self, a):\n"
        "        def inner(z):\n            return z + 1\n        return inner(a) - 1\n"
    )
    fns = {f.qualname: f.first_line for f in find_functions(ast.parse(src), "mod.py")}
    assert fns == {"A.m": 5, "A.m.<locals>.inner": 7}  # a decorated function starts at its decorator
    by_function = {(m.function, m.lineno) for m in find_mutations(src, "mod.py", ("swap-operator",))}
    assert by_function == {("A.m.<locals>.inner", 8), ("A.m", 9)}


def test_every_mutant_parses_and_differs():
    src = (
        "def f(xs, n=2, key=None):\n    out = []\n    for i, x in enumerate(xs[1:]):\n"
        "        if key is not None and key(x) >= n or i % 2:\n            out.append(x * n)\n"
        "        else:\n            out.insert(0, -x)\n    return out if len(out) > 1 else None\n"
    )
    mutants = find_mutations(src, "mod.py")
    assert {m.operator for m in mutants} == set(OPERATORS) - {"flip-constant"}
    assert len({m.source for m in mutants}) == len(mutants)
    for m in mutants:
        assert ast.dump(ast.parse(m.source)) != ast.dump(ast.parse(src))


def test_unknown_operator_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown mutation operators \\['typo'\\]; choose from"):
        find_mutations("def f():\n    return 1\n", "mod.py", ("typo",))
