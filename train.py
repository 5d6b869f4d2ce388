"""Train Attention-Gates (and/or LoRA) with Lightning's CLI: the same as ``kvgate train``.

    python train.py --config configs/cpt_demo.yaml
    python train.py --config cpt_demo --trainer.max_steps 20 --model.gate.beta 0.3
    python train.py --config cpt_demo --ckpt_path last      # resume a killed run
    python train.py --config cpt_demo --print_config        # the full resolved config
    python train.py --config cpt_demo --seed_everything 1 --run_dir runs/cpt_demo_seed1

``--run_dir DIR`` moves every output of a run under DIR; ``--config NAME`` also finds
``configs/NAME.yaml``. The code is ``kvgate/cli/train.py`` (its docstring has the details).
"""

from __future__ import annotations

import importlib.util  # noqa: F401  (tests patch importlib.util.find_spec through this module)
import sys

from kvgate.cli.train import (
    CPUDeepSpeedStrategy,
    KVGateCLI,
    KVGateDataModule,
    KVGateModule,
    main,
    resolve_config_args,
)

__all__ = ["CPUDeepSpeedStrategy", "KVGateCLI", "KVGateDataModule", "KVGateModule", "main",
           "resolve_config_args"]

if __name__ == "__main__":
    sys.exit(main())
