"""``python -m kvgate.models --prepare smollm2-135m``: the one-time conversion of embedded models
(the same conversion as ``kvgate prepare smollm2-135m``: ``kvgate.models.prepare_embedded``)."""

import sys

from kvgate.models.load import main

sys.exit(main())
