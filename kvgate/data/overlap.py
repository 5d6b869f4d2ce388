"""Word n-gram overlap between documents and a set of reference texts (the leak test).

Rule: a document *overlaps* the reference when the two share any run of ``n`` = 13 words
(the contamination test of the GPT-3 paper). Text is lower-cased and every ASCII character that
is not a letter or digit separates words, so punctuation, case and spacing differences do not
hide a copy (non-ASCII characters stay inside words). Texts shorter than ``n`` words produce
no n-gram and can never match.

Each word is hashed with Python's 64-bit ``hash`` (salted per process, which is fine: both sides
of a comparison are hashed in the same process) and an n-gram's key is the polynomial
``sum_k h(w_k) * P**(n-1-k)`` mod 2**64, computed for every position at once with numpy.
The chance of one false match between 10 million corpus n-grams and 10 million reference
n-grams is about 1e-5; a false match can only drop a document, never let a copy through.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NGRAM = 13
_P = np.uint64(0x100000001B3)  # odd multiplier (the FNV prime) for the rolling key
# bytes -> word bytes: ASCII letters/digits lower-cased, other ASCII -> space, non-ASCII kept
_TABLE = bytes(
    (b if (48 <= b <= 57 or 97 <= b <= 122 or b >= 128) else (b + 32 if 65 <= b <= 90 else 32))
    for b in range(256)
)


def words(text: str) -> list[bytes]:
    """The words of ``text`` under the rule above (as UTF-8 bytes)."""
    return text.lower().encode("utf-8").translate(_TABLE).split()


def _sorted_unique(keys: np.ndarray) -> np.ndarray:
    keys = np.sort(keys)
    if keys.size:
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    return keys


class NgramIndex:
    """The set of word ``n``-grams of some reference texts.

    ``overlaps(docs)`` -> bool array ``[len(docs)]``: True where a doc shares an n-gram.
    """

    def __init__(self, texts: Sequence[str], n: int = NGRAM) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        keys, _ = self._keys(texts)
        self._keys_sorted = _sorted_unique(keys)

    def __len__(self) -> int:
        return int(self._keys_sorted.size)

    def _keys(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Keys of every n-gram inside one text ``[G]`` (uint64) and its text index ``[G]``."""
        tokens: list[bytes] = []
        lengths = np.zeros(len(texts), dtype=np.int64)
        for i, text in enumerate(texts):
            split = words(text)
            lengths[i] = len(split)
            tokens.extend(split)
        n, total = self.n, len(tokens)
        if total < n:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        codes = np.fromiter(map(hash, tokens), dtype=np.int64, count=total).view(np.uint64)
        starts = total - n + 1
        key = np.zeros(starts, dtype=np.uint64)
        with np.errstate(over="ignore"):  # wrap-around mod 2**64 is the point
            for k in range(n):
                key = key * _P + codes[k:k + starts]
        owner = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
        inside = owner[:starts] == owner[n - 1:]  # the window does not cross a text boundary
        return key[inside], owner[:starts][inside]

    def overlaps(self, docs: Sequence[str]) -> np.ndarray:
        """Bool ``[len(docs)]``: doc shares at least one n-gram with the reference texts."""
        keys, owner = self._keys(docs)
        # Binary search with sorted queries walks the reference in order (~20x faster than
        # random probes); the few keys found are then looked up per document.
        queries = np.sort(keys)
        found = _sorted_unique(queries[_member(self._keys_sorted, queries)])
        flagged = np.zeros(len(docs), dtype=bool)
        flagged[owner[_member(found, keys)]] = True
        return flagged


def _member(sorted_ref: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Bool per key: present in the sorted array ``sorted_ref``."""
    if sorted_ref.size == 0:
        return np.zeros(keys.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ref, keys), sorted_ref.size - 1)
    return sorted_ref[pos] == keys
