"""One folder per benchmark: ``config`` (its options, one flag each), ``run`` (its examples,
metric and scoring loop on the shared runner), ``report`` (its tables and plots: a
``Report``), ``command`` (the run function and the ``Command`` the registry lists). Everything
they share sits below them in :mod:`kvgate.eval` and names none of them; only
:mod:`kvgate.eval.registry` names them all."""
