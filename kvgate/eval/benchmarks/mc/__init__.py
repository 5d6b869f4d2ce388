"""Multiple choice under eviction (``kvgate eval mc``, ``matched``, ``pattern``); the scoring
of continuations it runs on is shared (:mod:`kvgate.eval.multiple_choice`), as the needle's
ranking and perplexity use it too."""
