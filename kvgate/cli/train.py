"""``kvgate train`` (and ``python train.py``): train Attention-Gates (and/or LoRA) with
Lightning's CLI.

    kvgate train --config configs/cpt_demo.yaml
    kvgate train --config cpt_demo --trainer.max_steps 20 --model.gate.beta 0.3
    kvgate train --config cpt_demo --ckpt_path last      # resume a killed run
    kvgate train --config cpt_demo --print_config        # the full resolved config
    kvgate train --config cpt_demo --seed_everything 1 --run_dir runs/cpt_demo_seed1

``--run_dir DIR`` moves every output of a run under DIR (root, logger, checkpoints, export),
so a variant that differs in one value needs no config file of its own. It is applied after
parsing: ``--print_config`` shows the folders before it.

``--config NAME`` also finds ``configs/NAME.yaml`` (of the repository, else of the working
folder). Every key is typed: a missing or malformed config file, an unknown key or a bad value
stops the run before any model is loaded with one line ``error: ...`` naming the file or key,
exit 2 (no usage dump; ``--help`` has it). So does a run that would train no step
(``max_steps``, ``max_epochs`` or ``limit_train_batches`` 0: its export would be the untrained
gates). A ``KVGateError`` prints its first line and exits 2 (``--debug``: its traceback).
A config saved before a setting was removed still loads while it asks for nothing the setting
did (``warmstart_steps: 0``); asking for it (``warmstart_steps: 30``, ``kernel: flex``) is one
line naming what replaced it (``kvgate.cli.retired``).

The run folder (``--run_dir``, else ``trainer.default_root_dir``) is locked for the run
(``RUN_DIR/.kvgate-run.lock``, ``kvgate.training.runlock``): a second run into it is refused;
a lock left by a killed run is taken over with a warning line.

``--ckpt_path last`` resumes from the newest valid checkpoint in the run's checkpoint folder
(highest global step recorded inside, then newest file; ``last.ckpt`` need not exist, as after
a kill between a step checkpoint and ``last.ckpt``) and says which; with no checkpoint yet it
starts from step 0 and says so (so a restart script can always pass it); when every checkpoint
there is damaged it refuses. A damaged one it skips is renamed ``NAME.damaged`` (one warning
line), so the run's own ``last.ckpt`` takes its place rather than ``last-v1.ckpt`` beside it. Any resume checkpoint is checked against its sha256 sidecar and
read before the trainer creates a folder (``kvgate.training.integrity``), and must have been
written with this run's gate and LoRA shapes (``model.train``, ``model.gate.heads``,
``model.lora.rank``, ...: one line naming the field otherwise). A run without ``--ckpt_path``
into a folder that already holds checkpoints is refused, naming both ways on (``--ckpt_path
last``, or a new ``--run_dir``); ``--overwrite`` deletes them and starts at step 0 (with
``--ckpt_path``, which resumes, it is a contradiction: refused in one line). Lightning
refusing its set-up (too few batches for ``val_check_interval``) is one line too; a run refused
before its first step leaves no folder of its own.

Progress is one display on stderr (``kvgate.training.steps``): optimiser steps done of the run's,
time left and the logged loss, a bar on a terminal and a line a step (at most one every few
seconds) elsewhere, in place of Lightning's bar; ``--quiet`` shows none (a config's
``trainer.enable_progress_bar: false`` neither).

SIGTERM or SIGINT (Ctrl-C) stops the run at the end of the current step, writes
``CHECKPOINTS/stopped.ckpt``, prints ``stopped at step N; resume with --ckpt_path last`` and
exits 143 / 130 (``kvgate.training.stop``); a second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import sys
import warnings
from itertools import pairwise
from pathlib import Path

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from kvgate.cli.common import find_cause, first_line
from kvgate.cli.retired import retire_settings
from kvgate.errors import KVGateError
from kvgate.files import check_output_dir
from kvgate.progress import silenced
from kvgate.training import KVGateDataModule, KVGateModule, TrainingConfigError
from kvgate.training.errors import launch_rank, note
from kvgate.training.integrity import resume_path
from kvgate.training.runlock import RunLock
from kvgate.training.start import check_fresh_start, check_resume_fits, remove_earlier_checkpoints
from kvgate.training.steps import use_step_progress
from kvgate.training.stop import GracefulStop, SIGTERMException
from kvgate.training.strategies import CPUDeepSpeedStrategy

# importing the strategies module registers "deepspeed_cpu" with Lightning
__all__ = ["CPUDeepSpeedStrategy", "KVGateCLI", "KVGateDataModule", "KVGateModule", "main",
           "resolve_config_args"]

# the repository's configs/ (an editable install), then the working folder's
CONFIG_DIRS = (Path(__file__).resolve().parents[2] / "configs", Path("configs"))


def resolve_config_args(argv: list[str]) -> list[str]:
    """Rewrite ``--config NAME`` to ``configs/NAME.yaml`` when NAME is not an existing file."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _config_path(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + _config_path(arg.split("=", 1)[1])
    return out


