"""``kvgate prepare`` (the one-time conversion of embedded GGUF models) and ``kvgate data``
(build the CPT corpus once and print its mix)."""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "smollm2-135m"


def add_prepare_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "prepare", help="convert an embedded GGUF model once (a plain safetensors folder)",
        description="Convert embedded GGUF models once into $KVGATE_CACHE/models/ALIAS "
                    "(~1 minute; later loads take about a second). The same as "
                    "python -m kvgate.models --prepare ALIAS.")
    p.add_argument("aliases", nargs="*", metavar="ALIAS", default=[DEFAULT_MODEL],
                   help=f"embedded model alias (default {DEFAULT_MODEL})")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run_prepare)
    return p


def run_prepare(args: argparse.Namespace) -> int:
    from kvgate.models import prepare_embedded

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
    return p


def run_data(args: argparse.Namespace) -> int:
    from kvgate.data.corpus import main as corpus_main

    return corpus_main(["--no-tokens"] if args.no_tokens else [])
