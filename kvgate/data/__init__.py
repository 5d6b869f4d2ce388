"""Embedded evaluation tasks, SFT splits and the CPT corpus (no network needed).

- :func:`load_task`: 11 multiple-choice tasks as :class:`MCExample` (see :mod:`.tasks`);
  :func:`add_fewshot` puts solved examples before their contexts (see :mod:`.fewshot`).
- :func:`load_sft_split`: deterministic train/test parts of each task (see :mod:`.splits`).
- :func:`load_corpus`: leak-checked CPT text from non-evaluation sources (see :mod:`.corpus`);
  :func:`load_redpajama_sample` for the paper's RedPajama corpus from the Hub.
- :func:`load_ruler`, :func:`load_longbench`: long-context benchmarks as :class:`LongExample`
  from the Hub or a local ``save_to_disk`` copy (see :mod:`.longctx`).
"""

from kvgate.data.corpus import (
    corpus_sources,
    corpus_stats,
    corpus_token_count,
    filter_eval_overlap,
    load_corpus,
    load_text_files,
)
from kvgate.data.errors import DataError, HubUnavailableError
from kvgate.data.fewshot import add_fewshot
from kvgate.data.hub import hub_offline_reason
from kvgate.data.longctx import LongExample, load_longbench, load_ruler
from kvgate.data.redpajama import load_redpajama_sample, redpajama_sample_records
from kvgate.data.splits import load_sft_split, split_bucket, split_examples
from kvgate.data.tasks import TASKS, MCExample, embedded_splits, load_task

__all__ = [
    "TASKS", "DataError", "HubUnavailableError", "LongExample", "MCExample", "add_fewshot", "corpus_sources", "corpus_stats",
    "corpus_token_count", "embedded_splits", "filter_eval_overlap", "hub_offline_reason",
    "load_corpus", "load_longbench", "load_redpajama_sample", "load_ruler", "load_sft_split", "load_task", "load_text_files",
    "redpajama_sample_records", "split_bucket", "split_examples",
]
