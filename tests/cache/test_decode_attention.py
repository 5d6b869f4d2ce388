"""multipart_attention equals one masked SDPA over the concatenated parts."""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from kvgate.attention.decode import KVPart, multipart_attention


def test_parts_equal_masked_sdpa_over_the_concatenation():
    g = torch.Generator().manual_seed(0)
    b, hk, grp, r, d = 2, 2, 3, 4, 8
    q = torch.randn(b, hk * grp, r, d, generator=g)
    k1, v1 = torch.randn(b, hk, 9, d, generator=g), torch.randn(b, hk, 9, d, generator=g)
    k2, v2 = torch.randn(b, hk, 5, d, generator=g), torch.randn(b, hk, 5, d, generator=g)
    vis1 = torch.rand(b, hk, 1, 9, generator=g) > 0.3  # per KV head, same for every row
    vis2 = torch.rand(b, 1, r, 5, generator=g) > 0.3  # per row, same for every head
    vis1[0, 1] = False
    vis2[0, :, 2] = False  # row 2 of sample 0 / KV head 1 sees nothing at all
    out, logits = multipart_attention(q, [KVPart(k1, v1, vis1), KVPart(k2, v2, None)], 0.3,
                                      return_logits=True)
    out2, _ = multipart_attention(q, [KVPart(k1, v1, vis1), KVPart(k2, v2, vis2)], 0.3)
    keys = torch.cat([k1, k2], 2).repeat_interleave(grp, 1)
    values = torch.cat([v1, v2], 2).repeat_interleave(grp, 1)
    for o, second in ((out, torch.ones(b, 1, r, 5, dtype=torch.bool)), (out2, vis2)):
        mask = torch.cat([vis1.expand(b, hk, r, 9), second.expand(b, hk, r, 5)], -1)
        mask = mask.repeat_interleave(grp, 1)
        ref = scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(o, ref.transpose(1, 2), atol=1e-5, rtol=0)
    assert out.shape == (b, r, hk * grp, d)
    # logits: raw scaled scores, -inf exactly where hidden
    raw = torch.matmul(q, keys.transpose(-1, -2)) * 0.3
    hidden = ~torch.cat([vis1.expand(b, hk, r, 9), torch.ones(b, hk, r, 5, dtype=torch.bool)],
                        -1).repeat_interleave(grp, 1)
    assert torch.isinf(logits[hidden]).all()
    torch.testing.assert_close(logits[~hidden], raw[~hidden], atol=1e-5, rtol=0)
    # a row that sees nothing gives zeros, not NaN
    assert torch.equal(out2[0, 2, 3:6], torch.zeros(3, d))
