"""One decode row's attention over a ragged base in each layout the store can hold it in.

    python experiments/decode_layouts.py [--counts 1895,1899,1900 132,132,2072 ...]

For bases of one sample whose KV heads keep ``counts`` entries (d 64, GQA group 3, a 20-token
tail; the defaults are layers of the main job's gate at 2k), the time of
``multipart_attention`` on one CPU thread, best of 7 runs of 50 calls, with the base on pages
(``VIEW_SHARE`` 0, ``ROW_SEGMENTS`` 0: the layout before session 36), with heads that keep
alike padded to the longest (``VIEW_SHARE`` as committed), and with few heads flat, read by
rows (both as committed); the kind each gets is printed beside its time. Not a test: it finds
where the layouts pay (experiments/LOG.md 8r).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.attention.decode import KVPart, multipart_attention
from kvgate.attention.paged import PagedKV
from kvgate.attention.rows import RowKV
from kvgate.cache import RaggedStore, pages

DEFAULT = ["1895,1899,1900", "2015,1928,2064", "132,132,2072", "1819,2072,415", "935,1830,850"]
LAYOUTS = {"pages": (0.0, 0), "+padded": (pages.VIEW_SHARE, 0),
           "+rows": (pages.VIEW_SHARE, pages.ROW_SEGMENTS)}


def store_of(counts: list[int], d: int = 64) -> RaggedStore:
    hk, n = len(counts), max(counts)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, hk, n, d, generator=g), torch.randn(1, hk, n, d, generator=g)
    store = RaggedStore(1, hk, d, torch.float32, torch.device("cpu"))
    store.append(k, v, torch.arange(n)[None])
    store.rebuild((torch.arange(n) < torch.tensor(counts)[:, None])[None])
    return store


def base_part(store: RaggedStore) -> tuple[str, KVPart | PagedKV | RowKV]:
    """The part ``CompressedCache._step`` builds for one real decode row, and its kind."""
    vis, tb, hk = store.visible_base(), store.base_len, store.kv_heads
    if store.paged:
        keys, values, seg, grid = store.pages()
        return "paged", PagedKV(keys, values, vis, seg, grid, tb, hk)
    if store.by_rows:
        return "rows", RowKV(*store.rows_part(), vis, tb, hk)
    return ("padded" if store.padded else "gathered"), KVPart(*store.base_kv(), vis)


def best_us(fn, runs: int = 7, calls: int = 50) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", nargs="+", default=DEFAULT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    for spec in args.counts:
        counts = [int(c) for c in spec.split(",")]
        hk = len(counts)
        query = torch.randn(1, 3 * hk, 1, 64, generator=g)
        tail_k = torch.randn(1, hk, 20, 64, generator=g)
        tail = KVPart(tail_k, tail_k.clone(), None)
        cells = []
        for name, (view, rows) in LAYOUTS.items():
            pages.VIEW_SHARE, pages.ROW_SEGMENTS = view, rows
            kind, part = base_part(store_of(counts))
            us = best_us(lambda: multipart_attention(query, [part, tail], 0.125))  # noqa: B023
            cells.append(f"{name}: {kind} {us:.0f} us")
        print(f"{spec}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
