"""KVzip (and KVzip+): scores against explicit attention over the repeat pass, a cache with
nothing of the pass left behind, and the policy through the engine and the eval flags."""

from __future__ import annotations

import pytest
import torch
from conftest import build, build_causal_lm, tiny_llama_config, tiny_qwen3_config
from inference.engine_toys import char_tokenizer

from kvgate.cache import CompressedCache
from kvgate.cache.errors import CacheError
from kvgate.inference import Engine
from kvgate.inference.compress import asker
from kvgate.inference.decode import left_padded_positions
from kvgate.policies import Budget, KVzip, PassScoring, Policy, PolicyError, get_policy
from kvgate.policies.kvzip import FIRST, LATER

CHUNK = 16


class Spy(KVzip):
    """KVzip that records what its all-layer choice saw and returned."""

    def choose(self, scores, valid, budget):
        self.seen = (scores.clone(), valid.clone())
        self.kept = super().choose(scores, valid, budget)
        return self.kept


def model_of(family: str) -> torch.nn.Module:
    return build(tiny_llama_config()) if family == "llama" else build_causal_lm(tiny_qwen3_config())


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, n - len(r):], mask[i, n - len(r):] = torch.tensor(r), 1
    return ids, mask


def contexts(seed: int = 0) -> list[list[int]]:
    """Two contexts of three and two chunks (random printable characters)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 98, (40,), generator=gen).tolist(),
            torch.randint(4, 98, (27,), generator=gen).tolist()]


def repeat_passes(tok, ctx: list[int]) -> list[list[int]]:
    """The repeat pass of one context written out: plain requests (no chat template), chunks
    of ``CHUNK``, each later one prompted with the previous chunk's last 8 tokens."""
    enc = (lambda text: tok(text, add_special_tokens=False)["input_ids"])
    chunks = [ctx[i:i + CHUNK] for i in range(0, len(ctx), CHUNK)]
    return [(enc("\n\n" + FIRST) if c == 0 else enc("\n\n" + LATER) + chunks[c - 1][-8:])
            + enc("\n") + chunk for c, chunk in enumerate(chunks)]


