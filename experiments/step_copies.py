"""What a gated training step writes beyond a LoRA-only step, outside the attention kernels.

    TRITON_INTERPRET=1 python experiments/step_copies.py [--seq-len 256] [--kernel triton]

On the CPU, where nothing can be timed against a GPU's flash kernel, this counts what does not
depend on the machine: every new tensor of at least one head's [n, d] activation that one step
(forward, backward, AdamW) allocates, by operator, dtype and call site, for LoRA only and for
gates + LoRA on ``--kernel`` (the Triton kernel runs under its interpreter; its own launches are
not counted). The base is a random two-layer LLaMA (4 heads of 64, 2 KV heads) in bf16 under
bf16 autocast, as the GPU recipes train. The rows where gates + LoRA make more are the step's
overhead that is not attention arithmetic: copies, casts and the gate's own layers.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import bench_train

from kvgate.attention import triton_kernel
from kvgate.gate import GateConfig
from kvgate.models.load import resolve_model_id


class NewTensors(TorchDispatchMode):
    """Counts and bytes of the new (non-aliasing) tensors of >= ``least`` elements, by
    (operator, dtype, call site or autograd node)."""

    def __init__(self, least: int):
        super().__init__()
        self.least = least
        self.count, self.bytes = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= self.least:
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if out.untyped_storage().data_ptr() not in inputs:
                node = torch._C._current_autograd_node()
                site = type(node).__name__ if node is not None else _caller()
                key = (func.__name__.split(".")[0], str(out.dtype).removeprefix("torch."), site)
                self.count[key] += 1
                self.bytes[key] += out.numel() * out.element_size()
        return out


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()
              if any(p in f.filename for p in ("/kvgate/", "/transformers/", "/peft/"))]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1].split(str(ROOT) + '/')[-1]}:{f.name}"


def _uncounted_launches() -> None:
    """Triton's interpreter copies every operand to and from the host: not the step's."""
    launcher = triton_kernel._launcher

    def quiet(which, device):
        kernel, tiles = launcher(which, device)

        class Quiet:
            def __getitem__(self, grid):
                def run(*a, **kw):
                    with _disable_current_modes():
                        return kernel[grid](*a, **kw)
                return run
        return Quiet(), tiles

    triton_kernel._launcher = quiet


def tiny_base(into: Path) -> str:
    """A random two-layer LLaMA with the embedded model's tokenizer, saved under ``into``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    src = Path(resolve_model_id("smollm2-135m"))
    config = LlamaConfig(**{**json.loads((src / "config.json").read_text()),
                            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(into)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, into / name)
    return str(into)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--kernel", default="triton", choices=["triton", "chunked"])
    args = parser.parse_args()
    _uncounted_launches()
    batch_args = argparse.Namespace(files=None, batch=1, device="cpu", continuation=0)
    seen = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = tiny_base(Path(tmp))
        for name, train, impl in (("lora", "lora", "kvgate"), ("gates_lora", "gates_lora",
                                                               args.kernel)):
            module, opt = bench_train.build(base, train, "bfloat16", "cpu", GateConfig(), {})
            batch = bench_train.make_batches(batch_args, module.tokenizer, args.seq_len, 1)[0]
            module.train()
            with bench_train.attention_impl(impl):
                bench_train.step(module, opt, batch, "bf16-mixed")  # warm: AdamW's state
                seen[name] = NewTensors(least=args.seq_len * 64)
                with seen[name]:
                    bench_train.step(module, opt, batch, "bf16-mixed")
    lora, gated = seen["lora"], seen["gates_lora"]
    mib = 2 ** 20
    print(f"seq_len {args.seq_len}, kernel {args.kernel}: new tensors >= one head's [n, d], "
          f"LoRA only {sum(lora.count.values())} ({sum(lora.bytes.values()) / mib:.2f} MiB), "
          f"gates + LoRA {sum(gated.count.values())} ({sum(gated.bytes.values()) / mib:.2f} MiB)")
    print("where gates + LoRA make more (count, MiB: LoRA only -> gates + LoRA):")
    keys = [k for k in gated.bytes if gated.bytes[k] > lora.bytes[k]]
    for key in sorted(keys, key=lambda k: lora.bytes[k] - gated.bytes[k]):
        op, dtype, site = key
        print(f"  {op:<16} {dtype:<9} {site:<48} {lora.count[key]:3d} -> {gated.count[key]:3d}"
              f"  {lora.bytes[key] / mib:6.2f} -> {gated.bytes[key] / mib:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
