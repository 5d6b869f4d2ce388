"""Bridges from kvgate to the tools users already run (lm-evaluation-harness).

The top layer of the package below the command line: it may import any other kvgate package,
and none of them imports it (``tests/test_layout.py``). Each bridge needs its own extra
(``pip install kvgate[lm-eval]``) and imports it lazily.
"""
