"""``kvgate infer`` (and ``python infer.py``): generate with a KV-cache eviction policy and print
what the cache held.

Examples:
    kvgate infer --model smollm2-135m --policy snapkv --budget 0.5 --prompt "Hello"
    kvgate infer --model smollm2-135m --policy h2o --budget 128 --policy-opt recent=32 \\
        --prompt-file prompts.txt --max-new-tokens 64
    kvgate infer --checkpoint runs/cpt_demo/gated --policy attention_gate --prompt "..."
    kvgate infer --model smollm2-135m --policy snapkv --budget 0.5 --kv-bits 4 --prompt "Hello"

``--prompt`` text is continued as written (no chat template): an instruct model may answer it
with an end-of-turn at once. To ask such a model, compress a ``--context-file`` and ask each
``--question`` after it, through the chat template.

``--budget`` is a ratio of each prompt's real length (0.5 keeps half the entries of every KV
head) or, as an integer > 1, a token count; the full cache and a thresholded gate set their own
eviction, so with them it has no effect (a warning line says so, and the statistics claim no
budget). ``--prompt-file`` holds one prompt per line. ``--kv-bits 8`` or ``4`` stores the kept
entries quantized (``--kv-group`` channels a scale, the newest ``--kv-residual`` tokens also
exact); the bytes held then count the codes, scales and zero points.
Errors in the arguments, the policy, the budget, the device or the checkpoint print one line
and exit 2, as does a prompt longer than the model's context (``--truncate`` cuts it instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvgate.cli import compress as compress_cli
from kvgate.cli.common import run_cli
from kvgate.errors import KVGateError
from kvgate.files import read_user_text


class CliError(KVGateError, ValueError):
    """A bad command line that argparse cannot catch (files, option values)."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``kvgate infer``."""
    p = sub.add_parser("infer", help="generate with an eviction policy and print the cache "
                       "stats", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)
    return p


def build_parser(prog: str = "infer.py") -> argparse.ArgumentParser:
    """The standalone parser of ``python infer.py``."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="base model: alias (smollm2-135m), local folder, .gguf, "
                                     "or hub id")
    src.add_argument("--checkpoint", help="exported gated checkpoint folder, a KVzap checkpoint "
                                          "folder, or a hub id of either")
    p.add_argument("--base", default=None,
                   help="the base model under --checkpoint when the checkpoint names none (a "
                        "published KVzap checkpoint, e.g. nvidia/KVzap-mlp-Qwen3-8B on "
                        "Qwen/Qwen3-8B)")
    p.add_argument("--policy", default=None,
                   help="eviction policy name (default: with --checkpoint, local_gate for a "
                        "local gate kind (mlp, linear) and attention_gate otherwise; else full)")
    p.add_argument("--budget", default=None,
                   help="kept entries per KV head: ratio in (0, 1] or tokens > 1 (default 1.0); "
                        "no effect with a policy that sets its own eviction (full, a "
                        "thresholded gate)")
    p.add_argument("--decode-budget", default=None,
                   help="capacity while decoding (decode-evicting policies); default: the "
                        "per-head count after the prefill")
    p.add_argument("--policy-opt", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="policy option (repeatable): KEY=VALUE, or NAME.KEY=VALUE as kvgate "
                        "eval takes it (NAME: the --policy); VALUE is parsed as JSON when it "
                        "can be")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="a prompt, continued as raw text without the chat template "
                             "(repeatable: a batch); to ask an instruct model, use "
                             "--context-file and --question")
    prompt.add_argument("--prompt-file", help="file with one prompt per line")
    compress_cli.add_cli_arguments(p, prompt)  # --context-file, --question, --answer-prefix
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flash"],
                   help="'flash': fused attention only (refuses policies that need scores)")
    p.add_argument("--truncate", action="store_true",
                   help="cut a prompt longer than the model's context (with the new tokens) "
                        "from the start, with a warning; without it such a prompt is refused")
    p.add_argument("--kv-bits", type=int, default=16,
                   help="how kept keys and values are stored: 16 (the model's dtype), 8 or 4 "
                        "bits in groups of --kv-group channels, each with an fp16 scale and "
                        "zero point (default 16)")
    p.add_argument("--kv-group", type=int, default=32,
                   help="channels per scale and zero point with --kv-bits 8 or 4; a head with "
                        "fewer is one group (default 32)")
    p.add_argument("--kv-residual", type=int, default=64,
                   help="with --kv-bits 8 or 4, the newest tokens also held in full precision "
                        "(default 64)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="decode at fixed shapes, one CUDA graph replayed per token on CUDA "
                        "(one-shot policies only; the same tokens, less host time per step)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def parse_policy_options(items: list[str], policy: str | None = None) -> dict[str, Any]:
    """``["window=32", "snapkv.pooling=max"]`` -> ``{"window": 32, "pooling": "max"}``.

    ``NAME.KEY=VALUE`` is ``kvgate eval``'s form (one command line works in both); its NAME
    must be ``policy``, the one policy that runs here."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name, dot, option = key.partition(".")
        if not sep or not key.strip() or (dot and not option.strip()):
            raise CliError(f"--policy-opt {item!r}: expected KEY=VALUE or "
                           f"{policy or 'NAME'}.KEY=VALUE")
        if dot:  # option names hold no dot: the part before it names the policy
            if name.strip() != policy:
                raise CliError(f"--policy-opt {item!r}: the policy is {policy!r}, not "
                               f"{name.strip()!r}; write {policy}.{option.strip()}={raw} (or "
                               f"{option.strip()}={raw})")
            key = option
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options[key.strip()] = value
    return options


