"""Data modules: SFT loss mask, packing, option-scoring batches, resumable order."""

from __future__ import annotations

import pytest
import torch
from kvtrain_fixtures import SyntheticCPT, SyntheticSFT, char_tokenizer, synthetic_examples

from kvgate.training.data import (
    CPTDataModule,
    ResumableSampler,
    SFTDataModule,
    collate_options,
    collate_sft,
    encode_prompt_answer,
    pack_documents,
)
from kvgate.training.errors import TrainingConfigError


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_sft_labels_cover_exactly_the_answer_tokens(tok):
    pairs = [("Is it hot?\nAnswer:", " yes"), ("Q\nAnswer:", " no way")]
    rows = [encode_prompt_answer(tok, c, a, max_len=64) for c, a in pairs]
    batch = collate_sft(rows, pad_id=tok.pad_token_id)
    for i, (context, answer) in enumerate(pairs):
        labelled = batch["labels"][i] != -100
        # labels sit exactly on the answer's tokens, and they are the answer's ids
        assert tok.decode(batch["input_ids"][i][labelled]) == answer
        assert torch.equal(batch["labels"][i][labelled], batch["input_ids"][i][labelled])
        # the prompt mask is the context and nothing else (no answer, no padding)
        assert tok.decode(batch["input_ids"][i][batch["prompt_mask"][i]]) == context
        real = batch["attention_mask"][i].bool()
        assert not (labelled & batch["prompt_mask"][i]).any()
        assert torch.equal(labelled | batch["prompt_mask"][i], real)
    # the shorter row is right-padded and the padding carries no label
    assert batch["attention_mask"][1].sum() < batch["attention_mask"].shape[1]
    assert (batch["labels"][1][batch["attention_mask"][1] == 0] == -100).all()


def test_long_prompt_is_cut_from_the_left_and_answer_kept(tok):
    ids, plen = encode_prompt_answer(tok, "abcdefghij", " xyz", max_len=8)
    assert len(ids) == 8 and plen == 4
    assert tok.decode(ids[:plen]) == "ghij"  # the end of the context survives
    assert tok.decode(ids[plen:]) == " xyz"


def test_option_batch_has_one_row_per_choice(tok):
    examples = synthetic_examples(3)
    items = [{"rows": [encode_prompt_answer(tok, e.context, c, 64) for c in e.choices],
              "gold": e.gold} for e in examples]
    batch = collate_options(items, pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape[0] == sum(len(e.choices) for e in examples)
    assert batch["example_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["choice_index"].tolist() == [0, 1, 0, 1, 0, 1]
    assert batch["gold"].tolist() == [e.gold for e in examples]
    row = 3  # example 1, choice 1
    labelled = batch["labels"][row] != -100
    assert tok.decode(batch["input_ids"][row][labelled]) == examples[1].choices[1]


def test_packing_concatenates_with_eos_and_drops_the_tail():
    blocks = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, eos_id=0)
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert pack_documents([[1, 2]], seq_len=4, eos_id=None).shape == (0, 4)


def test_cpt_split_keeps_documents_apart(tok):
    dm = SyntheticCPT(n_docs=30, seq_len=16, val_fraction=0.2, batch_size=2)
    dm.tokenizer = tok
    train, val = dm.train_dataset(), dm.val_dataset()
    assert len(train) > 0 and len(val) > 0
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16)
    assert torch.equal(batch["labels"], batch["input_ids"])  # CPT: loss on every token
    assert batch["attention_mask"].all()


def test_cpt_continuation_splits_each_block_into_prompt_and_scored_tail(tok):
    dm = SyntheticCPT(n_docs=30, seq_len=16, val_fraction=0.2, batch_size=2, continuation=5)
    dm.tokenizer = tok
    batch = next(iter(dm.train_dataloader()))
    prompt = batch["prompt_mask"]
    assert prompt.shape == (2, 16) and prompt[:, :11].all() and not prompt[:, 11:].any()
    # the loss sees exactly the last 5 tokens: the first of them predicted from the prompt's end
    assert (batch["labels"][:, :11] == -100).all()
    assert torch.equal(batch["labels"][:, 11:], batch["input_ids"][:, 11:])
    val = next(iter(dm.val_dataloader()))
    assert torch.equal(val["prompt_mask"][0], prompt[0])
    with pytest.raises(TrainingConfigError, match="data.continuation"):
        CPTDataModule(seq_len=16, continuation=15)


