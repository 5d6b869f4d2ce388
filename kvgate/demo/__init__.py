"""The main job's demonstration: one long document compressed once by several policies, the
same questions asked after compression, one table of what each kept and answered.

- :mod:`.document`: the default document (Wikipedia passages the training corpus never holds,
  with three facts placed at different depths) and its questions;
- :mod:`.run`: compress once per policy (the learned gate first, the heuristics at its kept
  share), answer, check each answer against its fact, and the table.

``kvgate demo`` is the command (``kvgate.cli.demo``); ``run_demo`` the Python entry point.
"""

from kvgate.demo.document import FACTS, Fact, demo_document
from kvgate.demo.run import DemoRow, demo_table, holds_fact, run_demo

__all__ = ["FACTS", "DemoRow", "Fact", "demo_document", "demo_table", "holds_fact", "run_demo"]
