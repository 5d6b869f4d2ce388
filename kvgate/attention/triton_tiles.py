"""The Triton kernels of ``kvgate.attention.triton_kernel`` (read its docstring for the method):
the forward, the key-tile backward (dk, dv, the gate gradient) and the query-tile backward (dq),
each program one tile of one (batch, head), and the backward's row term. Every operand is read
through its strides (the head dimension's must be 1). Loaded only where triton is installed."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

if triton is not None:

    @triton.jit
    def _tile(PTR, b, head, s_b, s_h, s_n, idx, idx_ok, dims, dim_ok):
        """Rows ``idx`` of one (batch, head) slice of a [B, H, n, d] tensor, zeros outside."""
        return tl.load(PTR + b * s_b + head * s_h + idx[:, None] * s_n + dims[None, :],
                       mask=idx_ok[:, None] & dim_ok[None, :], other=0.0)

    @triton.jit
    def _along(x, AXIS: tl.constexpr):
        """A vector ``x`` [m] spread along axis ``AXIS`` of a 2-D tile: [m, 1] or [1, m]."""
        if AXIS == 0:
            out = x[:, None]
        else:
            out = x[None, :]
        return out

    @triton.jit
    def _visible_and_gated(b, rows, pos, cols, nq, n, window, keep,
                           LO, HI, MASK, PROMPT, s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                           MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                           KEYS_FIRST: tl.constexpr = False):
        """(base, visible, gated) for query rows ``rows`` (positions ``pos``) over keys ``cols``:
        the rules of ``kvgate.attention.gated._chunk_masks`` element by element, as [BM, BN]
        tiles, or [BN, BM] with ``KEYS_FIRST`` (the key-tile backward's orientation)."""
        QA: tl.constexpr = 1 if KEYS_FIRST else 0  # the axis queries run along
        KA: tl.constexpr = 0 if KEYS_FIRST else 1
        in_rows, in_cols = rows < nq, cols < n
        row_ok = _along(in_rows, QA)
        col_ok = _along(in_cols, KA)
        q_pos = _along(pos, QA)
        k_col = _along(cols, KA)
        causal = k_col <= q_pos
        if MASK_MODE == 1:
            lo = tl.load(LO + b * s_lo_b + rows, mask=in_rows, other=0)
            hi = tl.load(HI + b * s_lo_b + rows, mask=in_rows, other=-1)
            base = causal & (k_col >= _along(lo, QA)) & (k_col <= _along(hi, QA))
        elif MASK_MODE == 2:
            m = tl.load(MASK + b * s_mask_b + _along(rows, QA) * s_mask_m + k_col,
                        mask=row_ok & col_ok, other=0)
            base = causal & (m != 0)
        else:
            base = causal
        base = (base | (k_col == q_pos)) & row_ok & col_ok
        ungated = causal & (q_pos - k_col < window)
        if HAS_PROMPT:
            pr = tl.load(PROMPT + b * s_prompt_b + pos, mask=in_rows, other=0)
            pc = tl.load(PROMPT + b * s_prompt_b + cols, mask=in_cols, other=1)
            ungated = ungated | (_along(pr, QA) != 0) | (_along(pc, KA) == 0)
        visible = base & (ungated | (_along(keep, KA) != 0))
        gated = base & (ungated == 0)
        return base, visible, gated

    @triton.jit
    def _first_key(b, row0, nq, offset, LO, s_lo_b, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr):
        """First key tile any of the query rows row0 .. row0 + BLOCK_M can see."""
        start = 0
        if MASK_MODE == 1:
            rows = row0 + tl.arange(0, BLOCK_M)
            lo = tl.load(LO + b * s_lo_b + rows, mask=rows < nq, other=2147483647)
            # the diagonal is always visible, also in a padding row whose run is empty
            start = tl.minimum(tl.min(lo, 0), offset + row0)
            start = (start // BLOCK_N) * BLOCK_N
        return start

    @triton.jit
    def _program_tile(H, size, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
        """A program's tile: its index, sample, head (of ``H``), the tile's query rows or key
        columns (of ``size``) and the head dimensions, each with its bound."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, BLOCK_D)
        return pid, bh // H, bh % H, idx, idx < size, dims, dims < D

    @triton.jit
    def _row_dot(A, B, OUT, s_a_b, s_a_h, s_a_m, s_b_b, s_b_h, s_b_m, s_out_b, s_out_h, H, nq,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """OUT[b, h, m] = A[b, h, m] . B[b, h, m] in fp32: the backward's row term
        ``D_j = dO_j . o_j``, read from both in place (no fp32 copies of either)."""
        _, b, h, rows, row_ok, dims, dim_ok = _program_tile(H, nq, D, BLOCK_D, BLOCK_M)
        a = _tile(A, b, h, s_a_b, s_a_h, s_a_m, rows, row_ok, dims, dim_ok).to(tl.float32)
        c = _tile(B, b, h, s_b_b, s_b_h, s_b_m, rows, row_ok, dims, dim_ok).to(tl.float32)
        tl.store(OUT + b * s_out_b + h * s_out_h + rows, tl.sum(a * c, 1), mask=row_ok)

    @triton.jit
    def _forward(Q, K, V, KEEP, LO, HI, MASK, PROMPT, O, LSE,
                 s_q_b, s_q_h, s_q_m, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                 s_o_b, s_o_h, s_o_m, s_keep_b, s_keep_h, s_lse_b, s_lse_h,
                 s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                 H, nq, n, offset, scale2, window, group, keep_group,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                 PRECISION: tl.constexpr):
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
        for c0 in range(start, stop, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n
            k = _tile(K, b, hk, s_k_b, s_k_h, s_k_n, cols, col_ok, dims, dim_ok)
            keep = tl.load(KEEP + b * s_keep_b + hg * s_keep_h + cols, mask=col_ok, other=0)
            _, visible, _ = _visible_and_gated(b, rows, pos, cols, nq, n, window, keep, LO, HI,
                                               MASK, PROMPT, s_lo_b, s_mask_b, s_mask_m,
                                               s_prompt_b, MASK_MODE, HAS_PROMPT)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _tile(V, b, hk, s_v_b, s_v_h, s_v_n, cols, col_ok, dims, dim_ok)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        l_i = tl.where(row_ok, l_i, 1.0)  # rows past the end see nothing: no 0 / 0
        acc = acc / l_i[:, None]
        tl.store(O + b * s_o_b + h * s_o_h + rows[:, None] * s_o_m + dims[None, :],
                 acc.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        # base-2 log-sum-exp of the scaled scores
        tl.store(LSE + b * s_lse_b + h * s_lse_h + rows, m_i + tl.log2(l_i), mask=row_ok)

    @triton.jit
    def _backward_kv(Q, K, V, KEEP, LO, HI, MASK, PROMPT, DO, LSE, DELTA, DK, DV, DG,
                     s_q_b, s_q_h, s_q_m, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                     s_do_b, s_do_h, s_do_m, s_keep_b, s_keep_h, s_lse_b, s_lse_h,
                     s_dk_b, s_dk_h, s_dk_n, s_dv_b, s_dv_h, s_dv_n, s_dg_b, s_dg_h,
                     s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                     Hk, nq, n, offset, scale, scale2, clamp2, window, group, keep_group,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                     KEEP_PER_QUERY_HEAD: tl.constexpr, PRECISION: tl.constexpr):
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
        for gi in range(group):
            h = hk * group + gi
            hg = h // keep_group
            keep = tl.load(KEEP + b * s_keep_b + hg * s_keep_h + cols, mask=col_ok, other=0)
            dg = tl.zeros([BLOCK_N], dtype=tl.float32)
            for r0 in range(first, nq, BLOCK_M):
                rows = r0 + tl.arange(0, BLOCK_M)
                pos = offset + rows
                row_ok = rows < nq
                q = _tile(Q, b, h, s_q_b, s_q_h, s_q_m, rows, row_ok, dims, dim_ok)
                do = _tile(DO, b, h, s_do_b, s_do_h, s_do_m, rows, row_ok, dims, dim_ok)
                lse = tl.load(LSE + b * s_lse_b + h * s_lse_h + rows, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + b * s_lse_b + h * s_lse_h + rows, mask=row_ok,
                                other=0.0)
                # every tile [keys, queries] (FlashAttention-2's dK / dV loop transposed): each
                # dot then has the key tile's BLOCK_N rows, which Hopper's warpgroup MMA needs
                # (>= 64), where [queries, keys] would give two of the four dots BLOCK_M rows
                s = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale2
                resid = tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :]
                base, visible, gated = _visible_and_gated(
                    b, rows, pos, cols, nq, n, window, keep, LO, HI, MASK, PROMPT, s_lo_b,
                    s_mask_b, s_mask_m, s_prompt_b, MASK_MODE, HAS_PROMPT, True)
                # P~ for every key the base mask allows, kept or evicted; a visible key has
                # s <= lse, so the clamp never touches the true probabilities
                pt = tl.where(base, tl.exp2(tl.minimum(s - lse[None, :], clamp2)), 0.0)
                p = tl.where(visible, pt, 0.0)
                # the gate's row sum first: P~ then dies before the two dots below, instead
                # of living across them (at head width 128 that tile was what spilled)
                dg += tl.sum(tl.where(gated, pt * resid, 0.0), 1)
                dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
                ds = p * resid
                dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
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
    def _backward_q(Q, K, V, KEEP, LO, HI, MASK, PROMPT, DO, LSE, DELTA, DQ,
                    s_q_b, s_q_h, s_q_m, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
                    s_do_b, s_do_h, s_do_m, s_keep_b, s_keep_h, s_lse_b, s_lse_h,
                    s_dq_b, s_dq_h, s_dq_m, s_lo_b, s_mask_b, s_mask_m, s_prompt_b,
                    H, nq, n, offset, scale, scale2, window, group, keep_group,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, HAS_PROMPT: tl.constexpr,
                    PRECISION: tl.constexpr):
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
        for c0 in range(start, stop, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n
            k = _tile(K, b, hk, s_k_b, s_k_h, s_k_n, cols, col_ok, dims, dim_ok)
            v = _tile(V, b, hk, s_v_b, s_v_h, s_v_n, cols, col_ok, dims, dim_ok)
            keep = tl.load(KEEP + b * s_keep_b + hg * s_keep_h + cols, mask=col_ok, other=0)
            _, visible, _ = _visible_and_gated(b, rows, pos, cols, nq, n, window, keep, LO, HI,
                                               MASK, PROMPT, s_lo_b, s_mask_b, s_mask_m,
                                               s_prompt_b, MASK_MODE, HAS_PROMPT)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
            p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
            resid = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
            ds = p * resid
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        tl.store(DQ + b * s_dq_b + h * s_dq_h + rows[:, None] * s_dq_m + dims[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
