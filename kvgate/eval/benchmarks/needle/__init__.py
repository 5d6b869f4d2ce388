"""Passkey retrieval by context length and depth (``kvgate eval needle``)."""