def test_sft_module_builds_train_and_option_batches(tok):
    dm = SyntheticSFT(n_train=8, n_val=4, batch_size=4, max_len=64)
    dm.tokenizer = tok
    train = next(iter(dm.train_dataloader()))
    assert set(train) == {"input_ids", "attention_mask", "labels", "prompt_mask"}
    val = next(iter(dm.val_dataloader()))
    assert val["gold"].shape == (4,) and val["input_ids"].shape[0] == 8


def test_sft_on_every_choice_labels_only_the_gold_rows_and_distils_all_answers(tok):
    dm = SyntheticSFT(n_train=6, n_val=2, batch_size=64, max_len=64, answers="all")
    examples = dm.examples("train", None)
    rows = list(dm.build_train(tok))
    assert len(rows) == sum(len(ex.choices) for ex in examples)
    batch = collate_sft(rows, pad_id=0)
    answer = batch["attention_mask"].bool() & ~batch["prompt_mask"]
    assert torch.equal(batch["distill_mask"], answer)
    gold_rows = torch.tensor([c == ex.gold for ex in examples for c in range(len(ex.choices))])
    assert torch.equal(batch["labels"] != -100, answer & gold_rows[:, None])
    # every row of an example is that prompt followed by one of its choices, in order
    prompts = {tuple(ids[:plen]) for ids, plen, _ in rows[:2]}
    assert len(prompts) == 1
    # the default trains on the gold answer alone, and its batches carry no distill_mask
    gold_only = SyntheticSFT(n_train=6, n_val=2, batch_size=64, max_len=64)
    assert len(gold_only.build_train(tok)) == len(examples)
    assert "distill_mask" not in collate_sft(list(gold_only.build_train(tok)), pad_id=0)


def test_sft_mixture_takes_each_tasks_own_part_with_a_per_task_limit(tok):
    from kvgate.data import load_sft_split

    mix = SFTDataModule(task=["openbookqa", "winogrande"], limit_train=5, limit_val=3)
    train, test = mix.examples("train", mix.limit_train), mix.examples("test", mix.limit_val)
    # each task contributes its own first examples of the part, in order, up to the limit
    obqa, wino = (load_sft_split(t, "train")[:5] for t in ("openbookqa", "winogrande"))
    assert [e.uid for e in train] == [e.uid for e in obqa + wino]
    # the test part alternates tasks, so a validation cut short still sees every task
    obqa, wino = (load_sft_split(t, "test")[:3] for t in ("openbookqa", "winogrande"))
    assert [e.uid for e in test] == [e.uid for pair in zip(obqa, wino) for e in pair]
    assert not {e.uid for e in train} & {e.uid for e in test}
    # validation pools both test parts: 3 four-choice OpenBookQA + 3 two-choice Winogrande
    mix.tokenizer = tok
    batches = list(mix.val_dataloader())
    assert sum(b["gold"].shape[0] for b in batches) == 6
    assert sum(b["input_ids"].shape[0] for b in batches) == 3 * 4 + 3 * 2


def test_resumable_sampler_skips_exactly_the_consumed_part():
    data = list(range(23))
    full = ResumableSampler(data, seed=3)
    full.set_epoch(2)
    order = list(full)
    resumed = ResumableSampler(data, seed=3)
    resumed.skip(epoch=2, samples=8)
    resumed.set_epoch(2)
    assert list(resumed) == order[8:]
    assert list(resumed) == order  # the skip applies once
    other = ResumableSampler(data, seed=3)
    other.set_epoch(3)
    assert list(other) != order  # a new epoch reshuffles
    shards = [list(ResumableSampler(data, num_replicas=2, rank=r, seed=3)) for r in (0, 1)]
    assert set(shards[0]) | set(shards[1]) == set(data)


