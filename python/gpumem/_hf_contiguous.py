"""The storage of GpumemCache(attention="contiguous"): the rows of a generate batch side by
side in one virtually contiguous range that grows by pages.

The batch is one gpumem.kv.VirtualSequences sequence whose "heads" are the batch's rows
times the model's KV heads, so the range's layout is token-major:

    [max_tokens][layers][2 (keys, values)][rows][kv_heads][head_dim]

and each layer's keys (values) are one strided tensor [rows, kv_heads, tokens, head_dim]
over it: update() copies only the new tokens in and returns views, so nothing is gathered
or concatenated, and SDPA reads the views as they are (only the last dimension must be
contiguous). The range grows by at least 1/32 of what it holds, so it holds at most 1/32
more than its tokens, plus one partly used page.

Invariants: `held` tokens are mapped (the sequence's length); `length` <= `held` tokens
are valid (crop lowers `length` only); the views over the whole reserved range are made
once and every view handed out is sliced to `length`, so no view handed out reaches an
unmapped page; the views are dropped before the sequence is freed.

Package-private: gpumem.hf uses it."""

import gpumem.kv as gkv
from gpumem._kv_c_api import DTYPES, _TYPESTR
from gpumem._kv_views import SequenceView, _to_torch, _torch_dtype


class ContiguousRows:
    """The rows of a batch in one growing virtual range (see the module text)."""

    def __init__(self, layout, rows, tokens, *, max_tokens, pool=None, device=0, stream=None,
                 tag=None):
        if rows < 1:
            raise ValueError("gpumem.hf: a batch of %d rows" % rows)
        self.rows = rows
        self.heads = layout.kv_heads
        self.layers = layout.layers
        self.max_tokens = max_tokens
        batch_layout = gkv.Layout(layout.layers, rows * layout.kv_heads, layout.head_dim,
                                  layout.dtype, layout.block_tokens)
        self._vs = gkv.VirtualSequences(batch_layout, max_sequence_tokens=max_tokens,
                                        pool=pool, device=device, stream=stream, tag=tag)
        self._seq = None
        try:
            self._seq = self._vs.add(tokens)
            self._views = self._range_views(layout, device)
        except Exception:
            self.release()
            raise
        self.held = tokens
        self.length = 0

    def _range_views(self, layout, device):
        """Per layer (keys, values) [rows, kv_heads, max_tokens, head_dim] over the whole
        reserved range (see the invariants: only slices to `length` leave this object)."""
        base, _ = self._vs.sequence(self._seq)
        info = self._vs.info()
        shape = (self.max_tokens, layout.layers, 2, self.rows * self.heads, layout.head_dim)
        strides = (info["token_stride"], info["layer_stride"], info["kv_stride"],
                   info["head_stride"], info["dtype_bytes"])
        view = SequenceView(self._vs._owner, base, shape, strides, _TYPESTR[DTYPES[layout.dtype]],
                            self._vs._stream)
        whole = _to_torch(view, device)
        want = _torch_dtype(layout.dtype)
        if whole.dtype != want:
            whole = whole.view(want)
        whole = whole.unflatten(3, (self.rows, self.heads))  # [T, L, 2, rows, heads, D]
        return [(whole[:, layer, 0].permute(1, 2, 0, 3), whole[:, layer, 1].permute(1, 2, 0, 3))
                for layer in range(layout.layers)]

    def reserve(self, tokens):
        """Room for `tokens` more valid tokens. Past what is held, it maps at least 1/32 of
        what it holds more (up to max_tokens): a decode step then rarely maps a page, and
        the range holds at most 1/32 more than its tokens, plus a page."""
        need = self.length + tokens - self.held
        if need > 0:
            grow = max(need, min(self.held // 32, self.max_tokens - self.held))
            self._vs.append(self._seq, grow)
            self.held += grow

    def write(self, layer, keys, values, start):
        """Copies keys/values [rows, kv_heads, n, head_dim] to tokens start..start+n of
        `layer` and returns that layer's (keys, values) views of tokens 0..start+n."""
        k, v = self._views[layer]
        end = start + keys.shape[2]
        k[:, :, start:end].copy_(keys)
        v[:, :, start:end].copy_(values)
        if start == 0:
            # The first tokens: what is stored equals the input bit for bit, and attention
            # over the input (contiguous, as the model made it) is the cheaper read.
            return keys, values
        return k[:, :, :end], v[:, :, :end]

    def select_rows(self, sources):
        """Row i becomes old row sources[i], for every valid token and layer. Same row
        count: in place, one layer at a time (a layer's temporary only); else a new range."""
        if any(not 0 <= i < self.rows for i in sources):
            raise IndexError("gpumem.hf: row index out of range for %d rows" % self.rows)
        if len(sources) != self.rows:
            return False
        if list(sources) == list(range(self.rows)) or self.length == 0:
            return True
        import torch  # gpumem.hf imports without torch; its cache needs it
        device = self._views[0][0].device
        idx = torch.tensor(sources, device=device)
        for k, v in self._views:
            for t in (k[:, :, :self.length], v[:, :, :self.length]):
                t.copy_(t.index_select(0, idx))
        return True

    def copy_rows_from(self, other, sources):
        """Fills this (new) range with `other`'s rows `sources`, `other.length` tokens."""
        import torch
        device = self._views[0][0].device
        idx = torch.tensor(sources, device=device)
        n = other.length
        for (k, v), (ok, ov) in zip(self._views, other._views):
            k[:, :, :n].copy_(ok[:, :, :n].index_select(0, idx))
            v[:, :, :n].copy_(ov[:, :, :n].index_select(0, idx))
        self.length = n

    def mapped_bytes(self):
        return self._vs.info()["mapped_bytes"] if self._seq is not None else 0

    def release(self):
        """Drops the views, then gives the pages back (waiting for the stream first)."""
        self._views = []
        if self._seq is not None:
            self._vs.free(self._seq)
            self._seq = None
        self._vs.close()
