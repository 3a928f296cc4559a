"""Attention over gpumem's paged KV cache, with unmodified PyTorch (and Triton).

    from gpumem.kv_attention import paged_decode, write_kv, gather_kv
    k, v = cache.layer_views(layer)              # [max_blocks, block_tokens, kv_heads, D]
    tables = cache.block_tables(seqs)             # BlockTables (checked for staleness)
    write_kv(k, v, new_k, new_v, tables, positions)
    out = paged_decode(q, k, v, tables)           # q [batch, heads, D] -> [batch, heads, D]

paged_decode is a Triton kernel that reads keys and values through the block table: one
program per (sequence, KV head, split of the sequence) computes every query head of that
KV head's group (GQA) with an online softmax over tiles of TILE tokens, each token's
address found from its block id (table[pos // block_tokens]) and slot (pos % block_tokens)
and the cache's strides; with several splits a second kernel merges the partial softmax
states. Sequences of a batch may have any lengths (>= 1).

PyTorch's flex_attention paged path (torch.nn.attention.experimental._paged_attention)
wants each layer's pages on one token axis with one stride, a [1, heads, pages *
page_size, head_dim] tensor; gpumem's blocks hold every layer of their tokens (so one
page map grows every layer at once), so a layer's tokens are not on one uniform axis and
that path would need a copy per step. The Triton kernel reads the layout as it is.

Numerics: scores and the softmax in float32; the probabilities are rounded to the cache's
dtype before the product with V, as flash attention does. Against SDPA in float32 on the
same values the largest difference is about 1e-2 for bf16, 2e-3 for f16 and 1e-5 for
f32 (tests/interop/torch_kv_attention_test.py uses 3e-2, 5e-3 and 1e-4).
"""

import math

__all__ = ["paged_decode", "write_kv", "gather_kv", "slot_indices", "triton_available",
           "dense_reference"]

_KERNELS = None


def triton_available():
    """"" when the Triton kernel can run, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


def _kernels():
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
                      stride_qb, stride_qh,
                      stride_kb, stride_kt, stride_kh,
                      stride_vb, stride_vt, stride_vh,
                      stride_tb,
                      stride_ob, stride_oh, stride_os,
                      stride_mb, stride_mh,
                      sm_scale, tokens_per_split,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr,
                      NORMALIZE: tl.constexpr, IS_FP32: tl.constexpr):
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        qh = hkv * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = split * tokens_per_split
        end = tl.minimum(length, start + tokens_per_split)
        table_row = table_ptr + b.to(tl.int64) * stride_tb
        for s in range(start, end, TILE):
            pos = s + tl.arange(0, TILE)
            pmask = pos < end
            blk = tl.load(table_row + pos // BLOCK_TOKENS, mask=pmask, other=0).to(tl.int64)
            slot = pos % BLOCK_TOKENS
            koff = blk * stride_kb + slot * stride_kt + hkv * stride_kh
            voff = blk * stride_vb + slot * stride_vt + hkv * stride_vh
            lmask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + koff[:, None] + d[None, :], mask=lmask, other=0.0)
            if IS_FP32:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * sm_scale
            scores = tl.where(pmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + voff[:, None] + d[None, :], mask=lmask, other=0.0)
            if IS_FP32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out_rows = out_ptr + b * stride_ob + qh[:, None] * stride_oh + split * stride_os
        omask = gmask[:, None] & dmask[None, :]
        if NORMALIZE:
            acc = acc / l_i[:, None]
            tl.store(out_rows + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(out_rows + d[None, :], acc, mask=omask)
            ml = b * stride_mb + qh * stride_mh + split
            tl.store(m_ptr + ml, m_i, mask=gmask)
            tl.store(l_ptr + ml, l_i, mask=gmask)

    @triton.jit
    def merge_kernel(part_ptr, m_ptr, l_ptr, out_ptr,
                     stride_pb, stride_ph, stride_ps, stride_mb, stride_mh,
                     stride_ob, stride_oh, splits,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sidx = tl.arange(0, BLOCK_S)
        smask = sidx < splits
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        m = tl.load(m_ptr + b * stride_mb + h * stride_mh + sidx, mask=smask,
                    other=float("-inf"))
        l_s = tl.load(l_ptr + b * stride_mb + h * stride_mh + sidx, mask=smask, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(smask & (l_s > 0), tl.exp(m - m_max), 0.0)
        total = tl.sum(l_s * w, 0)
        part = tl.load(part_ptr + b * stride_pb + h * stride_ph + sidx[:, None] * stride_ps +
                       d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        out = tl.sum(part * w[:, None], 0) / total
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=dmask)

    _KERNELS = (decode_kernel, merge_kernel)
    return _KERNELS


_SM_COUNT = {}


def _sm_count(torch, device):
    """Multiprocessors of `device`, read once per device (the query costs microseconds
    on every decode step otherwise)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _next_pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


