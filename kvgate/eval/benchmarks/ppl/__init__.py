"""Perplexity under eviction (``kvgate eval ppl``)."""
