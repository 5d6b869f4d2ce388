"""Train Attention-Gates (and/or LoRA) with Lightning's CLI.

    python train.py --config configs/cpt_demo.yaml
    python train.py --config cpt_demo --trainer.max_steps 20 --model.gate.beta 0.3
    python train.py --config cpt_demo --ckpt_path last      # resume a killed run
    python train.py --config cpt_demo --print_config        # the full resolved config
    python train.py --config cpt_demo --seed_everything 1 --run_dir runs/cpt_demo_seed1

``--run_dir DIR`` moves every output of a run under DIR (root, logger, checkpoints, export),
so a variant that differs in one value needs no config file of its own. It is applied after
parsing: ``--print_config`` shows the folders before it.

``--config NAME`` also finds ``configs/NAME.yaml``. Every key is typed: an unknown key or a
bad value stops the run before any model is loaded, with a message naming the key.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import warnings
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from kvgate.training.data import KVGateDataModule
from kvgate.training.module import KVGateModule
from kvgate.training.strategies import CPUDeepSpeedStrategy

# importing the strategies module registers "deepspeed_cpu" with Lightning
__all__ = ["CPUDeepSpeedStrategy", "KVGateCLI", "main"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def resolve_config_args(argv: list[str]) -> list[str]:
    """Rewrite ``--config NAME`` to ``configs/NAME.yaml`` when NAME is not an existing file."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = _config_path(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + _config_path(arg.split("=", 1)[1])
    return out


def _config_path(name: str) -> str:
    if Path(name).is_file():
        return name
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return str(candidate)
    return name  # let the parser report the missing file


class KVGateCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="resume from this Lightning checkpoint ('last' = newest last.ckpt)")
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="every output of the run under this folder: default_root_dir, "
                                 "the logger's save_dir, DIR/checkpoints, DIR/gated")

    def before_instantiate_classes(self) -> None:
        check_strategy(self.config.get("trainer", {}).get("strategy"))
        if self.config.get("run_dir"):
            move_outputs(self.config.trainer, self.config.run_dir)


# where each output-writing class keeps its folder, and the folder it gets under --run_dir
_OUTPUT_DIRS = {
    "ModelCheckpoint": ("dirpath", "checkpoints"),
    "OnExceptionCheckpoint": ("dirpath", "checkpoints"),
    "ExportGated": ("dirpath", "gated"),
}


def move_outputs(trainer, run_dir: str) -> None:
    """Point every folder a run writes to under ``run_dir`` (in the parsed config, before
    anything is built). Loggers keep their ``name``/``version`` below it; a callback that
    writes elsewhere and is not known here is refused rather than left in the old folder."""
    root = Path(run_dir)
    trainer.default_root_dir = str(root)
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if getattr(logger, "init_args", None) is not None and "save_dir" in logger.init_args:
            logger.init_args.save_dir = str(root)
    for callback in trainer.get("callbacks") or []:
        init = getattr(callback, "init_args", None)
        short = str(getattr(callback, "class_path", "")).rsplit(".", 1)[-1]
        if short in _OUTPUT_DIRS and init is not None:
            key, sub = _OUTPUT_DIRS[short]
            setattr(init, key, str(root / sub))
        elif init is not None and any(k in init for k in ("dirpath", "save_dir", "log_dir")):
            raise RunDirError(f"--run_dir: trainer.callbacks has {short}, which writes to a "
                              "folder --run_dir does not know how to move; set its folder "
                              "in the config instead")


class RunDirError(ValueError):
    """--run_dir cannot place an output of the configured run."""


class StrategyUnavailable(RuntimeError):
    """The configured distributed strategy needs a package that is not installed."""


def _strategy_name(strategy) -> str:
    if isinstance(strategy, str):
        return strategy
    class_path = getattr(strategy, "class_path", None)
    if class_path is None and isinstance(strategy, dict):
        class_path = strategy.get("class_path")
    return str(class_path or "")


def check_strategy(strategy) -> None:
    """DeepSpeed is an optional extra: name the fix instead of failing inside Lightning."""
    name = _strategy_name(strategy)
    if "deepspeed" in name.lower() and importlib.util.find_spec("deepspeed") is None:
        raise StrategyUnavailable(
            f"trainer.strategy={name!r} needs DeepSpeed: pip install 'kvgate[deepspeed]' "
            "(Lightning runs DeepSpeed on CUDA GPUs only)")


def main(argv: list[str] | None = None) -> int:
    argv = resolve_config_args(sys.argv[1:] if argv is None else argv)
    from kvgate.checkpoint import CheckpointError
    from kvgate.data.errors import DataError
    from kvgate.gate import ConfigError
    from kvgate.models.errors import ModelLoadError
    from kvgate.training.errors import TrainingConfigError

    clear = (ConfigError, TrainingConfigError, ModelLoadError, DataError, CheckpointError,
             StrategyUnavailable, RunDirError)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    cli = None
    created = None
    try:
        cli = KVGateCLI(KVGateModule, KVGateDataModule, subclass_mode_data=True, run=False,
                        args=argv, save_config_kwargs={"overwrite": True})
        created = _created_root(Path(cli.trainer.log_dir))
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))
    except Exception as err:  # only our own errors are shortened; others re-raise
        cause = _find_cause(err, clear)
        if cause is None:
            raise
        # a run refused before its first step leaves no log folder of its own behind
        if created is not None and cli.trainer.global_step == 0:
            shutil.rmtree(created, ignore_errors=True)
        print(f"error: {cause}", file=sys.stderr)
        return 2
    return 0


def _created_root(log_dir: Path) -> Path | None:
    """The outermost folder on the way to ``log_dir`` that does not exist yet (everything in
    it will be this run's), or None when ``log_dir`` exists already."""
    path = log_dir.resolve()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _find_cause(err: BaseException, types: tuple[type, ...]) -> BaseException | None:
    """Our own error in ``err``'s chain (jsonargparse wraps a constructor's error)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, types):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
