"""``python -m kvgate.data``: build the CPT corpus (once) and print its mix and token counts
(the same as ``kvgate data``)."""

from kvgate.data.corpus import main

raise SystemExit(main())
