"""Generate with a KV-cache eviction policy and print what the cache held.

    python infer.py --model smollm2-135m --policy snapkv --budget 0.5 --prompt "Hello"
    python infer.py --checkpoint runs/cpt_demo/gated --policy attention_gate --prompt "..."

The same as ``kvgate infer ...`` (``kvgate/cli/infer.py``; ``python infer.py --help`` lists
the options). Errors in the arguments, the policy, the budget or the checkpoint print one
line and exit 2.
"""

from __future__ import annotations

import sys

from kvgate.cli.infer import build_parser, main, run

__all__ = ["build_parser", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
