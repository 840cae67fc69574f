"""Test runner executed inside the swe-lite sandbox (stdlib only; not imported by asyncrl).

Reads a nonce from stdin, imports every `test_*.py` in the working directory, calls each `test_*`
function in definition order, and prints `<nonce> PASS name` or `<nonce> FAIL name: error`. The
nonce keeps code under test from faking results by printing lines of its own.
"""

import glob
import importlib
import sys


def main() -> None:
    nonce = sys.stdin.readline().strip()
    for path in sorted(glob.glob("test_*.py")):
        try:
            module = importlib.import_module(path[:-3])
        except BaseException as e:  # report any import failure as a result, then continue
            print(f"{nonce} ERROR {path}: {type(e).__name__}: {e}", flush=True)
            continue
        for name, fn in list(vars(module).items()):
            if not (name.startswith("test_") and callable(fn)):
                continue
            try:
                fn()
            except BaseException as e:  # a failing test is a result, not a crash of the runner
                print(f"{nonce} FAIL {name}: {type(e).__name__}: {e}", flush=True)
            else:
                print(f"{nonce} PASS {name}", flush=True)


main()
