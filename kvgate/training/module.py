"""``KVGateModule``: the LightningModule that trains Attention-Gates and/or LoRA on a frozen base.

Three regimes (``train``):
- ``gates``: only the gates learn, the base is frozen (paper Table 4);
- ``gates_lora``: gates + LoRA on q/k/v/o (paper Tables 1-2);
- ``lora``: LoRA only with no gates (the paper's fine-tuned baseline).

Loss = LM loss over the batch's ``labels`` (every token for CPT, answer tokens only for SFT)
+ the distillation KL to the gates-open teacher (``recipe``) + the eviction loss
``alpha * |mean(gate) - beta|``.

The base model is built in ``configure_model`` (not ``__init__``): every setting is validated
first, so a config error fails before a multi-GB download or load, and DeepSpeed stage 3 can
shard the model as it is built. Lightning checkpoints keep only what trains.

Batch contract (see ``kvgate.training.data``): ``input_ids`` [B, n] long, ``attention_mask``
[B, n] (1 = real token), ``labels`` [B, n] long (-100 = no loss; aligned with ``input_ids``,
the shift happens in the loss), optional ``prompt_mask`` [B, n] bool (SFT), optional
``distill_mask`` [B, n] bool (the positions the KL covers when they are not the labelled ones:
SFT on every choice). Option-scoring
validation batches add ``example_index`` [M], ``choice_index`` [M] and ``gold`` [E].
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from kvgate.gate import (
    GateConfig,
    clear_records,
    eviction_loss,
    gate_modules,
    patch,
    prompt_segment,
    set_gates_trainable,
)
from kvgate.recipes.settings import RecipeSettings
from kvgate.training.errors import TrainingConfigError
from kvgate.training.lora import LoraSettings, add_lora, lora_parameters

TrainMode = Literal["gates", "gates_lora", "lora"]
Quantize = Literal["none", "4bit", "8bit"]
DType = Literal["float32", "bfloat16", "float16"]

CKPT_KEY = "kvgate"  # our entry in a Lightning checkpoint (base id, fingerprint, metrics)
MAX_CHOICES = 8  # widest multiple-choice task (ARC has up to 5 options)


@dataclass
class OptimSettings:
    """AdamW with one learning rate for the gates and one for LoRA, linear warm-up then cosine."""

    lr_gate: float = 1e-3  # gates start from scratch: a larger lr than the adapters
    lr_lora: float = 1e-4  # LoRA A/B matrices
    weight_decay: float = 0.0  # AdamW decoupled weight decay (both groups)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    warmup_ratio: float = 0.03  # fraction of all optimiser steps with a linear warm-up
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        checks = {
            "lr_gate": self.lr_gate > 0, "lr_lora": self.lr_lora > 0,
            "weight_decay": self.weight_decay >= 0,
            "betas": len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "warmup_ratio": 0 <= self.warmup_ratio < 1, "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise TrainingConfigError(
                    f"OptimSettings.{key}: out of range (got {getattr(self, key)!r})")


def lr_factor(step: int, total: int, warmup: int, floor: float) -> float:
    """Multiplier of the base lr at optimiser step ``step``: linear warm-up over ``warmup``
    steps, then a half cosine from 1 down to ``floor`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def causal_lm_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Mean next-token cross-entropy over labelled positions.

    logits [B, n, V], labels [B, n] (-100 = ignore, aligned with the inputs) ->
    (loss scalar, number of predicted tokens). fp32 softmax whatever the logits' dtype.
    """
    target = labels[:, 1:]
    count = (target != -100).sum()
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, target.reshape(-1), ignore_index=-100, reduction="sum")
    return loss / count.clamp(min=1), count


def sequence_logprob(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of log p(label) over labelled positions of every row: [B, n, V], [B, n] -> [B]."""
    target = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return (picked * (target != -100)).sum(-1)


def _as(cls, value):
    """A private copy of a dataclass instance, or one built from a plain dict (a checkpoint's
    hparams) or None (the defaults)."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls.from_dict(value) if hasattr(cls, "from_dict") else cls(**value)
    if not isinstance(value, cls):
        raise TrainingConfigError(f"expected {cls.__name__} or a dict, got {type(value).__name__}")
    return replace(value)


def _check_init_from(path: str, train: str) -> None:
    """Fail at config time, before the base loads, on a checkpoint that cannot start this run."""
    from kvgate.checkpoint import CheckpointError, read_meta

    try:
        meta = read_meta(path, verify=False)
    except CheckpointError as err:
        raise TrainingConfigError(f"KVGateModule.init_from: {err}") from None
    if meta.get("merged"):
        raise TrainingConfigError(
            f"KVGateModule.init_from: {path} holds a merged base (exported with merge); start "
            "from an unmerged export, whose adapter and gates are separate")
    if train != "lora" and meta.get("gate") is None:
        raise TrainingConfigError(f"KVGateModule.init_from: {path} has no gates to start from")
    if train == "lora" and not meta.get("lora"):
        raise TrainingConfigError(
            f"KVGateModule.init_from: {path} has no LoRA adapter for a train='lora' run to start from")
    if train == "gates" and meta.get("lora"):
        raise TrainingConfigError(
            f"KVGateModule.init_from: {path} has a LoRA adapter, which train='gates' would drop; "
            "train 'gates_lora' to keep it")


def _load_init(model: nn.Module, path: str, with_lora: bool) -> None:
    """Copy an exported checkpoint's gates (and adapter, if trained here) into ``model``."""
    from kvgate.checkpoint import (
        ADAPTER_DIR,
        CheckpointError,
        check_base,
        load_gate_weights,
        read_meta,
    )

    try:
        meta = read_meta(path)  # sizes and sha256 checked: a corrupt file fails here
        check_base(meta, path, model)
        if meta.get("gate") is not None and gate_modules(model):
            load_gate_weights(model, path)
        if with_lora and meta.get("lora"):
            _load_adapter(model, f"{path}/{ADAPTER_DIR}")
    except CheckpointError as err:
        raise TrainingConfigError(f"KVGateModule.init_from: {err}") from None


def _load_adapter(model: nn.Module, folder: str) -> None:
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from kvgate.checkpoint import CheckpointError

    try:
        weights = load_file(f"{folder}/adapter_model.safetensors")
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{folder}: adapter cannot be read ({err})") from None
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as err:  # a shape mismatch: another rank or other target modules
        raise CheckpointError(f"{folder}: adapter does not fit this run's LoRA "
                              f"({str(err).splitlines()[0]})") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{folder}: adapter does not fit this run's LoRA (targets or "
                              f"layers differ: {len(missing)} missing, "
                              f"{len(result.unexpected_keys)} unexpected tensors)")


class KVGateModule(L.LightningModule):
    """Frozen base + trainable gates and/or LoRA; see the module docstring for the regimes."""

    def __init__(
        self,
        base_model: str = "smollm2-135m",
        train: TrainMode = "gates_lora",
        gate: GateConfig = GateConfig(),  # noqa: B008 - copied in __init__, never mutated
        lora: LoraSettings = LoraSettings(),  # noqa: B008
        optim: OptimSettings = OptimSettings(),  # noqa: B008
        recipe: RecipeSettings = RecipeSettings(),  # noqa: B008
        dtype: DType = "float32",
        quantize: Quantize = "none",
        gradient_checkpointing: bool = False,
        image_every_n_steps: int = 100,
        init_from: str | None = None,
        split_prompt: bool = True,
    ) -> None:
        """
        Args:
            base_model: alias (``smollm2-135m``), hub id or local folder of a LLaMA/Mistral model.
            train: what learns: ``gates``, ``gates_lora`` or ``lora`` (no gates at all).
            gate: Attention-Gate settings (paper symbols); ignored when ``train='lora'``.
            lora: LoRA rank/alpha/dropout/targets; ignored when ``train='gates'``.
            optim: AdamW learning rates and the warm-up + cosine schedule.
            recipe: small-compute aids (distillation, beta schedule, warm start); the
                defaults are the paper's plain objective.
            dtype: dtype of the frozen base weights (gates and LoRA always train in fp32).
            quantize: load the base 4-bit or 8-bit through bitsandbytes (CUDA only).
            gradient_checkpointing: recompute decoder layers in the backward pass.
            image_every_n_steps: log eviction-pattern images every N steps (0 = never).
            init_from: an exported gated checkpoint whose gate weights (and LoRA adapter,
                when this run trains LoRA) start this run: more CPT on a gate, or SFT from a
                CPT gate. Its base must be this run's base; the gate settings that do not shape
                weights (tau, mode, sinks, recent, ...) come from this run's ``gate``.
            split_prompt: one-shot gates (``gate.prefill: full``) trained alone encode the
                prompt once without autograd and backpropagate through the continuation only:
                the same loss and gradients, less compute (``kvgate.gate.prefix``). False runs
                every block whole (for comparisons).
        """
        super().__init__()
        if train not in ("gates", "gates_lora", "lora"):
            raise TrainingConfigError(
                f"KVGateModule.train: must be 'gates', 'gates_lora' or 'lora' (got {train!r})")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise TrainingConfigError(
                f"KVGateModule.dtype: must be float32, bfloat16 or float16 (got {dtype!r})")
        if not isinstance(image_every_n_steps, int) or image_every_n_steps < 0:
            raise TrainingConfigError(
                f"KVGateModule.image_every_n_steps: must be >= 0 (got {image_every_n_steps!r})")
        _check_quantize(quantize)
        if init_from is not None:
            _check_init_from(init_from, train)
        self.base_model = base_model
        self.train_mode = train
        self.gate_cfg = _as(GateConfig, gate)
        self.lora_cfg = _as(LoraSettings, lora)
        self.optim_cfg = _as(OptimSettings, optim)
        self.recipe_cfg = _as(RecipeSettings, recipe)
        self.dtype_name = dtype
        self.quantize = quantize
        self.gradient_checkpointing = gradient_checkpointing
        self.image_every_n_steps = image_every_n_steps
        self.init_from = None if init_from is None else str(init_from)
        self.split_prompt = bool(split_prompt)
        # plain values only, so the checkpoint loads with torch.load(weights_only=True)
        self.save_hyperparameters({
            "base_model": base_model, "train": train, "gate": self.gate_cfg.to_dict(),
            "lora": asdict(self.lora_cfg), "optim": asdict(self.optim_cfg),
            "recipe": asdict(self.recipe_cfg), "dtype": dtype,
            "quantize": quantize, "gradient_checkpointing": gradient_checkpointing,
            "image_every_n_steps": image_every_n_steps, "init_from": self.init_from,
            "split_prompt": self.split_prompt,
        })
        # the frozen base is not in the Lightning checkpoint, so loading is never strict
        self.strict_loading = False
        self.model: nn.Module | None = None
        self.tokenizer = None
        self.fingerprint: str | None = None
        self.val_acc = MulticlassAccuracy(num_classes=MAX_CHOICES, average="micro")
        self.capture_flags = False  # set by EvictionImageLogger for the step it draws
        self.last_flags: Tensor | None = None  # [L, H_gate, n] flags of sample 0, on the CPU
        self.last_counted: Tensor | None = None  # [n] bool: which of those tokens count
        self.last_stats: dict[str, Tensor] = {}
        self.final_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ model
    @property
    def gated(self) -> bool:
        return self.train_mode in ("gates", "gates_lora")

    @property
    def uses_lora(self) -> bool:
        return self.train_mode in ("gates_lora", "lora")

    def setup(self, stage: str) -> None:
        """Checks that span the model and the data; Lightning runs this before
        ``configure_model``, so they fail before the base is loaded."""
        data = self.trainer.datamodule
        if getattr(data, "answers", "gold") == "all" and not (self.gated
                                                             and self.recipe_cfg.distill_weight):
            # the wrong choices' rows carry no label: without the KL they only cost time
            raise TrainingConfigError(
                "data.answers: 'all' trains the wrong choices through the distillation only; "
                "set model.recipe.distill_weight > 0 (with gates) or data.answers: gold")

    def configure_model(self) -> None:
        """Load the frozen base, add LoRA, then patch the gates (in that order: peft must
        never see the gates' own projections). Idempotent."""
        if self.model is not None:
            return
        from kvgate.models import load_base, model_fingerprint

        if self.quantize != "none":
            model, tokenizer = self._load_quantized()
        else:
            model, tokenizer = load_base(self.base_model, dtype=self.dtype_name)
        self.fingerprint = model_fingerprint(model.config)
        model.requires_grad_(False)
        model.config.use_cache = False
        if self.quantize != "none":
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=self.gradient_checkpointing)
        elif self.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.uses_lora:
            model = add_lora(model, self.lora_cfg)
            for p in lora_parameters(model):
                p.data = p.data.float()
        if self.gated:
            patch(model, self.gate_cfg)
            set_gates_trainable(model, True)
            # gates of ungated layers never run: frozen, so DDP sees no unused parameters
            for gate in gate_modules(model)[: self.gate_cfg.ungated_layers]:
                gate.requires_grad_(False)
        if self.init_from is not None:
            _load_init(model, self.init_from, self.uses_lora)
        # load_base returns eval mode; gradient checkpointing and LoRA dropout need train mode
        model.train()
        self.model = model
        # a tokenizer read earlier (loaders built first) already tokenised the data: keep it
        if self.tokenizer is None:
            self.tokenizer = tokenizer

    def get_tokenizer(self):
        """The base's tokenizer; read alone when the model is not built yet (Lightning's
        DeepSpeed strategy asks for the training loader before ``configure_model``)."""
        if self.tokenizer is None:
            from kvgate.models import load_tokenizer

            self.tokenizer = load_tokenizer(self.base_model)
        return self.tokenizer

    def _load_quantized(self):
        """bitsandbytes places the weights at load time, on this rank's GPU (everything else
        loads on the CPU and the strategy moves it)."""
        from transformers import AutoModelForCausalLM

        from kvgate.models import check_supported, parse_dtype, resolve_model_id

        source = resolve_model_id(self.base_model)
        device = self.trainer.strategy.root_device if self._trainer is not None else "cuda"
        model = AutoModelForCausalLM.from_pretrained(
            source, quantization_config=_bnb_config(self.quantize, self.dtype_name),
            dtype=parse_dtype(self.dtype_name), device_map={"": str(device)})
        check_supported(model.config)
        return model, self.get_tokenizer()

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                prompt_mask: Tensor | None = None) -> Tensor:
        """Logits [B, n, V]; with gates, ``prompt_mask`` marks the prompt for
        ``prompt_bidirectional`` gates (answer tokens never gated)."""
        if self.model is None:
            raise RuntimeError("KVGateModule: the model is not built yet (call configure_model())")
        if self.gated:
            with prompt_segment(self.model, prompt_mask):
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        else:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits

    # --------------------------------------------------------------- training
    def current_beta(self) -> float:
        """Target retention now: annealed from ``recipe.beta_start`` after the warm start."""
        r = self.recipe_cfg
        if r.beta_start is None:
            return self.gate_cfg.beta
        from kvgate.recipes import RetentionSchedule

        schedule = RetentionSchedule(r.beta_start, self.gate_cfg.beta, r.beta_steps, r.beta_schedule)
        return schedule(max(0, self.global_step - r.warmstart_steps))

    def gate_terms(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Eviction loss and retention statistics of the forward that just ran."""
        loss, stats = eviction_loss(self.model, self.gate_cfg, batch["attention_mask"],
                                    beta=self.current_beta())
        if self.capture_flags:
            from kvgate.gate.loss import gate_records

            records = gate_records(self.model)
            self.last_flags = torch.stack([r.gate[0].detach() for _, r in records]).float().cpu()
            self.last_counted = records[0][1].counted[0].detach().cpu()
            self.capture_flags = False
        clear_records(self.model)  # the records hold the graph of this forward
        return loss, stats

    def _warmstart_step(self, batch: dict[str, Tensor]) -> Tensor:
        """Gates learn a heuristic's keep masks (class-balanced BCE) before the real objective."""
        from kvgate.policies import get_policy
        from kvgate.policies.base import Budget
        from kvgate.recipes import heuristic_labels, warmstart_loss

        r = self.recipe_cfg
        keep = r.warmstart_keep if r.warmstart_keep is not None else max(self.gate_cfg.beta, 1e-3)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = heuristic_labels(self.model, get_policy(r.warmstart_policy), Budget(ratio=keep),
                                  ids, mask)
        loss, stats = warmstart_loss(self.model, labels, ids, mask)
        bsz = ids.shape[0]
        self.log("train/warmstart_bce", loss, prog_bar=True, batch_size=bsz)
        self.log("train/warmstart_balanced_acc", stats["balanced_accuracy"], batch_size=bsz)
        return loss

    def prompt_split(self, batch: dict[str, Tensor]) -> int | None:
        """The prompt length when this batch trains in two passes (``kvgate.gate.prefix``):
        a one-shot gate trained alone, on a batch of one shared prompt length, unpadded.
        Anything trainable acting on the prompt (LoRA), layers recomputed in backward, or a
        sliding window shorter than the block keep the whole-block forward."""
        if not (self.split_prompt and self.gated and not self.uses_lora
                and self.gate_cfg.prefill == "full" and not self.gradient_checkpointing):
            return None
        from kvgate.gate.prefix import split_point

        ids = batch["input_ids"]
        window = getattr(self.model.config, "sliding_window", None)
        if window is not None and window < ids.shape[1]:
            return None
        return split_point(ids, batch.get("attention_mask"), batch.get("prompt_mask"),
                           batch.get("labels"))

    def objective(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The training loss of one batch and its terms: ``lm``, ``distill`` (when
        distilling), and with gates ``evict`` and the retention ``stats``."""
        r = self.recipe_cfg
        split = self.prompt_split(batch)
        # the KL covers the labelled positions, or every choice's answer where the batch says so
        kd_mask = batch.get("distill_mask", batch["labels"] != -100)
        if split is None:
            logits = self(batch["input_ids"], batch["attention_mask"], batch.get("prompt_mask"))
            labels = batch["labels"]
            teacher = None
            if self.gated and r.distill_weight:
                from kvgate.recipes import teacher_logits

                teacher = teacher_logits(self.model, adapters=r.distill_teacher == "adapted",
                                         input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"], use_cache=False)
        else:
            logits, teacher, labels = self._two_pass_logits(batch, split)
            kd_mask = kd_mask[:, split - 1:]
        lm, _ = causal_lm_loss(logits, labels)
        terms = {"lm": lm}
        loss = r.lm_weight * lm
        if teacher is not None:
            from kvgate.recipes import distillation_loss

            predicted = kd_mask[:, 1:]  # positions whose next token is scored
            kd = distillation_loss(logits[:, :-1], teacher[:, :-1], predicted,
                                   r.distill_temperature)
            loss = loss + r.distill_weight * kd
            terms["distill"] = kd
        if self.gated:
            ev, stats = self.gate_terms(batch)
            loss = loss + ev
            terms |= {"evict": ev, "stats": stats}
        return loss, terms

    def _two_pass_logits(self, batch: dict[str, Tensor], p: int):
        """Logits (and the teacher's, when distilling) from position p - 1 on, and the labels
        aligned with them: the prompt encoded once without autograd, then the continuation."""
        from kvgate.gate.prefix import continuation_positions, encoded_prompt
        from kvgate.recipes import teacher_logits

        ids = batch["input_ids"]
        rest = ids[:, p:]
        pos = continuation_positions(p, rest)
        teacher = None
        with encoded_prompt(self.model, ids[:, :p]) as last:
            cont = self.model(input_ids=rest, position_ids=pos, use_cache=False).logits
            if self.recipe_cfg.distill_weight:  # reads the same stored prompt, gates open
                t_cont = teacher_logits(
                    self.model, adapters=self.recipe_cfg.distill_teacher == "adapted",
                    input_ids=rest, position_ids=pos, use_cache=False)
                teacher = torch.cat([last, t_cont], 1)
        # the last prompt position predicts the first continuation token; the prompt's
        # positions do not depend on the gates, so its logits carry no gradient
        return torch.cat([last.to(cont.dtype), cont], 1), teacher, batch["labels"][:, p - 1:]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        r = self.recipe_cfg
        if self.gated and self.global_step < r.warmstart_steps:
            return self._warmstart_step(batch)
        if self.gated and self.gate_cfg.prefill == "full" and batch.get("prompt_mask") is None:
            # a fully attended input with no continuation reads no gated entry: nothing to learn
            raise TrainingConfigError(
                "model.gate.prefill: 'full' trains on prompt + continuation blocks; set "
                "data.init_args.continuation > 0 (CPT) or train on a task (SFT)")
        loss, terms = self.objective(batch)
        bsz = batch["input_ids"].shape[0]
        self.log("train/lm_loss", terms["lm"], prog_bar=True, batch_size=bsz)
        if "distill" in terms:
            self.log("train/distill_kl", terms["distill"], prog_bar=True, batch_size=bsz)
        if self.gated:
            ev, stats = terms["evict"], terms["stats"]
            self.log("train/beta", self.current_beta(), batch_size=bsz)
            self.last_stats = {k: v.detach() for k, v in stats.items()}
            self.log("train/evict_loss", ev, batch_size=bsz)
            self.log("train/retention", stats["retention"], batch_size=bsz)
            self.log("evict%", stats["evict_pct"], prog_bar=True, batch_size=bsz, logger=False)
            self.log("train/evict_pct", stats["evict_pct"], batch_size=bsz)
            per_layer = stats["retention_per_layer"].detach()
            self.log_dict({f"retention_layer/{i:02d}": v for i, v in enumerate(per_layer)},
                          batch_size=bsz)
        self.log("train/loss", loss, batch_size=bsz)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"], batch.get("prompt_mask"))
        bsz = batch["input_ids"].shape[0]
        if "example_index" in batch:
            self._score_options(logits, batch)
        else:
            lm, _ = causal_lm_loss(logits, batch["labels"])
            self.log("val/lm_loss", lm, batch_size=bsz, sync_dist=True, prog_bar=True)
        if self.gated:
            _, stats = self.gate_terms(batch)
            self.log("val/retention", stats["retention"], batch_size=bsz, sync_dist=True)
            self.log("val/evict_pct", stats["evict_pct"], batch_size=bsz, sync_dist=True)

    def _score_options(self, logits: Tensor, batch: dict[str, Tensor]) -> None:
        """Option scoring: the choice with the highest summed log-likelihood is the answer."""
        ll = sequence_logprob(logits, batch["labels"])  # [M]
        gold = batch["gold"]
        scores = torch.full((gold.shape[0], MAX_CHOICES), float("-inf"), device=ll.device)
        scores[batch["example_index"], batch["choice_index"]] = ll
        self.val_acc.update(scores.argmax(-1), gold)
        self.log("val/acc", self.val_acc, prog_bar=True, batch_size=gold.shape[0])

    def on_train_epoch_end(self) -> None:
        self._remember_metrics()

    def on_validation_epoch_end(self) -> None:
        self._remember_metrics()

    def _remember_metrics(self) -> None:
        if self._trainer is None:
            return
        for key, value in self.trainer.callback_metrics.items():
            if torch.is_tensor(value) and value.numel() == 1:
                self.final_metrics[key] = float(value)

    # -------------------------------------------------------------- optimiser
    def configure_optimizers(self):
        gate_params = [p for g in gate_modules(self.model) for p in g.parameters() if p.requires_grad]
        lora_params = [p for p in lora_parameters(self.model) if p.requires_grad]
        groups = []
        if gate_params:
            groups.append({"params": gate_params, "lr": self.optim_cfg.lr_gate, "name": "gates"})
        if lora_params:
            groups.append({"params": lora_params, "lr": self.optim_cfg.lr_lora, "name": "lora"})
        if not groups:
            raise TrainingConfigError(f"KVGateModule.train={self.train_mode!r}: nothing to train")
        optimizer = torch.optim.AdamW(groups, betas=self.optim_cfg.betas,
                                      weight_decay=self.optim_cfg.weight_decay)
        total = self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else 10**9
        warmup = round(self.optim_cfg.warmup_ratio * total)
        floor = self.optim_cfg.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total, warmup, floor))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}

    def configure_callbacks(self):
        from kvgate.training.callbacks import default_callbacks

        return default_callbacks(self)

    # ------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop the frozen base from the checkpoint: only gates and LoRA (and the optimiser,
        scheduler, loop and data state Lightning adds) are written."""
        trainable = {name for name, _ in self.trainable_named_parameters()}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                    if k in trainable}
        checkpoint[CKPT_KEY] = {
            "base_model": self.base_model, "fingerprint": self.fingerprint,
            "metrics": dict(self.final_metrics),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        info = checkpoint.get(CKPT_KEY, {})
        if self.fingerprint and info.get("fingerprint") not in (None, self.fingerprint):
            raise TrainingConfigError(
                f"checkpoint was trained on base {info.get('base_model')!r} "
                f"(fingerprint {info.get('fingerprint')}); this run's base {self.base_model!r} "
                f"has fingerprint {self.fingerprint}")
        if self.model is not None:
            want = {name for name, _ in self.trainable_named_parameters()}
            missing = sorted(want - set(checkpoint.get("state_dict", {})))
            if missing:
                raise TrainingConfigError(
                    f"checkpoint lacks {len(missing)} trainable tensor(s), e.g. {missing[0]!r}: "
                    f"it was written with another train/gate/lora setting")
        self.final_metrics.update(info.get("metrics", {}))


def _check_quantize(quantize: str) -> None:
    if quantize == "none":
        return
    if quantize not in ("4bit", "8bit"):
        raise TrainingConfigError(
            f"KVGateModule.quantize: must be 'none', '4bit' or '8bit' (got {quantize!r})")
    if not torch.cuda.is_available():
        raise TrainingConfigError(
            f"KVGateModule.quantize={quantize!r} needs a CUDA GPU: bitsandbytes' CPU path gives "
            "wrong LoRA gradients; use quantize: none on the CPU")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise TrainingConfigError(
            f"KVGateModule.quantize={quantize!r} needs bitsandbytes: pip install 'kvgate[bnb]'")


def _bnb_config(quantize: str, dtype: str):
    from transformers import BitsAndBytesConfig

    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)
