"""Training recipes that make gates learn on small compute: distillation from the full-cache
teacher, a retention schedule, and the oracle loss against the base's KVzip labels."""

from kvgate.recipes.distill import distillation_loss, teacher_logits
from kvgate.recipes.schedule import RetentionSchedule

__all__ = ["RetentionSchedule", "distillation_loss", "teacher_logits"]
