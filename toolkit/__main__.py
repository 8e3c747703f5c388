"""`python -m toolkit --help`: the run modes, one line each (toolkit.modes); runs go through run.py."""

import sys

from toolkit.modes import usage

if __name__ == "__main__":
    print(usage())
    sys.exit(0 if set(sys.argv[1:]) <= {"-h", "--help"} else 2)
