"""`python -m toolkit --help`: the run modes, one line each (toolkit.modes); runs go through run.py."""

import shlex
import sys

from toolkit.modes import usage

if __name__ == "__main__":
    args = sys.argv[1:]
    if set(args) <= {"-h", "--help"}:
        print(usage())
        sys.exit(0)
    print(
        f"error: python -m toolkit only lists the modes; a run goes through run.py: python run.py {shlex.join(args)}",
        file=sys.stderr,
    )
    sys.exit(2)
