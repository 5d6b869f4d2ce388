"""Training throughput, two regimes side by side on the same base and batches, one process.

    python bench/bench_train.py [--steps 4] [--seq-len 512] [--batch 1] [--base smollm2-135m]
    python bench/bench_train.py --pair materialised --seq-len 256 --batch 4
    python bench/bench_train.py --pair materialised --device cuda --dtype bfloat16 \
        --base DIR --files docs.jsonl     # a GPU with no embedded corpus (see bench/gpu_checks.sh)
    python bench/bench_train.py --pair materialised --prefill full --continuation 64 \
        --recent 16 --sinks 4 --distill-weight 1 --lm-weight 0 --seq-len 256 --batch 4

``--pair lora`` (default, issue #4): gates + LoRA vs LoRA only; prints the slowdown
LoRA-only / gates+LoRA (target <= 1.35).
``--pair materialised`` (issue #7): gates-only training with kvgate's gated attention (flash
forward + closed-form chunked gate gradient) vs the same step with the gated softmax
materialised as an n x n matrix and differentiated by autograd (the prototype's way); prints
the speed-up (target >= 2x). With ``--prefill full`` (one-shot gates, ``--continuation`` tokens
of each block scored) a third regime, ``kvgate_whole``, runs kvgate's kernel over the whole
block as the materialised regime does, while ``kvgate`` encodes the prompt once without autograd
(``kvgate.gate.prefix``: same loss and gradients), so the two speed-ups are told apart.
``--triton`` adds ``triton``: kvgate on its FlashAttention-2-style Triton kernel (``GateConfig.kernel`` "triton"; CUDA), and names the chunked one too (on CUDA
"auto" picks triton for a bf16 base). ``--profile`` ends with one profiled step per regime.
``--bound`` adds ``attention_free``: the same step with the gated attention replaced by an
elementwise stand-in that costs next to nothing (q, k, v and the gate stay in the graph, so the
rest of the backward is unchanged). materialised / attention_free is the ceiling of what any
gated-attention kernel can gain on that step (Amdahl): where it is below 2, no kernel reaches 2x.

Each timed step is forward + loss + backward + AdamW step of ``KVGateModule.training_step``,
the forward under ``--precision`` as Lightning runs it (the GPU recipes' ``bf16-mixed``: the
gates' fp32 weights then compute in bf16, as they train; without it an fp32 gate beside a bf16
base multiplies in fp32).
The regimes alternate step by step (A, B, A, B, ...) on the same batches, so drifting load
from other processes on the machine hits both alike. One untimed warm-up step each. Each ratio
is that of the total times, then that of the paired steps: their median and its 95% interval.
On CUDA each step is timed between device synchronisations.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvgate.gate.apply as gate_apply
import kvgate.gate.prefix as gate_prefix
from kvgate.attention.gated import gated_attention, gated_attention_reference
from kvgate.eval.intervals import median_interval
from kvgate.gate import GateConfig
from kvgate.models.load import sync_device
from kvgate.training.data import CPTDataModule
from kvgate.training.module import KVGateModule


def materialised(q, k, v, gate, allowed=None, scaling=None, recent=0, chunk=None, prompt=None,
                 kernel=None, memo=None):
    """The prototype's gated attention: the n x n gated softmax, autograd backward (takes
    every argument of kvgate's ``gated_attention``, so it can stand in for it)."""
    return gated_attention_reference(q, k, v, gate, allowed, scaling=scaling, recent=recent,
                                     prompt=prompt)


def attention_free(q, k, v, gate, allowed=None, scaling=None, recent=0, chunk=None, prompt=None,
                   kernel=None, memo=None):
    """Not attention: an O(n d) stand-in with the kernel's signature and output shape whose
    output depends on q, k, v and the gate, so every gradient path of the step stays open."""
    group = q.shape[1] // k.shape[1]
    rows = slice(k.shape[2] - q.shape[2], None)  # queries are the last rows of the keys
    flags = gate if gate.shape[1] == q.shape[1] else gate.repeat_interleave(group, 1)
    kv = (k + v).repeat_interleave(group, 1)[:, :, rows]
    return q + kv * flags[:, :, rows, None].to(q.dtype)


