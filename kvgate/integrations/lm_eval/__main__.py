"""``python -m kvgate.integrations.lm_eval <lm-eval's own arguments>``: lm-eval's command line
with the ``kvgate`` model registered (:mod:`kvgate.cli.lm_eval`)."""

import sys

from kvgate.cli.lm_eval import TASK_NAMES, main, prepare

__all__ = ["TASK_NAMES", "main", "prepare"]

if __name__ == "__main__":
    sys.exit(main())