def _tables(cache, tables, device):
    """(table int32 [B, row], lengths int32 [B]) from a BlockTables (checked against the
    cache for staleness when a cache is given) or from a (table, lengths) pair."""
    if hasattr(tables, "tensors"):
        if cache is not None:
            cache.check_tables(tables)
        return tables.tensors(device)
    table, lengths = tables
    return table, lengths


def paged_decode(q, k_cache, v_cache, tables, *, cache=None, sm_scale=None, splits=None,
                 tile=64, num_warps=4, lengths_max=None):
    """One decode step of attention for a batch of sequences.

    q: [batch, q_heads, head_dim] (the new token's queries; bf16, f16 or f32).
    k_cache, v_cache: one layer's views, [max_blocks, block_tokens, kv_heads, head_dim]
        with a unit last stride (KVCache.layer_views).
    tables: a BlockTables (then `cache`, when given, refuses a stale one) or a pair
        (block_table int32 [batch, row_blocks] on the device, lengths int32 [batch]).
    Returns [batch, q_heads, head_dim] in q's dtype: softmax(q k^T * sm_scale) v over each
    sequence's first `length` tokens. q_heads must be a multiple of kv_heads (GQA).
    splits: parts each sequence is cut into (default: enough programs for the GPU);
    lengths_max: the longest length, when known (saves a device-to-host read).
    """
    import torch
    import triton
    decode_kernel, merge_kernel = _kernels()
    if q.dim() != 3:
        raise ValueError("paged_decode: q must be [batch, heads, head_dim], got %s"
                         % (tuple(q.shape),))
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("paged_decode: k_cache and v_cache must both be [blocks, "
                         "block_tokens, kv_heads, head_dim]")
    batch, q_heads, head_dim = q.shape
    _, block_tokens, kv_heads, kd = k_cache.shape
    if kd != head_dim:
        raise ValueError("paged_decode: head_dim %d of q, %d of the cache" % (head_dim, kd))
    if q_heads % kv_heads != 0:
        raise ValueError("paged_decode: %d query heads are not a multiple of %d KV heads"
                         % (q_heads, kv_heads))
    if q.dtype != k_cache.dtype:
        raise ValueError("paged_decode: q is %s, the cache %s" % (q.dtype, k_cache.dtype))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode: the last dimension must be contiguous")
    if block_tokens & (block_tokens - 1):
        raise ValueError("paged_decode: block_tokens %d is not a power of two" % block_tokens)
    table, lengths = _tables(cache, tables, q.device)
    if table.dtype != torch.int32 or lengths.dtype != torch.int32:
        table, lengths = table.to(torch.int32), lengths.to(torch.int32)
    if table.shape[0] != batch or lengths.shape[0] != batch:
        raise ValueError("paged_decode: %d queries, %d block-table rows, %d lengths"
                         % (batch, table.shape[0], lengths.shape[0]))
    if lengths_max is None:
        lengths_max = int(lengths.max().item()) if batch else 0
    if lengths_max > table.shape[1] * block_tokens:
        raise ValueError("paged_decode: a length %d exceeds the table's %d blocks"
                         % (lengths_max, table.shape[1]))
    group = q_heads // kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    tile = max(16, min(_next_pow2(tile), _next_pow2(max(lengths_max, 16))))
    if splits is None:
        sms = _sm_count(torch, q.device)
        programs = batch * kv_heads
        splits = max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(lengths_max, 2 * tile),
                            64))
    tiles = triton.cdiv(max(lengths_max, 1), tile)
    splits = max(1, min(int(splits), tiles))
    tokens_per_split = triton.cdiv(tiles, splits) * tile
    splits = triton.cdiv(max(lengths_max, 1), tokens_per_split)
    block_g = max(16, _next_pow2(group))
    block_d = max(16, _next_pow2(head_dim))
    common = dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
                  BLOCK_TOKENS=block_tokens, TILE=tile, IS_FP32=q.dtype == torch.float32,
                  num_warps=num_warps)
    grid = (batch, kv_heads, splits)
    if splits == 1:
        decode_kernel[grid](q, k_cache, v_cache, table, lengths, out, out, out,
                            q.stride(0), q.stride(1),
                            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                            table.stride(0),
                            out.stride(0), out.stride(1), 0,
                            0, 0,
                            sm_scale, tokens_per_split, NORMALIZE=True, **common)
        return out
    part = torch.empty((batch, q_heads, splits, head_dim), device=q.device,
                       dtype=torch.float32)
    m = torch.empty((batch, q_heads, splits), device=q.device, dtype=torch.float32)
    l_s = torch.empty_like(m)
    decode_kernel[grid](q, k_cache, v_cache, table, lengths, part, m, l_s,
                        q.stride(0), q.stride(1),
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                        table.stride(0),
                        part.stride(0), part.stride(1), part.stride(2),
                        m.stride(0), m.stride(1),
                        sm_scale, tokens_per_split, NORMALIZE=False, **common)
    merge_kernel[(batch, q_heads)](part, m, l_s, out,
                                   part.stride(0), part.stride(1), part.stride(2),
                                   m.stride(0), m.stride(1),
                                   out.stride(0), out.stride(1), splits,
                                   HEAD_DIM=head_dim, BLOCK_D=block_d,
                                   BLOCK_S=max(2, _next_pow2(splits)), num_warps=4)
    return out


