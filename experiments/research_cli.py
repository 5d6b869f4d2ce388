"""``kvgate`` with the research policies of ``experiments/policies`` registered (``gate_hybrid``):
the command experiments/run_results.sh runs, and the one that reproduces a table of
docs/RESULTS.md naming one of them. Everything else is kvgate's own command line.

    python experiments/research_cli.py eval ppl --checkpoint runs/cpt_long/gated \\
        --policies ranked=gate_hybrid --policy-opt ranked.rank=true --out out/ranked
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from experiments.policies import register
from kvgate.cli import main

if __name__ == "__main__":
    register()
    sys.exit(main())