def _config_path(name: str) -> str:
    if Path(name).is_file():
        return name
    for folder in CONFIG_DIRS:
        for candidate in (folder / name, folder / f"{name}.yaml"):
            if candidate.is_file():
                return str(candidate)
    return name  # check_config_files reports the missing file


class ConfigFileError(KVGateError, ValueError):
    """A ``--config`` file is missing, a folder, unreadable or not YAML; or the parser refused
    a key or value (its message made one line)."""


def check_config_files(argv: list[str]) -> None:
    """Each ``--config`` value (after ``resolve_config_args``) must be a readable YAML file, or
    an inline YAML mapping (jsonargparse takes those too)."""
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            _check_config_file(argv[i + 1])
        elif arg.startswith("--config="):
            _check_config_file(arg.split("=", 1)[1])


def _check_config_file(value: str) -> None:
    path = Path(value)
    if path.is_dir():
        raise ConfigFileError(f"--config {value}: is a folder, not a config file")
    if not path.is_file():
        try:
            inline = yaml.safe_load(value)
        except yaml.YAMLError:
            inline = None
        if isinstance(inline, dict):
            return
        raise ConfigFileError(f"--config {value}: no such file (nor {value}.yaml in "
                              f"{' or '.join(str(d) for d in CONFIG_DIRS)})")
    try:
        yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or first_line(err)
        raise ConfigFileError(f"--config {value}: not valid YAML ({where}{problem})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigFileError(f"--config {value}: unreadable ({err})") from None


# lines of jsonargparse's messages that say how it searched, not what is wrong
_PARSER_NOISE = ("Does not validate against any of the", "Subtypes:", "Errors:",
                 "Given value type:", "Given value:", "Expected a <class 'NoneType'>")


def parser_error_line(message: str) -> str:
    """jsonargparse's (often multi-line) error as one line that keeps the key and the cause."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "the command line or a config file could not be parsed"
    details: list[str] = []
    for line in lines[1:]:
        line = line.removeprefix("- ").strip()
        if not line.startswith(_PARSER_NOISE) and line not in details:
            details.append(line)
    text = " ".join([lines[0], *details])
    return text if len(text) <= 400 else text[:397] + "..."


class KVGateCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="resume from this Lightning checkpoint ('last' = the newest "
                                 "valid checkpoint of the run)")
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="every output of the run under this folder: default_root_dir, "
                                 "the logger's save_dir, DIR/checkpoints, DIR/gated")

    def before_instantiate_classes(self) -> None:
        check_strategy(self.config.get("trainer", {}).get("strategy"))
        check_steps(self.config.get("trainer", {}))
        if self.config.get("run_dir"):
            check_output_dir(self.config.run_dir, "--run_dir")  # a file: one line, not 22
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


class RunDirError(KVGateError, ValueError):
    """--run_dir cannot place an output of the configured run."""


class StrategyUnavailable(KVGateError, RuntimeError):
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


def check_steps(trainer) -> None:
    """A run of no optimiser step would only export the initial gates as if trained."""
    for key in ("max_steps", "max_epochs", "limit_train_batches"):
        value = trainer.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise TrainingConfigError(
                f"trainer.{key}: 0 trains no step, and the run would export the untrained "
                "gates; give a positive value (max_steps: -1 means no step limit)")


# a gate setting's refusal (GateConfig checks itself, its kind too) also names the run
# config's key, as jsonargparse's own refusals do
_GATE_KEY = re.compile(r"^GateConfig\.(\w+): ")

# words of a Trainer error about the machine rather than about a value
_HARDWARE_WORDS = re.compile(r"accelerator|device|strateg|gpu|cuda|mps|tpu|hpu|xla|node|"
                             r"available|your (machine|system)", re.IGNORECASE)


def _build_cli(argv: list[str], prog: str) -> KVGateCLI:
    """Parse and instantiate (no model is loaded yet); a parser error becomes one line."""
    try:
        return KVGateCLI(KVGateModule, KVGateDataModule, subclass_mode_data=True, run=False,
                         args=argv, save_config_kwargs={"overwrite": True},
                         parser_kwargs={"prog": prog, "exit_on_error": False})
    except argparse.ArgumentError as err:
        cause = find_cause(err.__cause__ or err.__context__)
        if cause is not None:
            raise cause from err
        raise ConfigFileError(parser_error_line(str(err))) from err
    except MisconfigurationException as err:
        # the Trainer refusing its settings: a value it rejects (max_steps -3) or hardware it
        # cannot use here (--trainer.accelerator gpu on a CPU-only torch); only the latter
        # gets the hint, which would mislead on a plain bad value
        line = first_line(err)
        hint = (" (check --trainer.accelerator / --trainer.devices / --trainer.strategy on "
                "this machine)" if _HARDWARE_WORDS.search(line) else "")
        raise TrainingConfigError(f"trainer: {line}{hint}") from err


def _run_lock(cli: KVGateCLI):
    """The lock of the run folder (the trainer's configured default_root_dir, which --run_dir
    sets); none for rank > 0 of a launched job, whose rank 0 holds it, or without a folder."""
    root = cli.config.get("trainer", {}).get("default_root_dir")
    if root is None or launch_rank() != 0:
        return contextlib.nullcontext()
    return RunLock(root)


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    """``kvgate train ...`` / ``python train.py ...``: 0 after training, 2 on a user error,
    128 + the signal's number after a SIGTERM / SIGINT stop (a checkpoint written first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv_given = list(argv)
    # ours, not config keys: taken out before LightningCLI parses
    debug, overwrite, quiet = "--debug" in argv, "--overwrite" in argv, "--quiet" in argv
    argv = resolve_config_args([a for a in argv if a not in ("--debug", "--overwrite",
                                                             "--quiet")])
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    cli = None
    created = None
    stop = GracefulStop()
    try:
        check_config_files(argv)
        argv = retire_settings(argv)  # a saved config's warmstart_steps: 0 loads; 30 is refused
        cli = _build_cli(argv, prog)
        created = _created_root(Path(cli.trainer.log_dir))
        check_overwrite(overwrite, cli.config.get("ckpt_path"))
        with _run_lock(cli):
            # checked (and "last" resolved) before fit creates the logger's folders
            ckpt_path = resume_path(cli.trainer, cli.config.get("ckpt_path"),
                                    fits=lambda path: check_resume_fits(path, cli.model))
            earlier = []
            if cli.config.get("ckpt_path") is None:
                earlier = check_fresh_start(cli.trainer, overwrite)
            remove_earlier_checkpoints(earlier)  # every check passed: --overwrite acts now
            cli.trainer.callbacks.append(stop)
            use_step_progress(cli.trainer, quiet)
            stop.install(cli.trainer)
            try:
                with silenced(quiet):  # a first load's GGUF conversion too
                    _fit(cli, ckpt_path)
            finally:
                stop.uninstall()
    except SIGTERMException:  # a SystemExit of status 0: a stop must not read as success
        if stop.saved is None:  # Lightning's own SIGTERM handling (not the main thread)
            note(f"stopped by SIGTERM at step {cli.trainer.global_step if cli else 0}")
            return stop.exit_code
        note(f"stopped at step {stop.step}; resume with --ckpt_path last "
             f"(checkpoint {stop.saved})")
        return stop.exit_code
    except Exception as err:  # only our own errors are shortened; others re-raise
        cause = find_cause(err)
        if cause is None or debug:
            raise
        # a run refused before its first step leaves no log folder of its own behind
        if created is not None and cli is not None and cli.trainer.global_step == 0:
            shutil.rmtree(created, ignore_errors=True)
        line = first_line(cause)
        if (key := _GATE_KEY.match(line)) is not None:
            line += f" (--model.gate.{key[1]})"
        given = [b for a, b in pairwise(argv_given) if a == "--config"]
        if given:  # a label refusal's advice names the config this run was given
            line = line.replace("--config CONFIG", f"--config {given[-1]}")
        print(f"error: {line}", file=sys.stderr)
        return 2
    return 0


def check_overwrite(overwrite: bool, ckpt_path: str | None) -> None:
    """``--overwrite`` starts afresh and ``--ckpt_path`` continues: given both, either would
    silently lose what the user asked for with the other."""
    if overwrite and ckpt_path is not None:
        raise TrainingConfigError(
            f"--overwrite (delete the run's checkpoints, start at step 0) contradicts "
            f"--ckpt_path {ckpt_path} (resume): pass one of them")


def _fit(cli: KVGateCLI, ckpt_path: str | None) -> None:
    """``trainer.fit``; Lightning refusing its own set-up (too few batches for
    ``val_check_interval``, ...) is a setting the user can change: one line."""
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    except (MisconfigurationException, ValueError) as err:
        if cli.trainer.global_step > 0 or not _raised_by_lightning(err):
            raise  # a failure while training, or not Lightning's own check: keep the trace
        raise TrainingConfigError(f"trainer: {first_line(err)}") from err


def _raised_by_lightning(err: BaseException) -> bool:
    """Whether ``err`` was raised by Lightning's own code (its checks of the trainer's
    settings against the data), not by torch or kvgate below it."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    lightning = f"{os.sep}lightning{os.sep}pytorch{os.sep}"
    return tb is not None and lightning in tb.tb_frame.f_code.co_filename


def _created_root(log_dir: Path) -> Path | None:
    """The outermost folder on the way to ``log_dir`` that does not exist yet (everything in
    it will be this run's), or None when ``log_dir`` exists already."""
    path = log_dir.resolve()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path