@torch.no_grad()
def brute_force(family: str, ctx: list[int], passes: list[list[int]], plus: bool) -> torch.Tensor:
    """[L, H_kv, n]: for every pass, the whole sequence (context + pass) through the model with
    eager attention; each context entry's largest attention probability from any pass row and
    any query head of its group (KVzip+: times ||W_O^h v_i|| / ||h_j||), max over passes."""
    model = model_of(family)
    model.set_attn_implementation("eager")
    cfg = model.config
    layers, h, hk = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    d, n = cfg.head_dim, len(ctx)
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: inputs.__setitem__(i, kwargs["hidden_states"]),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    out = torch.zeros(layers, hk, n)
    for p in passes:
        attn = model(torch.tensor([ctx + p]), output_attentions=True).attentions
        for layer in range(layers):  # the slow way on purpose
            a = attn[layer][0, :, n:, :n].clone()  # [H, pass rows, context]
            if plus:
                mod = model.model.layers[layer].self_attn
                hid = inputs[layer][0]  # [N, D] normalised layer input
                v = mod.v_proj(hid)[:n].view(n, hk, d)
                for head in range(h):
                    w_o = mod.o_proj.weight[:, head * d:(head + 1) * d]
                    a[head] *= (v[:, head // (h // hk)] @ w_o.T).norm(dim=-1)[None, :]
                a /= hid[n:].norm(dim=-1)[None, :, None]
            best = a.amax(1).view(hk, h // hk, n).amax(1)
            out[layer] = torch.maximum(out[layer], best)
    for hook in hooks:
        hook.remove()
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("plus", [False, True])
def test_scores_equal_explicit_attention_over_the_repeat_pass(family, plus):
    """GQA (4 query heads over 2 KV heads), a left-padded batch of 40 and 27 tokens in chunks
    of 16 (the shorter sample has an all-padding row in the third pass)."""
    tok, rows = char_tokenizer(), contexts()
    ids, mask = left_padded(rows)
    spy = Spy(chunk=CHUNK, plus=plus)
    Engine(model_of(family), tok, spy, 0.5).prefill(ids, mask)
    scores, valid = spy.seen
    assert torch.equal(valid.sum(-1), mask.sum(-1))
    for b, ctx in enumerate(rows):
        want = brute_force(family, ctx, repeat_passes(tok, ctx), plus)
        got = scores[:, b, :, :len(ctx)]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert not scores[:, b, :, len(ctx):].any()  # padding slots hold nothing
    assert (scores[:, :, 0] != scores[:, :, 1]).any()  # KV heads score their own entries


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_repeat_pass_leaves_nothing_behind(family):
    """The cache after KVzip equals one filled by a plain keep mask of the same entries: the
    same stored keys, values, positions, counts and lengths, no tail, the same bytes, and the
    same logits for the next tokens."""
    tok, rows = char_tokenizer(), contexts(1)
    ids, mask = left_padded(rows)
    model = model_of(family)
    spy = Spy(chunk=CHUNK, sinks=2)
    _, cache = Engine(model, tok, spy, 0.4).prefill(ids, mask)
    n = ids.shape[1]
    pad = n - mask.sum(-1)
    slots = torch.arange(n)[None, :] - pad[:, None]  # [B, n] slot of each prompt position
    masks = [k.gather(-1, slots.clamp(min=0)[:, None, :].expand(-1, k.shape[1], -1))
             & mask.bool()[:, None, :] for k in spy.kept]

    class Fixed(Policy):
        name = "fixed"

        def keep(self, prompt, budget):
            return masks[prompt.layer_idx]

    plain = CompressedCache(model, Fixed(), 1.0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=left_padded_positions(mask),
              past_key_values=plain, use_cache=True)
    assert not cache.awaiting_passes
    for a, b in zip(cache.layers, plain.layers):
        sa, sb = a.store, b.store
        assert sa.tail_len == 0 and sb.tail_len == 0
        for name in ("keys", "values", "pos", "counts"):
            assert torch.equal(getattr(sa, name), getattr(sb, name)), name
        assert a.seen == b.seen == n and torch.equal(a.real_seen, b.real_seen)
        assert torch.equal(a.capacity, b.capacity) and a.scores is None and not a.stats
    assert cache.bytes_held() == plain.bytes_held()
    assert cache.get_seq_length() == plain.get_seq_length() == n
    step = torch.tensor([[5, 6], [7, 8]])
    full = torch.cat([mask, torch.ones_like(step)], dim=1)
    pos = mask.sum(-1, keepdim=True) + torch.arange(2)
    with torch.no_grad():
        outs = [model(input_ids=step, attention_mask=full, position_ids=pos, past_key_values=c,
                      use_cache=True).logits for c in (cache, plain)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_kept_entries_are_the_sinks_plus_the_top_scores_per_head():
    tok, rows = char_tokenizer(), contexts(2)
    ids, mask = left_padded(rows)
    spy = Spy(chunk=CHUNK)
    budget = Budget(ratio=0.3)
    _, cache = Engine(build(tiny_llama_config()), tok, spy, budget).prefill(ids, mask)
    scores, valid = spy.seen
    kept = budget.per_sample(valid.sum(-1))
    for layer in range(scores.shape[0]):
        assert torch.equal(cache.kept_counts(layer), kept[:, None].expand(-1, 2))
        for b, k in enumerate(kept.tolist()):
            for h in range(2):  # the slow way on purpose
                real = int(valid[b].sum())
                order = sorted(range(4, real), key=lambda t: (-float(scores[layer, b, h, t]), t))
                want = set(range(4)) | set(order[:k - 4])
                got = set(cache.layers[layer].store.slot_positions()[b, h].tolist()) - {-1}
                assert got == want


def test_through_generate_with_the_chat_template_and_the_eval_flags(tmp_path):
    """Engine.generate runs KVzip (plus, global) end to end; the repeat request goes through
    the chat template where there is one; ruler and needle take ``kvzip`` and its options."""
    tok = char_tokenizer()
    model = build(tiny_llama_config())
    for options in ({}, {"plus": True, "allocation": "global", "chunk": 8}):
        engine = Engine(model, tok, "kvzip", 0.5, policy_options=options)
        res = engine.generate(["a first prompt of some length", "second"], max_new_tokens=3)
        assert res.stats.policy == "kvzip" and 0.4 < res.stats.kept_fraction < 0.7
        assert all(len(row) == 3 for row in res.token_ids)
    enc = (lambda text: tok(text, add_special_tokens=False)["input_ids"])
    assert asker(tok, False)("Go", [9]) == enc("\n\nGo") + [9] + enc("\n")
    tok.chat_template = ("{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    assert asker(tok, True)("Go", [9]) == enc("Go") + [9] + enc("]>")
    compressed = Engine(model, tok, "kvzip", 0.5).compress("some context to compress")
    assert compressed.chat and 0.4 < compressed.kept_fraction < 0.7

    from kvgate.cli.evaluate import build_parser, config_from_args
    from kvgate.eval.config import parse_policies

    for command in ("ruler", "needle"):
        args = build_parser().parse_args([command, "--model", "x", "--out", str(tmp_path),
                                          "--policies", "full,kvzip,kz=kvzip",
                                          "--policy-opt", "kz.plus=true",
                                          "--policy-opt", "kz.allocation=global"])
        policies = config_from_args(args).build_policies()
        assert isinstance(policies["kvzip"], KVzip) and not policies["kvzip"].plus
        assert policies["kz"].plus and policies["kz"].allocation == "global"
    assert "kvzip" in parse_policies("all")


def test_a_cache_refuses_new_tokens_until_the_passes_ran():
    model = build(tiny_llama_config())
    cache = CompressedCache(model, KVzip(), 0.5)
    ids = torch.randint(4, 98, (1, 12))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache.awaiting_passes and cache.kept_fraction() == 1.0
        with pytest.raises(CacheError, match="extra passes"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    with pytest.raises(PolicyError, match="needs the tokenizer"):
        Engine(model, None, "kvzip", 0.5).prefill(ids)
    assert isinstance(KVzip(), PassScoring) and KVzip().needs_attention


@pytest.mark.parametrize("options, message", [
    ({"chunk": 0}, "kvzip.chunk: must be an integer >= 1"),
    ({"chunk": 1.5}, "kvzip.chunk: must be an integer >= 1"),
    ({"sinks": -1}, "kvzip.sinks: must be an integer >= 0"),
    ({"plus": "yes"}, "kvzip.plus: must be true or false"),
    ({"allocation": "layer"}, "kvzip.allocation: must be one of head, global"),
    ({"window": 3}, "policy 'kvzip' has no option 'window'"),
])
def test_bad_options_fail_in_one_line(options, message):
    with pytest.raises(PolicyError) as err:
        get_policy("kvzip", **options)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("rows", [512, 5])
def test_the_one_shot_stand_in_keeps_sinks_and_top_self_attention(monkeypatch, rows):
    """Without a repeat pass (masked scoring) ``keep`` reads the prompt as its own pass (in
    blocks of ``rows`` prompt rows)."""
    from policy_testing import make_prompt

    import kvgate.policies.kvzip as kvzip_module
    from kvgate.policies.base import causal_probs

    monkeypatch.setattr(kvzip_module, "_ROWS", rows)

    prompt = make_prompt(lengths=(24, 17), heads=4, kv_heads=2)
    keep = KVzip(sinks=2).keep(prompt, Budget(tokens=8))
    probs = causal_probs(prompt.query, prompt.key, prompt.valid, prompt.scaling)
    score = probs.amax(2).view(2, 2, 2, -1).amax(2)
    for b, n_real in enumerate((24, 17)):
        start = 24 - n_real
        for h in range(2):
            rest = sorted(range(start + 2, 24), key=lambda t: (-float(score[b, h, t]), t))
            want = {start, start + 1} | set(rest[:6])
            assert set(keep[b, h].nonzero().flatten().tolist()) == want
