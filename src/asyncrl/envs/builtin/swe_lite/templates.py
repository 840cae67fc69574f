"""Bug templates for `swe-lite`: a tiny module with one planted bug, its fix, and unit tests.

Each template renders (buggy source, fixed source, test source, test names) from a function name.
With the bug, at least one test fails and at least one passes; with the fix, all pass.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TEMPLATES", "BugTemplate", "RenderedRepo"]


@dataclass(frozen=True, kw_only=True)
class RenderedRepo:
    module: str  # module name, e.g. "geometry"
    buggy: str
    fixed: str
    tests: str
    test_names: tuple[str, ...]
    kind: str  # the kind of bug, for metrics


@dataclass(frozen=True, kw_only=True)
class BugTemplate:
    kind: str
    names: tuple[str, ...]  # function name variants
    modules: tuple[str, ...]
    body_buggy: str  # "{fn}" is replaced by the function name
    body_fixed: str
    cases: tuple[tuple[str, str], ...]  # (call arguments, expected value) as source text

    def render(self, fn: str, module: str) -> RenderedRepo:
        tests, names = [f"from {module} import {fn}\n"], []
        for i, (call_args, expected) in enumerate(self.cases):
            name = f"test_{fn}_{i}"
            names.append(name)
            head, tail = repr(f"{fn}({call_args}) returned "), repr(f", expected {expected}")
            tests.append(
                f"\n\ndef {name}():\n    got = {fn}({call_args})\n"
                f"    assert got == {expected}, {head} + repr(got) + {tail}\n"
            )
        return RenderedRepo(
            module=module,
            buggy=self.body_buggy.format(fn=fn),
            fixed=self.body_fixed.format(fn=fn),
            tests="".join(tests),
            test_names=tuple(names),
            kind=self.kind,
        )


TEMPLATES: tuple[BugTemplate, ...] = (
    BugTemplate(
        kind="off-by-one",
        names=("count_up", "one_to_n", "first_n"),
        modules=("sequences", "numseq", "series"),
        body_buggy=(
            'def {fn}(n):\n    """Return the list [1, 2, ..., n]."""\n    return list(range(1, n))\n'
        ),
        body_fixed=(
            'def {fn}(n):\n    """Return the list [1, 2, ..., n]."""\n    return list(range(1, n + 1))\n'
        ),
        cases=(("3", "[1, 2, 3]"), ("1", "[1]"), ("0", "[]"), ("5", "[1, 2, 3, 4, 5]")),
    ),
    BugTemplate(
        kind="wrong-operator",
        names=("rect_area", "area", "surface"),
        modules=("geometry", "shapes", "measure"),
        body_buggy=(
            "def {fn}(width, height):\n"
            '    """Area of a width x height rectangle."""\n'
            "    return width + height\n"
        ),
        body_fixed=(
            "def {fn}(width, height):\n"
            '    """Area of a width x height rectangle."""\n'
            "    return width * height\n"
        ),
        cases=(("2, 2", "4"), ("3, 4", "12"), ("1, 5", "5"), ("0, 7", "0")),
    ),
    BugTemplate(
        kind="missing-case",
        names=("sign", "signum", "direction"),
        modules=("mathx", "signs", "numeric"),
        body_buggy=(
            "def {fn}(x):\n"
            '    """-1, 0 or 1 for negative, zero or positive x."""\n'
            "    if x > 0:\n"
            "        return 1\n"
            "    return -1\n"
        ),
        body_fixed=(
            "def {fn}(x):\n"
            '    """-1, 0 or 1 for negative, zero or positive x."""\n'
            "    if x > 0:\n"
            "        return 1\n"
            "    if x == 0:\n"
            "        return 0\n"
            "    return -1\n"
        ),
        cases=(("5", "1"), ("-3", "-1"), ("0", "0")),
    ),
    BugTemplate(
        kind="wrong-comparison",
        names=("clamp", "bound", "limit"),
        modules=("ranges", "bounds", "limits"),
        body_buggy=(
            "def {fn}(x, lo, hi):\n"
            '    """x limited to the interval [lo, hi]."""\n'
            "    return min(lo, max(x, hi))\n"
        ),
        body_fixed=(
            "def {fn}(x, lo, hi):\n"
            '    """x limited to the interval [lo, hi]."""\n'
            "    return max(lo, min(x, hi))\n"
        ),
        cases=(("5, 0, 10", "5"), ("-2, 0, 10", "0"), ("12, 0, 10", "10"), ("0, 0, 0", "0")),
    ),
    BugTemplate(
        kind="missing-normalisation",
        names=("is_palindrome", "reads_same", "mirror_word"),
        modules=("text", "words", "strings"),
        body_buggy=(
            "def {fn}(s):\n"
            '    """True if s reads the same backwards, ignoring case."""\n'
            "    return s == s[::-1]\n"
        ),
        body_fixed=(
            "def {fn}(s):\n"
            '    """True if s reads the same backwards, ignoring case."""\n'
            "    s = s.lower()\n"
            "    return s == s[::-1]\n"
        ),
        cases=(("'abba'", "True"), ("'Abba'", "True"), ("'abc'", "False"), ("'RaceCar'", "True")),
    ),
)
