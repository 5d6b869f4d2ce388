"""``python -m kvgate.eval ...``: ``kvgate eval ...`` (its flags and runner are in
:mod:`kvgate.cli.evaluate`)."""

import sys

from kvgate.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
