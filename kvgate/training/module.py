"""``KVGateModule``: the LightningModule that trains Attention-Gates and/or LoRA on a frozen base.

Three regimes (``train``):
- ``gates``: only the gates learn, the base is frozen (paper Table 4);
- ``gates_lora``: gates + LoRA on q/k/v/o (paper Tables 1-2);
- ``lora``: LoRA only with no gates (the paper's fine-tuned baseline).

Loss = LM loss over the batch's ``labels`` (every token for CPT, answer tokens only for SFT)
+ the distillation KL to the gates-open teacher (``recipe``) + the eviction loss
``alpha * |mean(gate) - beta|`` + the oracle loss against the base's KVzip labels
(``recipe.oracle_weight``) (``kvgate.training.objective``).

The base model is built in ``configure_model`` (not ``__init__``; ``kvgate.training.build``):
every setting is validated first, so a config error fails before a multi-GB download or load,
and DeepSpeed stage 3 can shard the model as it is built. Lightning checkpoints keep only what
trains.

Batch contract (see ``kvgate.training.batches``): ``input_ids`` [B, n] long, ``attention_mask``
[B, n] (1 = real token), ``labels`` [B, n] long (-100 = no loss; aligned with ``input_ids``,
the shift happens in the loss), optional ``prompt_mask`` [B, n] bool (SFT), optional
``distill_mask`` [B, n] bool (the positions the KL covers when they are not the labelled ones:
SFT on every choice). Option-scoring
validation batches add ``example_index`` [M], ``choice_index`` [M] and ``gold`` [E].
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from kvgate.gate import GateConfig, gate_modules, prompt_segment
from kvgate.models import load_base, load_tokenizer, model_fingerprint
from kvgate.recipes.settings import RecipeSettings
from kvgate.training.build import (
    check_init_from,
    check_quantize,
    load_quantized,
    prepare_for_training,
)
from kvgate.training.errors import TrainingConfigError
from kvgate.training.lora import LoraSettings, lora_parameters
from kvgate.training.objective import TrainingObjective, causal_lm_loss, sequence_logprob
from kvgate.training.optim import OptimSettings, adamw_with_schedule, lr_factor

__all__ = ["CKPT_KEY", "MAX_CHOICES", "KVGateModule", "OptimSettings", "causal_lm_loss",
           "lr_factor", "sequence_logprob"]

TrainMode = Literal["gates", "gates_lora", "lora"]
Quantize = Literal["none", "4bit", "8bit"]
DType = Literal["float32", "bfloat16", "float16"]

CKPT_KEY = "kvgate"  # our entry in a Lightning checkpoint (base id, fingerprint, metrics)
MAX_CHOICES = 8  # widest multiple-choice task (ARC has up to 5 options)


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


class KVGateModule(TrainingObjective, L.LightningModule):
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
            base_model: alias (``smollm2-135m``), hub id or local folder of a LLaMA, Mistral or Qwen model.
            train: what learns: ``gates``, ``gates_lora`` or ``lora`` (no gates at all).
            gate: Attention-Gate settings (paper symbols); ignored when ``train='lora'``.
            lora: LoRA rank/alpha/dropout/targets; ignored when ``train='gates'``.
            optim: AdamW learning rates and the warm-up + cosine schedule.
            recipe: small-compute aids (distillation, beta schedule, oracle labels); the
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
        check_quantize(quantize)
        recipe_cfg = _as(RecipeSettings, recipe)
        if recipe_cfg.oracle_weight:
            if train == "lora":
                raise TrainingConfigError("model.recipe.oracle_weight: the oracle loss trains "
                                          "gates; train 'lora' has none (use gates or gates_lora)")
            if _as(GateConfig, gate).target != "kv":
                raise TrainingConfigError("model.recipe.oracle_weight: oracle labels are per KV "
                                          "head; set model.gate.target: kv")
        if init_from is not None:
            check_init_from(init_from, train)
        self.base_model = base_model
        self.train_mode = train
        self.gate_cfg = _as(GateConfig, gate)
        self.lora_cfg = _as(LoraSettings, lora)
        self.optim_cfg = _as(OptimSettings, optim)
        self.recipe_cfg = recipe_cfg
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
        self.oracle_fingerprint: str | None = None  # the base's weights, when labels are read
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
        device = self.trainer.strategy.root_device
        if self.gated and self.gate_cfg.kernel == "triton" and device.type != "cuda":
            # else a 180-line traceback from inside the kernel, after the base has loaded
            raise TrainingConfigError(
                f"model.gate.kernel: {self.gate_cfg.kernel!r} trains only on CUDA and this run "
                f"is on the {device.type.upper()}; use --model.gate.kernel chunked (or auto)")
        data = self.trainer.datamodule
        if getattr(data, "answers", "gold") == "all" and not (self.gated
                                                             and self.recipe_cfg.distill_weight):
            # the wrong choices' rows carry no label: without the KL they only cost time
            raise TrainingConfigError(
                "data.answers: 'all' trains the wrong choices through the distillation only; "
                "set model.recipe.distill_weight > 0 (with gates) or data.answers: gold")
        if self.recipe_cfg.oracle_weight and getattr(data, "oracle", None) is None:
            raise TrainingConfigError(
                "model.recipe.oracle_weight > 0 trains on KVzip labels: set data.init_args.oracle "
                "(CPT data; computed by kvgate data oracle --config ...)")

    def configure_model(self) -> None:
        """Load the frozen base, add LoRA, then patch the gates (in that order: peft must
        never see the gates' own projections). Idempotent."""
        if self.model is not None:
            return
        if self.quantize != "none":
            device = self.trainer.strategy.root_device if self._trainer is not None else "cuda"
            model = load_quantized(self.base_model, self.quantize, self.dtype_name, device)
            tokenizer = self.get_tokenizer()
        else:
            model, tokenizer = load_base(self.base_model, dtype=self.dtype_name)
        self.fingerprint = model_fingerprint(model.config)
        if self.gated and self.recipe_cfg.oracle_weight:  # the labels are this base's own
            from kvgate.data.oracle import base_fingerprint

            self.oracle_fingerprint = base_fingerprint(model)
        self.model = prepare_for_training(
            model, quantized=self.quantize != "none",
            gradient_checkpointing=self.gradient_checkpointing,
            lora=self.lora_cfg if self.uses_lora else None,
            gate=self.gate_cfg if self.gated else None, init_from=self.init_from)
        # a tokenizer read earlier (loaders built first) already tokenised the data: keep it
        if self.tokenizer is None:
            self.tokenizer = tokenizer

    def get_tokenizer(self):
        """The base's tokenizer; read alone when the model is not built yet (Lightning's
        DeepSpeed strategy asks for the training loader before ``configure_model``)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.base_model)
        return self.tokenizer

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
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
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
        if "oracle" in terms:
            self.log("train/oracle_loss", terms["oracle"], prog_bar=True, batch_size=bsz)
            self.log("train/oracle_agreement", terms["oracle_agreement"], batch_size=bsz)
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
        if not gate_params and not lora_params:
            raise TrainingConfigError(f"KVGateModule.train={self.train_mode!r}: nothing to train")
        return adamw_with_schedule(gate_params, lora_params, self.optim_cfg,
                                   self.trainer.estimated_stepping_batches)

    def configure_callbacks(self):
        from kvgate.training.monitors import default_callbacks

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
