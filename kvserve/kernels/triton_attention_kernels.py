"""Paged attention in Triton that reads every KV format in place: one kernel family for decode
rows and short chunks over a cached context, the format a compile-time switch.

The shape is vLLM's "unified attention": a program serves one KV head of a tile of queries of
one sequence, the tile's queries times the head's ``G`` query heads packed as the ``M``
dimension of the matrix products, so a grouped-query model reads each key once per group
rather than once per query head. Keys are visited ``TILE_N`` at a time through the block table
(a tile may span blocks, so any block size works), with an online softmax; long contexts split
their key range over ``NUM_SPLITS`` programs whose partial results a second kernel merges.

The formats (``FMT``), each decoded in registers right after its load (float32 from there on,
which is also what Triton's interpreter needs: it has no bf16 arithmetic):

- ``DENSE``: float32 / bfloat16 / float16 blocks;
- ``FP8``: e4m3 / e5m2 codes with one scale per KV head, folded into the query (keys) and
  into the output (values);
- ``INT8``: codes with one float16 scale per token and head, applied to the scores (keys)
  and to the probabilities (values);
- ``KIVI``: packed 4- or 2-bit codes; keys per channel over a block (compact scale and zero
  codes against three float32 numbers per block and head), values per token over groups of
  channels; blocks that own a residual slot are read from the full-precision residual. Keys
  are stored in a Hadamard-rotated basis, so their scores take the query rotated once by the
  caller (``qr``), and the residual's (unrotated) keys the plain query.

Retention is runtime data: per-sequence windows beside the layer's window (a query at cache
entry ``c`` sees ``(c - w, c]``), so one compiled variant serves every request. The kernels
synchronise with the host nowhere and allocate nothing; they are launched by
:mod:`kvserve.kernels.triton_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

DENSE, FP8, INT8, KIVI = 0, 1, 2, 3
# The same, as the kernels see them (a kernel reads only constexpr globals).
_DENSE, _FP8, _INT8, _KIVI = (tl.constexpr(f) for f in (DENSE, FP8, INT8, KIVI))
LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(q_start_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include tile ``pid``: sequence ``i``'s tiles start at
    ``q_start[i] // BLOCK_Q + i`` (at least as many tiles as it needs, never overlapping)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(q_start_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unpack(byte_ptrs, d, mask, BITS: tl.constexpr):
    """Codes of channel ``d`` from bytes packing ``8 // BITS`` channels, lowest first."""
    per: tl.constexpr = 8 // BITS
    packed = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    return ((packed >> ((d % per) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _fp8_value(code, E5M2: tl.constexpr):
    """The value of fp8 bytes, through float16 bits (exact, and without the float8 types that
    sm_80 lacks): an e5m2 byte is the top byte of a float16; an e4m3 byte's exponent and
    mantissa sit 7 bits up in one, worth 2**8 times less than the code says (bias 15 vs 7),
    subnormals included."""
    c = code.to(tl.int16)
    if E5M2:
        return (c << 8).to(tl.float16, bitcast=True).to(tl.float32)
    h = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return h.to(tl.float32) * 256.0


@triton.jit
def _dot(a, b, like_ptr, DOT_F32: tl.constexpr):
    """``a @ b`` with float32 accumulation: exact float32 products (no TF32) for a float32
    model, else in the query's own 16-bit dtype on the tensor cores."""
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    lp = like_ptr.dtype.element_ty
    return tl.dot(a.to(lp), b.to(lp))


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, qr_ptr,
    k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr,
    res_map_ptr, rk_ptr, rv_ptr,
    tables_ptr, q_start_ptr, q_len_ptr, ctx_ptr, windows_ptr,
    sinks_ptr, qb_ptr, vote_ptrs_ptr, vote_strides_ptr,
    part_acc_ptr, part_ml_ptr,
    num_seqs, layer_window, qk_scale, block_size,
    s_qt, s_qh, s_ot, s_oh, s_bt, s_bh, s_rqt, s_rqh,
    s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
    s_ksb, s_ksh, s_ksx, s_vsb, s_vsh, s_vst,
    s_kzb, s_kzh, s_rb, s_rh, s_rt,
    s_tab,
    FMT: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOWS: tl.constexpr, BITS: tl.constexpr, VGROUP: tl.constexpr, E5M2: tl.constexpr,
    DOT_F32: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_VOTES: tl.constexpr,
):  # fmt: skip
    """One (query tile, KV head, key split). Shapes: q/out ``[T, H, D]``; per-sequence
    ``q_start``, ``q_len``, ``ctx`` (cache entries before the sequence's first query),
    ``windows`` (0: none); tables ``[B, max_blocks]``. The strides name each format's tensors:
    codes (``k``/``v``), scales (``ks``/``vs``: fp8 ``[KVH]``, int8 ``[rows, KVH, bs]``, KIVI
    key metadata ``[rows, KVH, 2, D]`` and value scales ``[rows, KVH, bs, D / VGROUP]``),
    zeros (``kz``/``vz``: KIVI's key base ``[rows, KVH, 3]`` and value zeros) and KIVI's
    residual (``res_map`` ``[rows]``, ``rk``/``rv`` ``[slots, KVH, bs, D]``).

    StreamingLLM (``HAS_SINKS``, dense formats): ``sinks`` ``[B]`` first cache entries each
    sequence keeps besides its window, scored with its queries rotated back (``qb``, rows as
    ``q``). H2O (``HAS_VOTES``, dense, one split): per sequence the address and row stride of
    a float32 ``[KVH, entries]`` buffer (0: none) to which each entry's probability, summed
    over the tile's queries and the KV head's query heads, is added."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(q_start_ptr, pid, num_seqs, BLOCK_Q)
    q0 = tl.load(q_start_ptr + seq).to(tl.int32)
    n_q = tl.load(q_len_ptr + seq).to(tl.int32)
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    tile = pid - (q0 // BLOCK_Q + seq)
    if tile * BLOCK_Q >= n_q:
        return

    m = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + m // G  # query within the sequence's rows
    row_ok = (m < BLOCK_Q * G) & (qi < n_q)
    head = kvh * G + m % G
    tok = q0 + qi
    d = tl.arange(0, HEAD_DIM)
    q_off = tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    if FMT == _KIVI:
        qr_off = tok[:, None] * s_rqt + head[:, None] * s_rqh + d[None, :]
        qr = tl.load(qr_ptr + qr_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    if FMT == _FP8:
        q = q * tl.load(ks_ptr + kvh)
    n_sink = 0
    if HAS_SINKS:
        n_sink = tl.load(sinks_ptr + seq)
        qb_off = tok[:, None] * s_bt + head[:, None] * s_bh + d[None, :]
        qb = tl.load(qb_ptr + qb_off, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    pos = ctx + qi  # each query's cache entry

    # The window: the tighter of the layer's and the sequence's (0: none).
    w = layer_window
    if HAS_WINDOWS:
        sw = tl.load(windows_ptr + seq)
        w = tl.where((sw > 0) & ((w <= 0) | (sw < w)), sw, w)
    last = ctx + tl.minimum(n_q, (tile + 1) * BLOCK_Q) - 1
    kv_start = tl.where(w > 0, tl.maximum(ctx + tile * BLOCK_Q - w + 1, 0), 0)
    # Tiles: the sinks' before the window's (none without sinks), then the window's; the
    # splits share them out in that order.
    sink_tiles = (tl.minimum(n_sink, kv_start) + TILE_N - 1) // TILE_N
    t_begin = tl.maximum(kv_start // TILE_N, sink_tiles)
    t_end = (last + TILE_N) // TILE_N
    n_tiles = sink_tiles + tl.maximum(t_end - t_begin, 0)
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_lo = split * per_split
    t_hi = tl.minimum(n_tiles, t_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    j0 = tl.arange(0, TILE_N)
    for i in range(t_lo, t_hi):
        t = tl.where(i < sink_tiles, i, t_begin + i - sink_tiles)
        j = t * TILE_N + j0
        key_ok = j <= last
        page = tl.load(tables_ptr + seq * s_tab + j // block_size, mask=key_ok, other=0)
        page = page.to(tl.int64)
        off = j % block_size
        kbase = page[:, None] * s_kb + kvh * s_kh + off[:, None] * s_kt
        vbase = page[:, None] * s_vb + kvh * s_vh + off[:, None] * s_vt
        lm = key_ok[:, None]
        if FMT == _KIVI:
            per: tl.constexpr = 8 // BITS
            res = tl.load(res_map_ptr + page, mask=key_ok, other=-1)
            in_res = res >= 0
            rbase = res.to(tl.int64)[:, None] * s_rb + kvh * s_rh + off[:, None] * s_rt
            rmask = lm & in_res[:, None]
            qmask = lm & (res < 0)[:, None]
            # keys: code * scale + zero per channel of the block, in the rotated basis
            kc = _unpack(k_ptr + kbase + d[None, :] // per, d[None, :], qmask, BITS)
            mbase = page[:, None] * s_ksb + kvh * s_ksh + d[None, :]
            zc = tl.load(ks_ptr + mbase, mask=qmask, other=0).to(tl.float32)
            sc = tl.load(ks_ptr + mbase + s_ksx, mask=qmask, other=0).to(tl.float32)
            zb = page * s_kzb + kvh * s_kzh
            z0 = tl.load(kz_ptr + zb, mask=key_ok, other=0.0)
            zstep = tl.load(kz_ptr + zb + 1, mask=key_ok, other=0.0)
            smax = tl.load(kz_ptr + zb + 2, mask=key_ok, other=0.0)
            kq = kc * (smax[:, None] * tl.exp2(-sc / 8.0)) + (z0[:, None] + zc * zstep[:, None])
            kq = tl.where(qmask, kq, 0.0)
            kr = tl.load(rk_ptr + rbase + d[None, :], mask=rmask, other=0.0).to(tl.float32)
            s = _dot(qr, tl.trans(kq), q_ptr, DOT_F32) + _dot(q, tl.trans(kr), q_ptr, DOT_F32)
            vc = _unpack(v_ptr + vbase + d[None, :] // per, d[None, :], qmask, BITS)
            gb = page[:, None] * s_vsb + kvh * s_vsh + off[:, None] * s_vst + d[None, :] // VGROUP
            vsc = tl.load(vs_ptr + gb, mask=qmask, other=0.0).to(tl.float32)
            vz = tl.load(vz_ptr + gb, mask=qmask, other=0.0).to(tl.float32)
            vr = tl.load(rv_ptr + rbase + d[None, :], mask=rmask, other=0.0).to(tl.float32)
            v = tl.where(rmask, vr, tl.where(qmask, vc * vsc + vz, 0.0))
        else:
            k = tl.load(k_ptr + kbase + d[None, :], mask=lm, other=0)
            v = tl.load(v_ptr + vbase + d[None, :], mask=lm, other=0)
            if FMT == _FP8:
                k = _fp8_value(k, E5M2)
                v = _fp8_value(v, E5M2)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if FMT == _INT8:
                sidx = page * s_ksb + kvh * s_ksh + off * s_ksx
                k_s = tl.load(ks_ptr + sidx, mask=key_ok, other=0.0).to(tl.float32)
                v_s = tl.load(vs_ptr + sidx, mask=key_ok, other=0.0).to(tl.float32)
            s = _dot(q, tl.trans(k), q_ptr, DOT_F32)
            if HAS_SINKS:
                if t * TILE_N < n_sink:
                    s_back = _dot(qb, tl.trans(k), q_ptr, DOT_F32)
                    s = tl.where(j[None, :] < n_sink, s_back, s)
            if FMT == _INT8:
                s = s * k_s[None, :]

        seen = row_ok[:, None] & key_ok[None, :] & (j[None, :] <= pos[:, None])
        seen &= (w <= 0) | (j[None, :] > pos[:, None] - w) | (j[None, :] < n_sink)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FMT == _INT8:
            p = p * v_s[None, :]
        acc = acc * alpha[:, None] + _dot(p, v, q_ptr, DOT_F32)
        m_i = m_new

    if HAS_VOTES:  # a second pass over the same keys, with the final max and sum
        vote_at = tl.load(vote_ptrs_ptr + seq)
        if vote_at != 0:
            vote = vote_at.to(tl.pointer_type(tl.float32)) + kvh * tl.load(vote_strides_ptr + seq)
            m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
            inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
            for i in range(t_lo, t_hi):
                t = tl.where(i < sink_tiles, i, t_begin + i - sink_tiles)
                j = t * TILE_N + j0
                key_ok = j <= last
                page = tl.load(tables_ptr + seq * s_tab + j // block_size, mask=key_ok, other=0)
                kbase = page.to(tl.int64)[:, None] * s_kb + kvh * s_kh
                kbase += (j % block_size)[:, None] * s_kt
                k = tl.load(k_ptr + kbase + d[None, :], mask=key_ok[:, None], other=0)
                k = k.to(tl.float32)
                s = _dot(q, tl.trans(k), q_ptr, DOT_F32)
                if HAS_SINKS:
                    if t * TILE_N < n_sink:
                        s_back = _dot(qb, tl.trans(k), q_ptr, DOT_F32)
                        s = tl.where(j[None, :] < n_sink, s_back, s)
                seen = row_ok[:, None] & key_ok[None, :] & (j[None, :] <= pos[:, None])
                seen &= (w <= 0) | (j[None, :] > pos[:, None] - w) | (j[None, :] < n_sink)
                p = tl.where(seen, tl.exp2(s - m_fin[:, None]), 0.0) * inv_l[:, None]
                tl.atomic_add(vote + j, tl.sum(p, 0), mask=key_ok)

    if FMT == _FP8:
        acc = acc * tl.load(vs_ptr + kvh)
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # partials [T, H, S, D] and (max, sum) [T, H, S, 2], merged by merge_splits_kernel
        num_heads = tl.num_programs(1) * G
        slot = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + slot * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, num_heads, s_ot, s_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """One (query row, head): the splits' partial sums rescaled to their common maximum."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    slot = (tok * num_heads + head) * NUM_SPLITS + sp
    m_s = tl.load(part_ml_ptr + slot * 2)
    l_s = tl.load(part_ml_ptr + slot * 2 + 1)
    m_all = tl.max(m_s, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    scale = tl.exp2(m_s - m_safe)
    acc = tl.load(part_acc_ptr + slot[:, None] * HEAD_DIM + d[None, :])
    o = tl.sum(acc * scale[:, None], 0)
    denom = tl.sum(l_s * scale, 0)
    o = o / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + tok * s_ot + head * s_oh + d, o.to(out_ptr.dtype.element_ty))
