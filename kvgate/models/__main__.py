"""``python -m kvgate.models --prepare smollm2-135m``: ``kvgate prepare smollm2-135m`` under its
old spelling (:func:`kvgate.cli.tools.main_prepare`)."""

import sys

from kvgate.cli.tools import main_prepare

sys.exit(main_prepare())
