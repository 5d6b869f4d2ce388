"""``python -m kvgate.data [--no-tokens]``: ``kvgate data`` (build the CPT corpus once, print
its mix and token counts)."""

import sys

from kvgate.cli import main

sys.exit(main(["data", *sys.argv[1:]]))
