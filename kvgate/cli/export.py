"""``kvgate export CKPT OUT [--merge] [--overwrite] [--format kvzap]``: a trained run to the
gated-checkpoint format, or to KVzap's.

CKPT is a Lightning checkpoint written by ``kvgate train`` (gates + LoRA + optimiser state, no
base weights), or a DeepSpeed checkpoint folder (consolidated first; needs deepspeed); the
base is loaded again from the id recorded in it. OUT receives the folder described in
``kvgate.checkpoint``. ``--merge`` folds LoRA into the base weights and stores the merged base
in OUT/merged (large: a full copy of the model). ``--overwrite`` replaces only what an export
wrote (or an empty folder): a typo such as ``kvgate export RUN/checkpoints/last.ckpt RUN
--overwrite`` is refused in one line, and the run is left as it was.

``--format kvzap`` writes a ``linear`` / ``mlp`` gate as NVIDIA's KVzap checkpoint (config.json
+ model.safetensors, as kvpress's ``KVzapModel.from_pretrained`` reads it), with the threshold
that reproduces the gate's own eviction recorded beside KVzap's fields; CKPT may then also be a
gated export folder. An attention gate, or gates trained beside LoRA, are refused in one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvgate.cli.common import run_cli


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="Lightning checkpoint (.ckpt) written by kvgate train")
    p.add_argument("out", help="output folder of the gated checkpoint")
    p.add_argument("--merge", action="store_true", help="merge LoRA into the base weights")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT when it holds a gated export or is an empty folder (a "
                        "file, a run folder or the folder of CKPT is refused)")
    p.add_argument("--format", choices=("kvgate", "kvzap"), default="kvgate",
                   help="kvgate: the gated-checkpoint folder (default); kvzap: NVIDIA's KVzap "
                        "format, for linear / mlp gates (CKPT may be a gated export too)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="export a training checkpoint as a gated checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from kvgate.checkpoint import CheckpointError
    from kvgate.training.export import export_checkpoint, export_kvzap_checkpoint

    if args.format == "kvzap":
        if args.merge:
            raise CheckpointError("--merge folds LoRA into the base; a KVzap checkpoint holds the gates "
                           "alone: leave one of --merge and --format kvzap out")
        out = export_kvzap_checkpoint(args.ckpt, args.out, overwrite=args.overwrite)
        print(f"exported {args.ckpt} -> {out} (KVzap format)")
        return 0
    out = export_checkpoint(args.ckpt, args.out, merge=args.merge, overwrite=args.overwrite)
    print(f"exported {args.ckpt} -> {out}")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "kvgate export") -> int:
    """``kvgate export ...`` on its own (for scripts and tests)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(run, p.parse_args(None if argv is None else list(argv)))