def slot_indices(table, positions, block_tokens):
    """(block ids, slots) of token `positions` ([batch, n] long) of sequences whose block
    tables are the rows of `table` ([batch, row_blocks])."""
    import torch
    blocks = torch.gather(table.long(), 1, positions // block_tokens)
    return blocks, positions % block_tokens


def write_kv(k_cache, v_cache, keys, values, table, positions):
    """Writes keys/values [batch, n, kv_heads, head_dim] of token `positions` ([batch, n]
    long) into one layer's views through the block table rows `table` ([batch, rows])."""
    blocks, slots = slot_indices(table, positions, k_cache.shape[1])
    k_cache[blocks, slots] = keys
    v_cache[blocks, slots] = values


def gather_kv(k_cache, v_cache, table, length):
    """Keys and values of the first `length` tokens of each row's sequence as dense
    [batch, kv_heads, length, head_dim] tensors (a copy)."""
    import torch
    batch = table.shape[0]
    pos = torch.arange(length, device=table.device).unsqueeze(0).expand(batch, length)
    blocks, slots = slot_indices(table, pos, k_cache.shape[1])
    heads = torch.arange(k_cache.shape[2], device=table.device)
    # [batch, heads, length] index grids: the result comes out [batch, heads, length, D].
    b = blocks[:, None, :]
    s = slots[:, None, :]
    h = heads[None, :, None]
    return k_cache[b, s, h], v_cache[b, s, h]


def dense_reference(q, k_cache, v_cache, table_rows, lengths, sm_scale=None):
    """The same attention through SDPA in float32, one sequence at a time (for tests)."""
    import torch
    import torch.nn.functional as F
    outs = []
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(lengths):
        n = int(n)
        kk, vv = gather_kv(k_cache, v_cache, table_rows[i:i + 1], n)
        kk = kk.float().repeat_interleave(group, dim=1)
        vv = vv.float().repeat_interleave(group, dim=1)
        qq = q[i:i + 1].float().unsqueeze(2)  # [1, heads, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, scale=sm_scale)
        outs.append(o[0, :, 0])
    return torch.stack(outs).to(q.dtype)
