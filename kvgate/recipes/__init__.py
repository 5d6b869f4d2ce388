"""Training recipes that make gates learn on small compute: distillation from the full-cache
teacher, a retention schedule, and a warm start on heuristic keep labels."""

from kvgate.recipes.distill import distillation_loss, teacher_logits
from kvgate.recipes.schedule import RetentionSchedule
from kvgate.recipes.warmstart import heuristic_labels, warmstart_loss

__all__ = ["RetentionSchedule", "distillation_loss", "heuristic_labels", "teacher_logits",
           "warmstart_loss"]