def test_datamodule_state_round_trip_sets_the_skip(tok):
    dm = SyntheticCPT(n_docs=30, seq_len=16, val_fraction=0.0, batch_size=2, seed=5)
    dm.tokenizer = tok
    dm.load_state_dict({"epoch": 0, "batches": 3, "seed": 5})
    first = next(iter(dm.train_dataloader()))
    fresh = SyntheticCPT(n_docs=30, seq_len=16, val_fraction=0.0, batch_size=2, seed=5)
    fresh.tokenizer = tok
    batches = list(fresh.train_dataloader())
    assert torch.equal(first["input_ids"], batches[3]["input_ids"])
    with pytest.raises(TrainingConfigError, match="data.seed"):
        dm.load_state_dict({"epoch": 0, "batches": 3, "seed": 6})


@pytest.mark.parametrize("kwargs, key", [
    ({"seq_len": 1}, "data.seq_len"),
    ({"source": "files"}, "data.files"),
    ({"val_fraction": 1.5}, "data.val_fraction"),
    ({"batch_size": 0}, "data.batch_size"),
])
def test_cpt_config_errors_name_the_key(kwargs, key):
    with pytest.raises(TrainingConfigError, match=key):
        CPTDataModule(**kwargs)


def test_sft_config_errors_name_the_key():
    with pytest.raises(TrainingConfigError, match="data.task: unknown task.*'squad'"):
        SFTDataModule(task="squad")
    with pytest.raises(TrainingConfigError, match="data.task: unknown task.*'nope'"):
        SFTDataModule(task=["piqa", "nope"])
    with pytest.raises(TrainingConfigError, match="data.task: a task is listed twice"):
        SFTDataModule(task=["piqa", "piqa"])
    with pytest.raises(TrainingConfigError, match="data.task: give a task"):
        SFTDataModule(task=[])
    with pytest.raises(TrainingConfigError, match="data.limit_train"):
        SFTDataModule(limit_train=0)
    with pytest.raises(TrainingConfigError, match="data.answers"):
        SFTDataModule(answers="wrong")


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(TrainingConfigError, match="tokenizer"):
        SyntheticCPT().train_dataloader()


def test_sft_fewshot_prompts_take_demonstrations_from_the_train_part_only(tok):
    from kvgate.data import load_sft_split

    plain = SFTDataModule(task="copa", limit_train=6, limit_val=4)
    shots = SFTDataModule(task="copa", limit_train=6, limit_val=4, num_fewshot=2)
    train_pool = load_sft_split("copa", "train")
    solved = {ex.context + ex.choices[ex.gold] for ex in train_pool}
    for part, limit in (("train", 6), ("test", 4)):
        zero, two = plain.examples(part, limit), shots.examples(part, limit)
        assert [e.uid for e in zero] == [e.uid for e in two]
        for z, t in zip(zero, two):
            # the example's own context ends the prompt; its choices and gold are untouched
            assert t.context.endswith("\n\n" + z.context)
            assert (t.choices, t.gold) == (z.choices, z.gold)
            demos = t.context[: -len(z.context)].split("\n\n")[:-1]
            assert len(demos) == 2 and all(d in solved for d in demos)
            assert z.context + z.choices[z.gold] not in demos  # never its own answer
    # the same draw every time it is built
    assert [e.context for e in shots.examples("train", 6)] == [
        e.context for e in SFTDataModule(task="copa", limit_train=6, num_fewshot=2)
        .examples("train", 6)]
    shots.tokenizer = tok
    rows = list(shots.build_train(tok))
    zero_rows = list(plain.build_train(tok))
    assert all(len(r[0]) > len(z[0]) for r, z in zip(rows, zero_rows))


def test_sft_fewshot_config_error_names_the_key():
    with pytest.raises(TrainingConfigError, match="data.num_fewshot"):
        SFTDataModule(num_fewshot=-1)
    with pytest.raises(TrainingConfigError, match="data.num_fewshot"):
        SFTDataModule(num_fewshot=1.5)
