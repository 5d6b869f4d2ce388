"""The training objective of one batch, and the losses it is made of.

Loss = ``recipe.lm_weight`` x LM loss over the batch's ``labels`` (every token for CPT, answer
tokens only for SFT) + ``recipe.distill_weight`` x the KL to the gates-open teacher + the
eviction loss ``alpha * |mean(gate) - beta|``, with beta annealed by the recipe, + with oracle
labels ``recipe.oracle_weight`` x the oracle loss (``kvgate.recipes.oracle``: the gates' scores
against the base's KVzip scores, a gradient for the gates alone). With neither the LM loss nor
the distillation on, a gates-only step runs its forward without autograd outside the gates
(``gates_only_step``).

A one-shot gate trained alone on a batch of one shared prompt length runs in two passes
(``kvgate.gate.prefix``): the prompt encoded once without autograd, then the continuation;
the same loss and gradients for less compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvgate.gate import (
    clear_records,
    eviction_loss,
    gate_graph_only,
    gate_records,
    recorded_scores,
)
from kvgate.gate.prefix import continuation_positions, encoded_prompt, split_point
from kvgate.recipes import RetentionSchedule, distillation_loss, teacher_logits
from kvgate.recipes.oracle import oracle_loss
from kvgate.training.errors import TrainingConfigError


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


class TrainingObjective:
    """The loss computation of ``KVGateModule`` (a mixin: it reads the module's ``model``,
    ``gate_cfg``, ``recipe_cfg``, ``gated``, ``uses_lora``, ``split_prompt``,
    ``gradient_checkpointing`` and ``global_step``, calls its forward for the logits, and
    fills ``last_flags``/``last_counted`` when ``capture_flags`` asks for them)."""

    def current_beta(self) -> float:
        """Target retention now: annealed from ``recipe.beta_start`` to ``gate.beta``."""
        r = self.recipe_cfg
        if r.beta_start is None:
            return self.gate_cfg.beta
        schedule = RetentionSchedule(r.beta_start, self.gate_cfg.beta, r.beta_steps, r.beta_schedule)
        return schedule(self.global_step)

    def gate_terms(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Eviction loss and retention statistics of the forward that just ran."""
        loss, stats = eviction_loss(self.model, self.gate_cfg, batch["attention_mask"],
                                    beta=self.current_beta())
        if self.capture_flags:
            records = gate_records(self.model)
            self.last_flags = torch.stack([r.gate[0].detach() for _, r in records]).float().cpu()
            self.last_counted = records[0][1].counted[0].detach().cpu()
            self.capture_flags = False
        clear_records(self.model)  # the records hold the graph of this forward
        return loss, stats

    def prompt_split(self, batch: dict[str, Tensor]) -> int | None:
        """The prompt length when this batch trains in two passes (``kvgate.gate.prefix``):
        a one-shot gate trained alone, on a batch of one shared prompt length, unpadded.
        Anything trainable acting on the prompt (LoRA), layers recomputed in backward, or a
        sliding window shorter than the block keep the whole-block forward."""
        if not (self.split_prompt and self.gated and not self.uses_lora
                and self.gate_cfg.prefill == "full" and not self.gradient_checkpointing):
            return None
        ids = batch["input_ids"]
        window = getattr(self.model.config, "sliding_window", None)
        if window is not None and window < ids.shape[1]:
            return None
        return split_point(ids, batch.get("attention_mask"), batch.get("prompt_mask"),
                           batch.get("labels"))

    def oracle_terms(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The oracle loss of the forward that just ran (inside ``recorded_scores``) against
        the batch's labels, and its ``agreement`` with KVzip's keep decisions."""
        labels = batch.get("oracle")
        if labels is None:
            raise TrainingConfigError("model.recipe.oracle_weight > 0, but the batch carries no "
                                      "oracle labels (data.init_args.oracle; CPT only)")
        r, g = self.recipe_cfg, self.gate_cfg
        keep = r.oracle_keep if r.oracle_keep is not None else self.current_beta()
        return oracle_loss(self.model, labels, r.oracle_loss, keep, g.gamma, g.tau)

    def objective(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The training loss of one batch and its terms: ``lm``, ``distill`` (when
        distilling), with gates ``evict`` and the retention ``stats``, and with oracle labels
        ``oracle`` and ``oracle_agreement``."""
        oracle = self.gated and bool(self.recipe_cfg.oracle_weight)
        with recorded_scores(self.model, on=oracle):
            return self._objective(batch, oracle, self.gates_only_step())

    def gates_only_step(self) -> bool:
        """Whether every loss of a training step reads only the gates: gates alone train and
        neither the LM loss nor the distillation is on (the oracle and eviction losses, KVzap's
        recipe). Then the forward runs without autograd outside the gates (the LM loss is
        still logged) and the backward stays inside them."""
        r = self.recipe_cfg
        return (self.gated and self.train_mode == "gates" and torch.is_grad_enabled()
                and not r.lm_weight and not r.distill_weight)

    def _objective(self, batch: dict[str, Tensor], oracle: bool,
                   gates_only: bool) -> tuple[Tensor, dict[str, Tensor]]:
        r = self.recipe_cfg
        split = self.prompt_split(batch)
        # the KL covers the labelled positions, or every choice's answer where the batch says so
        kd_mask = batch.get("distill_mask", batch["labels"] != -100)
        if split is None:
            with gate_graph_only(self.model, on=gates_only):
                logits = self(batch["input_ids"], batch["attention_mask"],
                              batch.get("prompt_mask"))
            labels = batch["labels"]
            teacher = None
            if self.gated and r.distill_weight:
                teacher = teacher_logits(self.model, adapters=r.distill_teacher == "adapted",
                                         input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"], use_cache=False)
        else:
            with gate_graph_only(self.model, on=gates_only):
                logits, teacher, labels = self._two_pass_logits(batch, split)
            kd_mask = kd_mask[:, split - 1:]
        lm, _ = causal_lm_loss(logits, labels)
        terms = {"lm": lm}
        loss = r.lm_weight * lm
        if teacher is not None:
            predicted = kd_mask[:, 1:]  # positions whose next token is scored
            kd = distillation_loss(logits[:, :-1], teacher[:, :-1], predicted,
                                   r.distill_temperature)
            loss = loss + r.distill_weight * kd
            terms["distill"] = kd
        if oracle:  # before gate_terms clears the records
            term, info = self.oracle_terms(batch)
            loss = loss + r.oracle_weight * term
            terms |= {"oracle": term, "oracle_agreement": info["agreement"]}
        if self.gated:
            ev, stats = self.gate_terms(batch)
            loss = loss + ev
            terms |= {"evict": ev, "stats": stats}
        return loss, terms

    def _two_pass_logits(self, batch: dict[str, Tensor], p: int):
        """Logits (and the teacher's, when distilling) from position p - 1 on, and the labels
        aligned with them: the prompt encoded once without autograd, then the continuation."""
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
