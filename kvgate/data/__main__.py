"""``python -m kvgate.data``: build the CPT corpus (once) and print its mix and token counts."""

from kvgate.data.corpus import main

raise SystemExit(main())
