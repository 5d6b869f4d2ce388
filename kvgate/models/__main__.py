"""``python -m kvgate.models --prepare smollm2-135m``: the one-time conversion of embedded models."""

import sys

from kvgate.models.load import main

sys.exit(main())
