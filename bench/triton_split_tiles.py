"""A variant of ``kvgate.attention.triton_tiles`` under measurement (issue #48): the kernels
of commit 8fce702 as they were, each key or query tile's body in a helper and each loop split in
two, launched with ``FAR=False`` so the first loop of every pair is empty. That build ran
1.37-1.49x SDPA flash's time on an H100 where the package's kernel (the same arithmetic in one
loop, no helpers) ran 1.70-1.80x on another: ``bench_kernel --triton`` times both in one process
(``triton_split_bf16`` beside ``triton_bf16``) to tell the structure from the machine. The
``FAR=True`` bodies are never run (their dk was wrong in compiled bf16: experiments/LOG.md 8g).
Whichever is slower is deleted after that measurement."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

if triton is not None:
    # the helpers both sets share
    from kvgate.attention.triton_tiles import (
        _first_key,
        _program_tile,
        _tile,
        _visible_and_gated,
    )

    @triton.jit
    def _far_keys_end(row0, offset, window, BLOCK_N: tl.constexpr, FAR: tl.constexpr):
        """End of the key tiles that query rows row0 .. row0 + BLOCK_M see by their keep flags
        alone: every key of the tile is causal and outside every row's recent band. Only with
        the plain causal mask and no prompt (``FAR``); 0 (no such tile) otherwise."""
        end = 0
        if FAR:
            end = (tl.maximum(offset + row0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        return end

    @triton.jit
    def _far_rows_start(col0, offset, window, first, nq, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, FAR: tl.constexpr):
        """First query tile (at or after ``first``) whose rows see keys col0 .. col0 + BLOCK_N
        by their keep flags alone (the mirror of ``_far_keys_end``); ``nq`` when none or not
        ``FAR``."""
        start = nq
        if FAR:
            edge = tl.maximum(col0 + BLOCK_N - 1 + window - offset, 0)
            start = tl.minimum(tl.maximum(((edge + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, first),
                               nq)
        return start

    @triton.jit
    def _forward_tile(acc, m_i, l_i, q, c0, b, hk, hg, rows, pos, nq, n, window, dims, dim_ok,
                      K, V, KEEP, LO, HI, MASK, PROMPT, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                      s_keep_b, s_keep_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b, scale2,
                      BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                      PRECISION: tl.constexpr, FAR: tl.constexpr):
        """One key tile of the online softmax; ``FAR``: a tile every row sees by keep flags
        alone (``_far_keys_end``), so the per-element mask rules are skipped."""
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        k = _tile(K, b, hk, s_k_b, s_k_h, s_k_n, cols, col_ok, dims, dim_ok)
        keep = tl.load(KEEP + b * s_keep_b + hg * s_keep_h + cols, mask=col_ok, other=0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        if FAR:
            s = tl.where(keep[None, :] != 0, s, float("-inf"))
        else:
            _, visible, _ = _visible_and_gated(b, rows, pos, cols, nq, n, window, keep, LO, HI,
                                               MASK, PROMPT, s_lo_b, s_mask_b, s_mask_m,
                                               s_prompt_b, MASK_MODE, HAS_PROMPT)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(V, b, hk, s_v_b, s_v_h, s_v_n, cols, col_ok, dims, dim_ok)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _forward(Q, K, V, KEEP, LO, HI, MASK, PROMPT, O, LSE,
                 s_q_b, s_q_h, s_q_m, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                 s_o_b, s_o_h, s_o_m, s_keep_b, s_keep_h, s_lse_b, s_lse_h,
                 s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                 H, nq, n, offset, scale2, window, group, keep_group,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                 PRECISION: tl.constexpr, FAR: tl.constexpr):
        pid_m, b, h, rows, row_ok, dims, dim_ok = _program_tile(H, nq, D, BLOCK_D, BLOCK_M)
        hk = h // group
        hg = h // keep_group
        pos = offset + rows
        q = _tile(Q, b, h, s_q_b, s_q_h, s_q_m, rows, row_ok, dims, dim_ok)
        # finite start: a tile with no visible key in some row must not give exp(-inf + inf)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        start = _first_key(b, pid_m * BLOCK_M, nq, offset, LO, s_lo_b, BLOCK_M, BLOCK_N,
                           MASK_MODE)
        stop = tl.minimum(n, offset + (pid_m + 1) * BLOCK_M)  # causal: no tile above the diagonal
        # two loops, as FlashAttention's causal kernels split off the diagonal: the tiles far
        # below it need only the keep flags, the rest the full mask rules
        far_end = tl.maximum(_far_keys_end(pid_m * BLOCK_M, offset, window, BLOCK_N, FAR), start)
        for c0 in range(start, far_end, BLOCK_N):
            acc, m_i, l_i = _forward_tile(
                acc, m_i, l_i, q, c0, b, hk, hg, rows, pos, nq, n, window, dims, dim_ok,
                K, V, KEEP, LO, HI, MASK, PROMPT, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                s_keep_b, s_keep_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b, scale2,
                BLOCK_N, MASK_MODE, HAS_PROMPT, PRECISION, True)
        for c0 in range(far_end, stop, BLOCK_N):
            acc, m_i, l_i = _forward_tile(
                acc, m_i, l_i, q, c0, b, hk, hg, rows, pos, nq, n, window, dims, dim_ok,
                K, V, KEEP, LO, HI, MASK, PROMPT, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                s_keep_b, s_keep_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b, scale2,
                BLOCK_N, MASK_MODE, HAS_PROMPT, PRECISION, False)
        l_i = tl.where(row_ok, l_i, 1.0)  # rows past the end see nothing: no 0 / 0
        acc = acc / l_i[:, None]
        tl.store(O + b * s_o_b + h * s_o_h + rows[:, None] * s_o_m + dims[None, :],
                 acc.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        # base-2 log-sum-exp of the scaled scores
        tl.store(LSE + b * s_lse_b + h * s_lse_h + rows, m_i + tl.log2(l_i), mask=row_ok)

    @triton.jit
    def _backward_kv_tile(dk, dv, dg, k, v, keep, r0, b, h, cols, nq, n, offset, window,
                          dims, dim_ok, Q, DO, LSE, DELTA, LO, HI, MASK, PROMPT,
                          s_q_b, s_q_h, s_q_m, s_do_b, s_do_h, s_do_m, s_lse_b, s_lse_h,
                          s_lo_b, s_mask_b, s_mask_m, s_prompt_b, scale2, clamp2,
                          BLOCK_M: tl.constexpr, MASK_MODE: tl.constexpr,
                          HAS_PROMPT: tl.constexpr, PRECISION: tl.constexpr, FAR: tl.constexpr):
        """One query tile's share of a key tile's dk, dv and gate gradient; ``FAR``: rows that
        see these keys by keep flags alone (``_far_rows_start``)."""
        rows = r0 + tl.arange(0, BLOCK_M)
        pos = offset + rows
        row_ok = rows < nq
        q = _tile(Q, b, h, s_q_b, s_q_h, s_q_m, rows, row_ok, dims, dim_ok)
        do = _tile(DO, b, h, s_do_b, s_do_h, s_do_m, rows, row_ok, dims, dim_ok)
        lse = tl.load(LSE + b * s_lse_b + h * s_lse_h + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + b * s_lse_b + h * s_lse_h + rows, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        resid = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
        if FAR:
            # every element is gated and allowed; rows past nq load zeros (dO = 0, D = 0), so
            # they add nothing without a row mask
            pt = tl.exp2(tl.minimum(s - lse[:, None], clamp2))
            p = tl.where(keep[None, :] != 0, pt, 0.0)
            dg += tl.sum(pt * resid, 0)
        else:
            base, visible, gated = _visible_and_gated(
                b, rows, pos, cols, nq, n, window, keep, LO, HI, MASK, PROMPT, s_lo_b,
                s_mask_b, s_mask_m, s_prompt_b, MASK_MODE, HAS_PROMPT)
            # P~ for every key the base mask allows, kept or evicted; a visible key has
            # s <= lse, so the clamp never touches the true probabilities
            pt = tl.where(base, tl.exp2(tl.minimum(s - lse[:, None], clamp2)), 0.0)
            p = tl.where(visible, pt, 0.0)
            dg += tl.sum(tl.where(gated, pt * resid, 0.0), 0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        ds = p * resid
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        return dk, dv, dg

    @triton.jit
    def _backward_kv(Q, K, V, KEEP, LO, HI, MASK, PROMPT, DO, LSE, DELTA, DK, DV, DG,
                     s_q_b, s_q_h, s_q_m, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                     s_do_b, s_do_h, s_do_m, s_keep_b, s_keep_h, s_lse_b, s_lse_h,
                     s_dk_b, s_dk_h, s_dk_n, s_dv_b, s_dv_h, s_dv_n, s_dg_b, s_dg_h,
                     s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                     Hk, nq, n, offset, scale, scale2, clamp2, window, group, keep_group,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                     KEEP_PER_QUERY_HEAD: tl.constexpr, PRECISION: tl.constexpr,
                     FAR: tl.constexpr):
        pid_n, b, hk, cols, col_ok, dims, dim_ok = _program_tile(Hk, n, D, BLOCK_D, BLOCK_N)
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = _tile(K, b, hk, s_k_b, s_k_h, s_k_n, cols, col_ok, dims, dim_ok)
        v = _tile(V, b, hk, s_v_b, s_v_h, s_v_n, cols, col_ok, dims, dim_ok)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dg_group = tl.zeros([BLOCK_N], dtype=tl.float32)
        # the first query row that can see a key of this tile (causal: position >= its column)
        first = tl.maximum(pid_n * BLOCK_N - offset, 0)
        first = (first // BLOCK_M) * BLOCK_M
        # the query tiles near the diagonal under the full mask rules, the rest by keep flags
        far = _far_rows_start(pid_n * BLOCK_N, offset, window, first, nq, BLOCK_M, BLOCK_N, FAR)
        for gi in range(group):
            h = hk * group + gi
            hg = h // keep_group
            keep = tl.load(KEEP + b * s_keep_b + hg * s_keep_h + cols, mask=col_ok, other=0)
            dg = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r0 in range(first, far, BLOCK_M):
                dk, dv, dg = _backward_kv_tile(
                    dk, dv, dg, k, v, keep, r0, b, h, cols, nq, n, offset, window, dims, dim_ok,
                    Q, DO, LSE, DELTA, LO, HI, MASK, PROMPT, s_q_b, s_q_h, s_q_m, s_do_b,
                    s_do_h, s_do_m, s_lse_b, s_lse_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                    scale2, clamp2, BLOCK_M, MASK_MODE, HAS_PROMPT, PRECISION, False)
            for r0 in range(far, nq, BLOCK_M):
                dk, dv, dg = _backward_kv_tile(
                    dk, dv, dg, k, v, keep, r0, b, h, cols, nq, n, offset, window, dims, dim_ok,
                    Q, DO, LSE, DELTA, LO, HI, MASK, PROMPT, s_q_b, s_q_h, s_q_m, s_do_b,
                    s_do_h, s_do_m, s_lse_b, s_lse_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                    scale2, clamp2, BLOCK_M, MASK_MODE, HAS_PROMPT, PRECISION, True)
            if KEEP_PER_QUERY_HEAD:
                tl.store(DG + b * s_dg_b + h * s_dg_h + cols, dg, mask=col_ok)
            else:
                dg_group += dg
        if not KEEP_PER_QUERY_HEAD:
            tl.store(DG + b * s_dg_b + hk * s_dg_h + cols, dg_group, mask=col_ok)
        tl.store(DK + b * s_dk_b + hk * s_dk_h + cols[:, None] * s_dk_n + dims[None, :],
                 (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + b * s_dv_b + hk * s_dv_h + cols[:, None] * s_dv_n + dims[None, :],
                 dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _backward_q_tile(dq, q, do, lse, delta, c0, b, hk, hg, rows, pos, nq, n, window, dims,
                         dim_ok, K, V, KEEP, LO, HI, MASK, PROMPT, s_k_b, s_k_h, s_k_n, s_v_b,
                         s_v_h, s_v_n, s_keep_b, s_keep_h, s_lo_b, s_mask_b, s_mask_m,
                         s_prompt_b, scale2, BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr,
                         HAS_PROMPT: tl.constexpr, PRECISION: tl.constexpr, FAR: tl.constexpr):
        """One key tile's share of a query tile's dq; ``FAR`` as in ``_forward_tile``."""
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        k = _tile(K, b, hk, s_k_b, s_k_h, s_k_n, cols, col_ok, dims, dim_ok)
        v = _tile(V, b, hk, s_v_b, s_v_h, s_v_n, cols, col_ok, dims, dim_ok)
        keep = tl.load(KEEP + b * s_keep_b + hg * s_keep_h + cols, mask=col_ok, other=0)
        if FAR:
            visible = keep[None, :] != 0
        else:
            _, visible, _ = _visible_and_gated(b, rows, pos, cols, nq, n, window, keep, LO, HI,
                                               MASK, PROMPT, s_lo_b, s_mask_b, s_mask_m,
                                               s_prompt_b, MASK_MODE, HAS_PROMPT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        resid = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
        ds = p * resid
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        return dq

    @triton.jit
    def _backward_q(Q, K, V, KEEP, LO, HI, MASK, PROMPT, DO, LSE, DELTA, DQ,
                    s_q_b, s_q_h, s_q_m, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                    s_do_b, s_do_h, s_do_m, s_keep_b, s_keep_h, s_lse_b, s_lse_h,
                    s_dq_b, s_dq_h, s_dq_m, s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                    H, nq, n, offset, scale, scale2, window, group, keep_group,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                    PRECISION: tl.constexpr, FAR: tl.constexpr):
        pid_m, b, h, rows, row_ok, dims, dim_ok = _program_tile(H, nq, D, BLOCK_D, BLOCK_M)
        hk = h // group
        hg = h // keep_group
        pos = offset + rows
        q_mask = row_ok[:, None] & dim_ok[None, :]
        q = _tile(Q, b, h, s_q_b, s_q_h, s_q_m, rows, row_ok, dims, dim_ok)
        do = _tile(DO, b, h, s_do_b, s_do_h, s_do_m, rows, row_ok, dims, dim_ok)
        lse = tl.load(LSE + b * s_lse_b + h * s_lse_h + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + b * s_lse_b + h * s_lse_h + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        start = _first_key(b, pid_m * BLOCK_M, nq, offset, LO, s_lo_b, BLOCK_M, BLOCK_N,
                           MASK_MODE)
        stop = tl.minimum(n, offset + (pid_m + 1) * BLOCK_M)
        far_end = tl.maximum(_far_keys_end(pid_m * BLOCK_M, offset, window, BLOCK_N, FAR), start)
        for c0 in range(start, far_end, BLOCK_N):
            dq = _backward_q_tile(
                dq, q, do, lse, delta, c0, b, hk, hg, rows, pos, nq, n, window, dims, dim_ok,
                K, V, KEEP, LO, HI, MASK, PROMPT, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                s_keep_b, s_keep_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b, scale2,
                BLOCK_N, MASK_MODE, HAS_PROMPT, PRECISION, True)
        for c0 in range(far_end, stop, BLOCK_N):
            dq = _backward_q_tile(
                dq, q, do, lse, delta, c0, b, hk, hg, rows, pos, nq, n, window, dims, dim_ok,
                K, V, KEEP, LO, HI, MASK, PROMPT, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                s_keep_b, s_keep_h, s_lo_b, s_mask_b, s_mask_m, s_prompt_b, scale2,
                BLOCK_N, MASK_MODE, HAS_PROMPT, PRECISION, False)
        tl.store(DQ + b * s_dq_b + h * s_dq_h + rows[:, None] * s_dq_m + dims[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


if triton is not None:
    from kvgate.attention.triton_kernel import TileKernels

    KERNELS = TileKernels(_forward, _backward_kv, _backward_q, {"FAR": False})
