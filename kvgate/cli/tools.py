"""``kvgate prepare`` (the one-time conversion of embedded GGUF models), ``kvgate data``
(build the CPT corpus once and print its mix) and ``kvgate data oracle`` (a config's KVzip
labels)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

DEFAULT_MODEL = "smollm2-135m"


def add_prepare_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "prepare", help="convert an embedded GGUF model once (a plain safetensors folder)",
        description="Convert embedded GGUF models once into $KVGATE_CACHE/models/ALIAS "
                    "(~1 minute; later loads take about a second). The same as "
                    "python -m kvgate.models --prepare ALIAS.")
    p.add_argument("aliases", nargs="*", metavar="ALIAS", default=[DEFAULT_MODEL],
                   help=f"embedded model alias (default {DEFAULT_MODEL})")
    p.add_argument("--quiet", action="store_true",
                   help="no progress of a conversion on stderr (a bar on a terminal, else "
                        "plain lines)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run_prepare)
    return p


def run_prepare(args: argparse.Namespace) -> int:
    from kvgate.models import prepare_embedded
    from kvgate.progress import silenced

    with silenced(getattr(args, "quiet", False)):
        for alias in args.aliases:
            print(f"{alias}: {prepare_embedded(alias)}")
    return 0


def add_data_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("data", help="build the CPT corpus (once) and print its mix and tokens",
                       description="Build the continual-pre-training corpus (once; cached in "
                                   "$KVGATE_CACHE/data) and print its mix and token counts. "
                                   "The same as python -m kvgate.data.")
    p.add_argument("--no-tokens", action="store_true", help="skip the token count")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run_data)
    sub_data = p.add_subparsers(dest="data_command", metavar="{oracle}")
    o = sub_data.add_parser(
        "oracle", help="the base's KVzip scores of a training config's blocks (oracle labels)",
        description="Compute the frozen base's KVzip (or KVzip+) scores of every training block "
                    "of a config, per layer, KV head and token, into data.init_args.oracle.path "
                    "(with the base's fingerprint); the oracle objective "
                    "(model.recipe.oracle_weight) trains on them. Run it again after a kill: it "
                    "continues.")
    o.add_argument("--config", required=True, metavar="NAME",
                   help="the training config (a file, or NAME for configs/NAME.yaml)")
    o.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K (default cpu)")
    o.add_argument("--devices", type=int, default=1, metavar="N",
                   help="processes per node, each labelling its share of the blocks (DDP; on "
                        "the CPU through gloo); default 1")
    o.add_argument("--num-nodes", type=int, default=1, metavar="N",
                   help="nodes of a multi-node run (Lightning's DDP environment); default 1")
    o.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else a line a shard, "
                        "at most one every few seconds)")
    o.add_argument("--debug", action="store_true", help="show tracebacks")
    o.set_defaults(run=run_oracle)
    return p


def run_oracle(args: argparse.Namespace) -> int:
    from kvgate.cli.oracle import run

    return run(args.config, device=args.device, devices=args.devices,
               num_nodes=args.num_nodes, quiet=args.quiet)


def run_data(args: argparse.Namespace) -> int:
    from kvgate.data.corpus import print_mix

    return print_mix(count_tokens=not args.no_tokens)


def main_prepare(argv: Sequence[str] | None = None) -> int:
    """``python -m kvgate.models --prepare ALIAS [--prepare ALIAS ...]``: ``kvgate prepare``
    under its old spelling."""
    from kvgate.cli.common import run_cli

    parser = argparse.ArgumentParser(prog="python -m kvgate.models",
                                     description="Convert embedded GGUF models once (the same "
                                                 "as kvgate prepare ALIAS).")
    parser.add_argument("--prepare", metavar="ALIAS", dest="aliases", action="append",
                        default=[], help="an embedded model to convert once")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    if not args.aliases:
        parser.error("nothing to do: pass --prepare ALIAS")
    args.command = "prepare"
    return run_cli(run_prepare, args)
