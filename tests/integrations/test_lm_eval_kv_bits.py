"""lm-eval's ``--model kvgate`` with ``kv_bits=8`` / ``4``: the scores come from quantized caches
(close to, and not equal to, the 16-bit ones), the model arguments arrive as lm-eval's text,
and a bad value is a one-line kvgate error."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance
from training.kvtrain_fixtures import save_tiny_base

from kvgate.errors import KVGateError
from kvgate.integrations.lm_eval.model import KVGateLM, LMEvalError

CONTEXT = "Question: what keeps a door shut in the wind when the latch is broken?\nAnswer:"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return save_tiny_base(tmp_path_factory.mktemp("lm_eval_kv") / "llama")


def _loglik(lm: KVGateLM, pairs: list[tuple[str, str]]) -> list[float]:
    requests = [Instance("loglikelihood", doc={}, arguments=p, idx=i)
                for i, p in enumerate(pairs)]
    return [ll for ll, _ in lm.loglikelihood(requests)]


def test_kv_bits_model_arguments_score_over_quantized_caches(base):
    pairs = [(CONTEXT, " a brick"), (CONTEXT, " the wind itself")]
    full = _loglik(KVGateLM(pretrained=base, policy="snapkv", budget=0.5, window=4), pairs)
    for bits in ("8", "4"):  # as lm-eval's --model_args hands them: text
        lm = KVGateLM(pretrained=base, policy="snapkv", budget=0.5, window=4, kv_bits=bits,
                      kv_group="8", kv_residual="4")
        assert lm.engine.kv.bits == int(bits) and lm.engine.kv.residual == 4
        got = _loglik(lm, pairs)
        assert got != full and got == pytest.approx(full, rel=0.05)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"kv_bits": "eight"}, LMEvalError, "kv_bits must be an integer, got 'eight'"),
    ({"kv_bits": 3}, KVGateError, "kv_bits must be 16, 8 or 4, got 3"),
    ({"kv_bits": 8, "kv_group": "5"}, KVGateError, "kv_group 5 does not split heads"),
])
def test_bad_kv_arguments_are_one_line(base, kwargs, error, message):
    with pytest.raises(error, match=message) as err:
        KVGateLM(pretrained=base, policy="full", **kwargs)
    assert "\n" not in str(err.value)