def _parse_decode_budget(raw: str | None) -> float | int | None:
    if raw is None:
        return None
    try:
        return int(raw) if raw.strip().lstrip("-").isdigit() else float(raw)
    except ValueError:
        raise CliError(f"--decode-budget {raw!r} is neither a ratio nor a token count") from None


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        prompts = args.prompt
    else:
        text = read_user_text(args.prompt_file, "--prompt-file")
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts or any(not p.strip() for p in prompts):
        raise CliError("empty prompt")
    return prompts


def _load(args: argparse.Namespace):
    if args.checkpoint is not None:
        try:
            from kvgate.checkpoint import load_gated
        except ImportError as exc:
            raise CliError(f"--checkpoint needs kvgate.checkpoint.load_gated ({exc})") from None
        model, tokenizer, _ = load_gated(args.checkpoint, base=args.base, dtype=args.dtype,
                                         device=args.device)
        return model, tokenizer
    from kvgate.models import load_base

    return load_base(args.model, dtype=args.dtype, device=args.device)


def run(args: argparse.Namespace) -> int:
    from kvgate.cache.quant import KVQuant
    from kvgate.checkpoint import gate_kind
    from kvgate.inference import Engine
    from kvgate.models.load import check_device
    from kvgate.policies import get_policy
    from kvgate.policies.base import Budget, PolicyError
    from kvgate.policies.contract import DecodeEvicting
    from kvgate.policies.registry import gate_policy_name

    # everything that can be checked without the model is checked first (fast errors)
    budget = Budget.parse("1.0" if args.budget is None else args.budget)
    decode_budget = _parse_decode_budget(args.decode_budget)
    kv = KVQuant.from_flags(args.kv_bits, args.kv_group, args.kv_residual)
    name = args.policy or (gate_policy_name(gate_kind(args.checkpoint)) if args.checkpoint
                           else "full")
    policy = get_policy(name, **parse_policy_options(args.policy_opt, name))
    if policy.needs_attention and args.attn == "flash":
        raise PolicyError(f"policy {policy.name!r} needs attention scores, which the 'flash' "
                          "backend cannot give; use --attn sdpa")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.cuda_graphs and isinstance(policy, DecodeEvicting):
        raise CliError(f"--cuda-graphs: policy {policy.name!r} evicts while decoding, so its "
                       "steps change shape; use a one-shot policy or leave the flag out")
    check_device(args.device)
    if args.cuda_graphs and not str(args.device).startswith("cuda"):
        # the same fixed-shape steps then run eagerly: same tokens and statistics, no speed-up
        print(f"warning: --cuda-graphs has no effect on the {args.device.upper()} (CUDA graphs "
              "need --device cuda); decoding as without it", file=sys.stderr)
    compress_cli.check_cli_arguments(args)
    if args.base is not None and args.checkpoint is None:
        raise CliError("--base names the base under --checkpoint; with --model leave it out")
    prompts = None if args.context_file else _read_prompts(args)
    if policy.budget_free and args.budget is not None:  # every check passed: one line
        # the full cache keeps everything and a gate what its scores keep: say so, rather than
        # let the statistics read as if the budget had been applied
        dial = (f"; --policy-opt {name}.tau sets how much it evicts" if hasattr(policy, "tau")
                else "")
        print(f"warning: --budget {args.budget} has no effect with policy {policy.name!r}, "
              f"which sets its own eviction{dial}", file=sys.stderr)
    model, tokenizer = _load(args)
    engine = Engine(model, tokenizer, policy, budget, decode_budget=decode_budget, attn=args.attn,
                    truncate=args.truncate, graphs=args.cuda_graphs, **kv.kwargs())
    if args.context_file:
        return compress_cli.run(engine, args)
    result = engine.generate(prompts, max_new_tokens=args.max_new_tokens, greedy=not args.sample,
                             temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps({"texts": result.texts, "token_ids": result.token_ids,
                          "stats": result.stats.as_dict()}, indent=2))
        return 0
    for i, (prompt, text) in enumerate(zip(prompts, result.texts)):
        if len(prompts) > 1:
            print(f"--- [{i}] {prompt}")
        print(text)
    print()
    print(result.stats.table())
    return 0


def main(argv: list[str] | None = None, prog: str = "infer.py") -> int:
    """``python infer.py ...``: the same as ``kvgate infer ...``."""
    return run_cli(run, build_parser(prog).parse_args(argv))
