"""``python -m kvgate ...``: the ``kvgate`` command (``kvgate.cli``) without the installed script."""

import sys

from kvgate.cli import main

sys.exit(main())