def on_kernel(name: str):
    """kvgate's gated attention on kernel ``name`` ("triton", "chunked"), whatever the gate config
    says (same signature as ``gated_attention``, so it can stand in for it)."""
    def run(q, k, v, gate, allowed=None, scaling=None, recent=0, chunk=None, prompt=None,
            kernel=None, memo=None):
        return gated_attention(q, k, v, gate, allowed, scaling, recent, chunk, prompt,
                               kernel=name, memo=memo)
    return run


IMPLEMENTATIONS = {"materialised": materialised, "attention_free": attention_free,
                   "triton": on_kernel("triton"), "chunked": on_kernel("chunked")}


@contextmanager
def attention_impl(name: str):
    """Route the gated layers through ``name`` ('kvgate' or an IMPLEMENTATIONS key) for a block."""
    if name == "kvgate":
        yield
        return
    # both callers: the whole-block layer and one-shot training's second pass
    saved = gate_apply.gated_attention, gate_prefix.gated_attention
    gate_apply.gated_attention = gate_prefix.gated_attention = IMPLEMENTATIONS[name]
    try:
        yield
    finally:
        gate_apply.gated_attention, gate_prefix.gated_attention = saved


def build(base: str, train: str, dtype: str = "float32", device: str = "cpu",
          gate: GateConfig | None = None,
          recipe: dict | None = None) -> tuple[KVGateModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = KVGateModule(base_model=base, train=train, image_every_n_steps=0, dtype=dtype,
                          lora={"rank": 8, "alpha": 16.0, "dropout": 0.0},
                          gate=gate or GateConfig(), recipe=recipe or {})
    module.configure_model()
    module.to(device)
    params = [p for _, p in module.trainable_named_parameters()]
    return module, torch.optim.AdamW(params, lr=1e-4)


def precision_context(precision: str, device: torch.device):
    """The forward's autocast as Lightning's ``trainer.precision`` sets it: "bf16-mixed" runs
    every matmul in bf16 (the fp32 gates and LoRA weights included), "32-true" as the tensors
    come."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def step(module: KVGateModule, opt: torch.optim.Optimizer, batch: dict,
         precision: str = "32-true") -> float:
    device = batch["input_ids"].device
    sync_device(device)
    start = time.perf_counter()
    with precision_context(precision, device):
        loss = _loss(module, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync_device(device)
    return time.perf_counter() - start


def _loss(module: KVGateModule, batch: dict) -> torch.Tensor:
    """training_step's loss without its self.log calls (they need a Trainer)."""
    return module.objective(batch)[0]


def make_batches(args, tokenizer, seq_len: int, count: int) -> list[dict]:
    """Up to ``count`` training batches of ``args.batch`` blocks of ``seq_len`` tokens from the
    corpus, on ``args.device`` (fewer where the corpus is too small)."""
    data = CPTDataModule(source="files" if args.files else "embedded", files=args.files,
                         max_docs=200, seq_len=seq_len, batch_size=args.batch,
                         val_fraction=0.0, continuation=args.continuation)
    data.tokenizer = tokenizer
    blocks = data.train_dataset()
    collate = data.collate_train(pad_id=0)  # blocks are never padded
    count = min(count, len(blocks) // args.batch)
    return [{k: v.to(args.device) for k, v in
             collate([blocks[i * args.batch + j] for j in range(args.batch)]).items()}
            for i in range(count)]


def measure(args, regimes: dict, impl: dict, split: dict, seq_len: int) -> None:
    """Time every regime on the same batches of ``seq_len`` tokens, alternating, and print."""
    n_batches = args.steps + 1
    batches = make_batches(args, next(iter(regimes.values()))[0].tokenizer, seq_len, n_batches)
    if len(batches) < n_batches:
        print(f"seq_len={seq_len}: corpus too small for {n_batches} batches of {args.batch}x{seq_len}")
        return
    for module, _ in regimes.values():
        module.train()
    cuda = args.device.startswith("cuda")
    seconds = {name: 0.0 for name in regimes}
    took_steps: dict[str, list[float]] = {name: [] for name in regimes}
    peak = {name: 0 for name in regimes}
    failed: dict[str, str] = {}
    for i, batch in enumerate(batches):
        for name, (module, opt) in regimes.items():
            if name in failed:
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats(args.device)
            module.split_prompt = split.get(name, True)
            try:
                with attention_impl(impl[name]):
                    took = step(module, opt, batch, args.precision)
            except Exception as exc:  # a result too: that regime does not fit / run here
                if not isinstance(exc, torch.OutOfMemoryError) and impl[name] != "triton":
                    raise
                failed[name] = ("out of memory" if isinstance(exc, torch.OutOfMemoryError)
                                else f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            if name in failed:
                # outside the except block: while it runs, the exception (and through its
                # frames the failed step's partial graph) is still alive, so the collector
                # could free nothing and the next regime's peak memory counted it (an H200's
                # 8k triton peak read 107 GiB after the materialised regime's OOM)
                opt.zero_grad(set_to_none=True)
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                continue
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated(args.device))
            if i > 0:  # step 0 warms up allocators and kernels
                seconds[name] += took
                took_steps[name].append(took)
    tokens = args.steps * args.batch * seq_len
    tps = {name: tokens / s for name, s in seconds.items() if name not in failed}
    where = (torch.cuda.get_device_name(args.device) if cuda
             else f"cpu threads={torch.get_num_threads()}")
    print(f"base={args.base} seq_len={seq_len} batch={args.batch} timed_steps={args.steps} "
          f"dtype={args.dtype} precision={args.precision} device={where} prefill={args.prefill} "
          f"continuation={args.continuation} distill_weight={args.distill_weight}")
    for name in regimes:
        if name in failed:
            print(f"  {name:<14} {failed[name]}")
            continue
        mem = f", peak {peak[name] / 2**30:.2f} GiB" if cuda else ""
        print(f"  {name:<14} {tps[name]:8.1f} tokens/s  ({seconds[name] / args.steps:.2f} s/step{mem})")

    def ratio(x: str, y: str, what: str) -> str | None:
        if x not in tps or y not in tps:
            return None
        mem = f"; peak memory {peak[x] / peak[y]:.2f}x" if cuda else ""
        # the steps pair up (same batch, back to back): the median of their ratios and its
        # 95% interval say how far the ratio of totals can be trusted
        mid, lo, hi = median_interval([b / a for a, b in zip(took_steps[x], took_steps[y])])
        return (f"{what}: {tps[x] / tps[y]:.3f}x{mem}; per step {mid:.3f}x "
                f"[{lo:.3f}, {hi:.3f}]")

    if args.pair == "lora":
        lines = [ratio("lora", "gates_lora", "slowdown gates+LoRA vs LoRA-only (target <= 1.35x)"),
                 ratio("lora", "gates_lora_triton", "slowdown on the triton kernel (target <= 1.35x)"),
                 ratio("lora", "gates_lora_chunked", "slowdown on the chunked kernel")]
    else:
        lines = [ratio("kvgate", "materialised",
                       "speed-up kvgate vs materialised gated attention (target >= 2x)"),
                 ratio("triton", "materialised", "  triton kernel vs materialised (target >= 1.5x)"),
                 ratio("triton", "chunked", "  triton kernel vs the chunked kernel")]
        if "attention_free" in tps and "materialised" in tps and "kvgate" in tps:
            gain = tps["attention_free"] / tps["materialised"]
            lines.append(f"  ceiling, materialised vs attention_free (attention at no cost): "
                         f"{gain:.3f}x; kvgate reaches "
                         f"{(tps['kvgate'] / tps['materialised'] - 1) / (gain - 1):.0%} of that gain")
        lines += [ratio("kvgate", "kvgate_whole", "  of which two passes (kvgate vs kvgate_whole)"),
                  ratio("kvgate_whole", "materialised", "  kernel (kvgate_whole vs materialised)")]
    for line in lines:
        if line:
            print(line)


def profile(args, regimes: dict, impl: dict, split: dict, seq_len: int) -> None:
    """One step of each regime under torch.profiler: where a regime's time goes (e.g. gates +
    LoRA against LoRA only), by self time on the device (CUDA) or the CPU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batches = make_batches(args, next(iter(regimes.values()))[0].tokenizer, seq_len, 1)
    if not batches:
        print(f"profile: corpus too small for a batch of {args.batch}x{seq_len}")
        return
    batch = batches[0]
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    for name, (module, opt) in regimes.items():
        module.split_prompt = split.get(name, True)
        try:
            with attention_impl(impl[name]):
                step(module, opt, batch, args.precision)  # warm
                with torch_profile(activities=activities) as prof:
                    step(module, opt, batch, args.precision)
        except torch.OutOfMemoryError:
            print(f"profile {name}: out of memory")
            continue
        print(f"profile {name} ({args.batch} x {seq_len}), by {key}:")
        print(prof.key_averages().table(sort_by=key, row_limit=14))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per regime")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[512],
                        help="block lengths, each timed in turn on the same modules")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pair", choices=["lora", "materialised"], default="lora",
                        help="what the gated run is compared with")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="frozen base weights (gates and LoRA train in fp32)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"],
                        help="Lightning's trainer.precision for the forward: bf16-mixed is the "
                             "GPU recipes' (the fp32 gates then compute in bf16 too)")
    parser.add_argument("--files", nargs="*", default=None,
                        help="local .txt/.jsonl documents instead of the embedded corpus")
    parser.add_argument("--prefill", choices=["gated", "full"], default="gated",
                        help="GateConfig.prefill: the paper's eq. 5, or one-shot gates")
    parser.add_argument("--continuation", type=int, default=0,
                        help="scored tokens at the end of each block (one-shot needs > 0)")
    parser.add_argument("--recent", type=int, default=0, help="GateConfig.recent")
    parser.add_argument("--sinks", type=int, default=0, help="GateConfig.sinks")
    parser.add_argument("--distill-weight", type=float, default=0.0,
                        help="recipe.distill_weight (the teacher's forward is part of a step)")
    parser.add_argument("--lm-weight", type=float, default=1.0, help="recipe.lm_weight")
    parser.add_argument("--triton", action="store_true",
                        help="also time the gated regime on its Triton kernel (CUDA)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timings, one profiled step of each regime at the last "
                             "--seq-len: the operators that take the most time")
    parser.add_argument("--bound", action="store_true",
                        help="--pair materialised: also time the step with attention at ~no cost")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    if args.triton and not args.device.startswith("cuda"):
        raise SystemExit("--triton: the Triton kernel runs on CUDA (the CPU tests use its "
                         "interpreter, far too slow to time)")
    if args.prefill == "full" and not 0 < args.continuation < min(args.seq_len) - 1:
        raise SystemExit("--prefill full: set --continuation between 1 and --seq-len - 2")
    gate = GateConfig(prefill=args.prefill, recent=args.recent, sinks=args.sinks)
    recipe = {"distill_weight": args.distill_weight, "lm_weight": args.lm_weight}

    def make(train: str):
        return build(args.base, train, args.dtype, args.device, gate, recipe)

    split = {}  # regime -> KVGateModule.split_prompt (default True)
    if args.pair == "lora":
        regimes = {"gates_lora": make("gates_lora"), "lora": make("lora")}
        impl = {"gates_lora": "kvgate", "lora": "kvgate"}
        if args.triton:  # each kernel named: on CUDA "auto" (gates_lora) is triton already
            for kernel in ("triton", "chunked"):
                regimes[f"gates_lora_{kernel}"] = regimes["gates_lora"]
                impl[f"gates_lora_{kernel}"] = kernel
            del regimes["gates_lora"], impl["gates_lora"]
    else:
        module, opt = make("gates")
        # one module, several routes: identical weights, so only the computation differs
        names = ["kvgate", "kvgate_whole", "materialised"] if args.prefill == "full" else [
            "kvgate", "materialised"]
        if args.triton:  # each kernel named: on CUDA "auto" (kvgate) is triton for a bf16 base
            names = [x for x in names if x != "kvgate"] + ["chunked", "triton"]
        names += ["attention_free"] if args.bound else []
        regimes = {name: (module, opt) for name in names}
        impl = {name: name if name in IMPLEMENTATIONS else "kvgate" for name in names}
        # the whole block, as the materialised regime runs it
        split = {"kvgate_whole": False, "materialised": False, "attention_free": False}
    for seq_len in args.seq_len:
        measure(args, regimes, impl, split, seq_len)
    if args.profile:
        profile(args, regimes, impl, split, args.seq_len[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
