"""A Hugging Face transformers Cache backed by gpumem's paged KV cache.

    from gpumem.hf import GpumemCache
    cache = GpumemCache(model.config)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256)

Each row of the batch is a gpumem sequence; keys and values live in the cache's blocks
(one virtual range, pages mapped as sequences grow), never in per-layer tensors that are
concatenated again every step. `update()` writes a layer's new keys and values into the
blocks through the block table and returns that layer's keys and values as dense
[batch, kv_heads, length, head_dim] tensors (gathered from the blocks, freed after the
layer's attention), so every attention implementation of transformers works unchanged
and gives the same numbers as DynamicCache.

Beam search (`reorder_cache`) and `num_return_sequences` / `num_beams` rows use fork: a
reordered beam shares every block of its parent and copies only a shared, partly filled
last block when it next appends (copy on write). Rows of the prompt batch that are equal
(generate repeats each prompt for its beams or returned sequences, side by side) share
one copy of the prompt's blocks: at the prefill each layer's keys and values of such a
row are checked equal to the first row of its group (a row that differs raises, naming
the rows; pass share_prompt_rows=False for inputs that repeat tokens under different
attention masks).

With attention="paged" (register_paged_attention() and model.set_attn_implementation(
"gpumem_paged")), a decode step's attention reads the blocks directly with the Triton
kernel of gpumem.kv_attention instead of gathering them; prefill and padded batches take
the gathered path through SDPA.

With attention="contiguous", the batch's rows live side by side in one virtually contiguous
range instead of blocks (gpumem/_hf_contiguous.py): update() copies only the new tokens in
and returns strided views that any attention implementation reads as they are, with
nothing gathered; the range grows by pages (by at least 1/32 of what it holds, so a
decode step rarely maps one) and is reserved for max_sequence_tokens (default: the config's max_position_embeddings). Rows do
not share prompt blocks there: beam search and batch changes copy rows; crop() works.

The cache's memory is the tag's that was current when it was made (`with
gpumem.torch.tag("rollout"): cache = GpumemCache(...)`), or `tag=`: its pages come from
that tag's own pages, made at the first update, so they count in the tag's stats and a
sleep of the tag gives them back. release() returns every page to the tag (the tag's
sleep is refused while the cache holds pages); the cache is usable again after it.

Checked at the first update, with a clear error: the model's layers, KV heads, head_dim
and dtype against the cache's layout (when one was given), and the interface of the
installed transformers (a Cache with `layers`).
"""

import weakref

import gpumem
import gpumem.kv as gkv
from gpumem._hf_contiguous import ContiguousRows

try:
    import torch
    from transformers import cache_utils as _cu
    _IMPORT_ERROR = None
except ImportError as e:  # torch or transformers missing: the module still imports
    torch = None
    _cu = None
    _IMPORT_ERROR = e

__all__ = ["GpumemCache", "GpumemStaticCache", "register_paged_attention", "PAGED_ATTENTION"]

PAGED_ATTENTION = "gpumem_paged"


def _require():
    if _IMPORT_ERROR is not None:
        raise ImportError("gpumem.hf needs torch and transformers: %s" % _IMPORT_ERROR)
    missing = [name for name in ("Cache",) if not hasattr(_cu, name)]
    if missing:
        raise ImportError("gpumem.hf: transformers.cache_utils has no %s (transformers %s)"
                          % (", ".join(missing), _transformers_version()))


def _transformers_version():
    try:
        import transformers
        return transformers.__version__
    except Exception:
        return "?"


_Base = _cu.Cache if _cu is not None and hasattr(_cu, "Cache") else object
_LayerBase = (_cu.CacheLayerMixin if _cu is not None and hasattr(_cu, "CacheLayerMixin")
              else object)


class _Layer(_LayerBase):
    """What transformers sees of one layer: flags and the last returned tensors. The data
    is in the gpumem cache; GpumemCache handles every call for the layers."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner, index):  # pylint: disable=super-init-not-called
        # A proxy: no reference cycle, so a dropped cache's pages go back at once.
        self._owner = weakref.proxy(owner)
        self.index = index
        self.keys = None
        self.values = None
        self.is_initialized = False

    # The abstract methods of CacheLayerMixin, answered by the cache.
    def lazy_initialization(self, key_states, *args, **kwargs):
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None, *args, **kwargs):
        return self._owner.update(key_states, value_states, self.index, cache_kwargs)

    def get_mask_sizes(self, cache_position=None, *args, **kwargs):
        return self._owner.get_mask_sizes(cache_position, self.index, **kwargs)

    def get_seq_length(self, *args, **kwargs):
        return self._owner.get_seq_length(self.index)

    def get_max_length(self, *args, **kwargs):
        return -1

    def get_max_cache_shape(self, *args, **kwargs):
        return -1

    def crop(self, *args, **kwargs):
        raise RuntimeError("gpumem.hf: crop goes through GpumemCache, not a layer")

    def reset(self):
        self.keys = None
        self.values = None

    def reorder_cache(self, beam_idx):
        raise RuntimeError("gpumem.hf: reorder_cache goes through GpumemCache, not a layer")

    @property
    def max_batch_size(self):
        rows = self._owner._rows
        return rows.rows if rows is not None else len(self._owner._seqs)

    @property
    def max_cache_len(self):
        return -1


class GpumemCache(_Base):
    """A transformers Cache over gpumem.kv.KVCache (see the module text).

    config: the model's config (layers, KV heads, head_dim); layout: a gpumem.kv.Layout
        instead; kv_cache: an existing KVCache to use (its layout must match).
    dtype: the KV dtype (default: that of the first keys seen); block_tokens; max_blocks,
        pool, device, scrub, max_sequence_tokens: passed to KVCache.
    share_prompt_rows: equal prompt rows share blocks (see the module text).
    attention: "gather" (any attention implementation), "paged" (the Triton decode
        through register_paged_attention()) or "contiguous" (the rows in one virtually
        contiguous range, read as strided views; see the module text).
    tag: the tag whose pages hold the keys and values (a name or an int, gpumem.tag_id);
        None: the thread's current tag now (see the module text)."""

    is_compileable = False

    def __init__(self, config=None, *, layout=None, kv_cache=None, dtype=None, block_tokens=16,
                 max_blocks=0, pool=None, device=None, scrub=False, max_sequence_tokens=0,
                 share_prompt_rows=True, attention="gather", tag=None):
        _require()
        if layout is None and kv_cache is None and config is None:
            raise ValueError("gpumem.hf.GpumemCache: give the model's config, a layout or "
                             "a KVCache")
        if layout is None and config is not None:
            layout = gkv.Layout.from_hf_config(config, dtype=_dtype_name(dtype) or "bf16",
                                               block_tokens=block_tokens)
        if kv_cache is not None:
            layout = kv_cache.layout
        if attention not in ("gather", "paged", "contiguous"):
            raise ValueError("gpumem.hf.GpumemCache: attention must be 'gather', 'paged' or "
                             "'contiguous'")
        if attention == "contiguous" and kv_cache is not None:
            raise ValueError("gpumem.hf.GpumemCache: attention='contiguous' keeps its rows in "
                             "a range of its own, not in a given KVCache")
        self._layout = layout
        self._dtype_given = dtype is not None or kv_cache is not None
        self._kv = kv_cache
        # The storage is made at the first update: under the tag current now.
        self._tag = gpumem.tag_id(tag) if tag is not None else gkv._lib().gpumem_current_tag()
        self._kv_args = dict(max_blocks=max_blocks, pool=pool, scrub=scrub,
                             max_sequence_tokens=max_sequence_tokens, prefix_caching=False,
                             tag=self._tag)
        self._device = device
        self._share = share_prompt_rows
        self._attention = attention
        self._pool = pool
        self._rows = None  # attention="contiguous": the batch's ContiguousRows
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._max_tokens = max_sequence_tokens or \
            getattr(text, "max_position_embeddings", None) or 8192
        self._seqs = []
        self._length = 0
        self._step = None  # per-forward index tensors, made at layer 0
        self.peak_mapped_bytes = 0
        # attention="paged": decode layers read through the block table / gathered (masked).
        self.decode_layers_paged = 0
        self.decode_layers_gathered = 0
        try:
            layers = [_Layer(self, i) for i in range(layout.layers)]
        except TypeError as e:
            raise TypeError("gpumem.hf: transformers %s's CacheLayerMixin wants more than "
                            "this GpumemCache implements (%s)" % (_transformers_version(), e)) \
                from None
        try:
            super().__init__(layers=layers)
        except (TypeError, AttributeError) as e:
            raise TypeError("gpumem.hf: transformers %s's Cache does not take layers= (%s); "
                            "this GpumemCache is written for the layer-based Cache of "
                            "transformers >= 4.56" % (_transformers_version(), e)) from None
        self.layers = layers

    # --- transformers' Cache interface -------------------------------------------------

    def get_seq_length(self, layer_idx=0, *args, **kwargs):
        return self._length

    def get_mask_sizes(self, cache_position=None, layer_idx=0, *args, **kwargs):
        """(kv_length, kv_offset) for the mask of the next forward: every cached token and
        the query's. The query is given as cache_position (a tensor of its positions) or,
        in transformers versions that pass it so, as its length."""
        query = cache_position
        if query is None:
            query = kwargs.get("query_length", kwargs.get("cache_position"))
        if query is None:
            raise TypeError("gpumem.hf: get_mask_sizes got neither cache_position nor "
                            "query_length (transformers %s)" % _transformers_version())
        query = query.shape[0] if hasattr(query, "shape") else int(query)
        return self._length + query, 0

    def get_max_cache_shape(self, layer_idx=0, *args, **kwargs):
        return -1

    def get_max_length(self, layer_idx=None, *args, **kwargs):
        """-1: no maximum (the cache grows by blocks)."""
        return -1

    @property
    def is_croppable(self):
        return self._attention == "contiguous"

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, *args, **kwargs):
        if key_states.dim() != 4:
            raise ValueError("gpumem.hf: keys of shape %s; expected [batch, kv_heads, tokens, "
                             "head_dim]" % (tuple(key_states.shape),))
        if _ACTIVE[0] is not None:
            cache, layer = _ACTIVE[0]
            _ACTIVE[0] = None
            if cache is not self:
                cache = None  # left by another cache's failed step: not this model's doing
        else:
            cache = None
        if cache is not None:
            raise RuntimeError(
                "gpumem.hf: layer %d's attention did not read the paged cache: with "
                "GpumemCache(attention='paged') the model must use the '%s' attention "
                "(gpumem.hf.register_paged_attention(), then "
                "model.set_attn_implementation('%s'))" % (layer, PAGED_ATTENTION,
                                                           PAGED_ATTENTION))
        if self._attention == "contiguous":
            return self._update_contiguous(key_states, value_states, layer_idx)
        if layer_idx == 0:
            self._begin_step(key_states)
        elif self._step is None:
            raise RuntimeError("gpumem.hf: layer %d updated before layer 0 in a forward pass"
                               % layer_idx)
        batch, heads, tokens, dim = key_states.shape
        st = self._step
        if (batch, tokens) != (st["batch"], st["tokens"]):
            raise ValueError("gpumem.hf: layer %d got %d rows x %d tokens, layer 0 got %d x %d"
                             % (layer_idx, batch, tokens, st["batch"], st["tokens"]))
        if st["check_groups"] is not None:
            self._check_groups(key_states, value_states, layer_idx, st["check_groups"])
        k, v = self._kv.layer_views(layer_idx)
        # [batch, heads, tokens, D] -> the blocks' [tokens, heads, D] slots.
        k[st["w_blocks"], st["w_slots"]] = key_states.transpose(1, 2)
        v[st["w_blocks"], st["w_slots"]] = value_states.transpose(1, 2)
        layer = self.layers[layer_idx]
        layer.is_initialized = True
        if self._attention == "paged" and tokens == 1:
            _ACTIVE[0] = (self, layer_idx)
            return _PagedMarker.wrap(k, key_states), _PagedMarker.wrap(v, value_states)
        keys = k[st["r_blocks"], st["r_slots"], st["r_heads"]]
        values = v[st["r_blocks"], st["r_slots"], st["r_heads"]]
        return keys, values

    def reorder_cache(self, beam_idx):
        """Row i becomes a fork of old row beam_idx[i] (copy on write); old rows freed."""
        self._remap_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices):
        self._remap_rows([int(i) for i in torch.as_tensor(indices).flatten().tolist()])

    def batch_repeat_interleave(self, repeats):
        rows = self._rows.rows if self._rows is not None else len(self._seqs)
        self._remap_rows([i for i in range(rows) for _ in range(int(repeats))])

    def crop(self, tokens):
        """transformers' crop: a negative count removes that many tokens, a positive one is
        the length to keep, 0 keeps everything. With attention="contiguous" the tokens
        past the kept length are dropped (their pages stay mapped for the next tokens);
        otherwise only a crop that removes nothing is done: the cache keeps whole sequences
        (is_croppable is False)."""
        keep = self._length + tokens if tokens < 0 else (tokens if tokens > 0 else self._length)
        if keep >= self._length:
            return
        if self._rows is not None:
            self._length = self._rows.length = max(keep, 0)
            return
        raise NotImplementedError("gpumem.hf: crop() (assisted decoding) is not supported: "
                                  "the cache keeps whole sequences")

    def reset(self):
        _ACTIVE[0] = None
        if self._rows is not None:
            self._rows.release()
            self._rows = None
        for s in self._seqs:
            self._kv.free(s)
        self._seqs = []
        self._length = 0
        self._step = None

    def release(self):
        """Frees every sequence and gives every page back to the pool (the cache's tag's,
        whose sleep then releases them); the cache can be used again."""
        self.reset()
        if self._kv is not None:
            self._kv.shrink(drop_cached=True)

    # --- gpumem ------------------------------------------------------------------------

    @property
    def kv_cache(self):
        """The gpumem.kv.KVCache the blocks live in (None with attention="contiguous")."""
        return self._kv

    def memory(self):
        """Device bytes the cache holds now, and its peak over the steps so far."""
        if self._rows is not None:
            mapped = self._rows.mapped_bytes()
        else:
            mapped = self._kv.stats()["mapped_bytes"] if self._kv is not None else 0
        return {"mapped_bytes": mapped, "peak_mapped_bytes": max(self.peak_mapped_bytes, mapped)}

    def _make_cache(self, key_states):
        dtype = _dtype_name(key_states.dtype)
        if self._kv is None:
            if not self._dtype_given:
                self._layout = gkv.Layout(self._layout.layers, self._layout.kv_heads,
                                          self._layout.head_dim, dtype,
                                          self._layout.block_tokens)
            device = self._device if self._device is not None else key_states.device.index or 0
            self._kv = gkv.KVCache(self._layout, device=device,
                                   stream=torch.cuda.current_stream(key_states.device).cuda_stream,
                                   **self._kv_args)
        _, heads, _, dim = key_states.shape
        self._kv.check_layout(self._layout.layers, heads, dim, dtype)

    def _begin_step(self, key_states):
        batch, _, tokens, _ = key_states.shape
        if self._kv is None or not self._seqs:
            self._make_cache(key_states)
        bt = self._layout.block_tokens
        check_groups = None
        if not self._seqs:
            leaders = self._prompt_groups(key_states) if self._share and batch > 1 else None
            seqs = []
            try:
                for row in range(batch):
                    if leaders is not None and leaders[row] != row:
                        seqs.append(self._kv.fork(seqs[leaders[row]]))
                    else:
                        seqs.append(self._kv.add_sequence([0] * tokens)[0])
            except Exception:
                for s in seqs:
                    self._kv.free(s)
                raise
            self._seqs = seqs
            if leaders is not None and any(leaders[r] != r for r in range(batch)):
                check_groups = leaders
            self._length = 0
        else:
            if batch != len(self._seqs):
                raise ValueError("gpumem.hf: %d rows in this step, %d sequences in the cache "
                                 "(the batch changed without reorder_cache / "
                                 "batch_select_indices)" % (batch, len(self._seqs)))
            if tokens == 1:
                self._kv.append_each(self._seqs, [0] * batch)
            else:
                for s in self._seqs:
                    self._kv.append(s, [0] * tokens)
        old = self._length
        self._length = old + tokens
        tables = self._kv.block_tables(self._seqs)
        table, lengths = tables.tensors(key_states.device)
        dev = key_states.device
        wpos = torch.arange(old, old + tokens, device=dev).unsqueeze(0).expand(batch, tokens)
        w_blocks = torch.gather(table.long(), 1, wpos // bt)
        rpos = torch.arange(self._length, device=dev)
        r_blocks = torch.gather(table.long(), 1, (rpos // bt).unsqueeze(0).expand(batch, -1))
        heads = key_states.shape[1]
        self._step = {
            "batch": batch, "tokens": tokens, "check_groups": check_groups,
            "w_blocks": w_blocks, "w_slots": wpos % bt,
            "r_blocks": r_blocks[:, None, :], "r_slots": (rpos % bt)[None, None, :],
            "r_heads": torch.arange(heads, device=dev)[None, :, None],
            "table": table, "lengths": lengths, "tables": tables,
        }
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self._kv.stats()["mapped_bytes"])

    @staticmethod
    def _prompt_groups(key_states):
        """leaders[row]: the first row of the run of equal rows `row` is in (layer 0's
        keys compared with the row before: generate repeats prompts side by side)."""
        batch = key_states.shape[0]
        same = (key_states[1:] == key_states[:-1]).flatten(1).all(1).tolist()
        leaders = [0] * batch
        for row in range(1, batch):
            leaders[row] = leaders[row - 1] if same[row - 1] else row
        return leaders

    @staticmethod
    def _check_groups(key_states, value_states, layer_idx, leaders):
        idx = torch.tensor(leaders, device=key_states.device)
        ok_k = (key_states == key_states[idx]).flatten(1).all(1)
        ok_v = (value_states == value_states[idx]).flatten(1).all(1)
        bad = (~(ok_k & ok_v)).nonzero().flatten().tolist()
        if bad:
            row = bad[0]
            raise ValueError("gpumem.hf: prompt rows %d and %d have equal keys at layer 0 but "
                             "differ at layer %d (equal tokens under different attention "
                             "masks?): they cannot share blocks; use "
                             "GpumemCache(share_prompt_rows=False)"
                             % (leaders[row], row, layer_idx))

    def _update_contiguous(self, key_states, value_states, layer_idx):
        batch, heads, tokens, dim = key_states.shape
        if layer_idx == 0:
            self._begin_step_contiguous(key_states)
        elif self._step is None:
            raise RuntimeError("gpumem.hf: layer %d updated before layer 0 in a forward pass"
                               % layer_idx)
        st = self._step
        if (batch, tokens) != (st["batch"], st["tokens"]):
            raise ValueError("gpumem.hf: layer %d got %d rows x %d tokens, layer 0 got %d x %d"
                             % (layer_idx, batch, tokens, st["batch"], st["tokens"]))
        if not 0 <= layer_idx < self._layout.layers:
            raise gpumem.InvalidArgumentError(
                gpumem.ERROR_INVALID_ARGUMENT, "gpumem.hf: layer %d of a %d-layer cache"
                % (layer_idx, self._layout.layers))
        self.layers[layer_idx].is_initialized = True
        return self._rows.write(layer_idx, key_states, value_states, st["start"])

    def _begin_step_contiguous(self, key_states):
        batch, heads, tokens, dim = key_states.shape
        if self._rows is None:
            dtype = _dtype_name(key_states.dtype)
            if not self._dtype_given:
                self._layout = gkv.Layout(self._layout.layers, self._layout.kv_heads,
                                          self._layout.head_dim, dtype,
                                          self._layout.block_tokens)
            self._check_model_layout(heads, dim, dtype)
            device = self._device if self._device is not None else key_states.device.index or 0
            self._rows = ContiguousRows(
                self._layout, batch, tokens, max_tokens=self._max_tokens, pool=self._pool,
                tag=self._tag, device=device,
                stream=torch.cuda.current_stream(key_states.device).cuda_stream)
            self._length = 0
        elif batch != self._rows.rows:
            raise ValueError("gpumem.hf: %d rows in this step, %d in the cache (the batch "
                             "changed without reorder_cache / batch_select_indices)"
                             % (batch, self._rows.rows))
        elif self._length + tokens > self._max_tokens:
            raise gpumem.InvalidArgumentError(
                gpumem.ERROR_INVALID_ARGUMENT,
                "gpumem.hf: %d tokens would exceed max_sequence_tokens %d"
                % (self._length + tokens, self._max_tokens))
        self._rows.reserve(tokens)
        start = self._length
        self._length = self._rows.length = start + tokens
        self._step = {"batch": batch, "tokens": tokens, "start": start}
        self.peak_mapped_bytes = max(self.peak_mapped_bytes, self._rows.mapped_bytes())

    def _check_model_layout(self, heads, dim, dtype):
        lay = self._layout
        wrong = []
        if heads != lay.kv_heads:
            wrong.append("kv_heads %d (the cache has %d)" % (heads, lay.kv_heads))
        if dim != lay.head_dim:
            wrong.append("head_dim %d (the cache has %d)" % (dim, lay.head_dim))
        if dtype != lay.dtype:
            wrong.append("dtype %s (the cache has %s)" % (dtype, lay.dtype))
        if wrong:
            raise gpumem.InvalidArgumentError(
                gpumem.ERROR_INVALID_ARGUMENT,
                "gpumem.hf: the model's keys do not match the cache's layout: " +
                ", ".join(wrong))

    def _remap_rows_contiguous(self, sources):
        if self._rows.select_rows(sources):
            self._step = None
            return
        old = self._rows
        new = ContiguousRows(self._layout, len(sources), old.length,
                             max_tokens=self._max_tokens, pool=self._pool, tag=self._tag,
                             device=old._views[0][0].device.index,
                             stream=torch.cuda.current_stream(old._views[0][0].device)
                             .cuda_stream)
        try:
            new.copy_rows_from(old, sources)
        except Exception:
            new.release()
            raise
        old.release()
        self._rows = new
        self._step = None

    def _remap_rows(self, sources):
        if self._rows is not None:
            self._remap_rows_contiguous(sources)
            return
        if any(not 0 <= i < len(self._seqs) for i in sources):
            raise IndexError("gpumem.hf: row index out of range for %d rows" % len(self._seqs))
        new = []
        try:
            for i in sources:
                new.append(self._kv.fork(self._seqs[i]))
        except Exception:
            for s in new:
                self._kv.free(s)
            raise
        for s in self._seqs:
            self._kv.free(s)
        self._seqs = new
        self._step = None


_Static = _cu.StaticCache if _cu is not None and hasattr(_cu, "StaticCache") else object


class GpumemStaticCache(_Static):
    """transformers' StaticCache with its tensors in a gpumem tag, for decode in CUDA graphs.

        cache = GpumemStaticCache(model.config, max_cache_len=prompt + new, tag="rollout")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new)
        gpumem.torch.sleep("rollout", "discard")   # the cache's and the graphs' memory go
        gpumem.torch.wake("rollout"); cache.reset() # back at the same addresses: the graphs
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new)   # replay

    The cache is compileable, so generate compiles its decode step (transformers' default
    compile config: CUDA graphs through torch.compile). Its tensors are made at the first
    update, in `tag` (None: the tag current then), and keep their addresses for the
    cache's life; the graphs' private memory is the tag that was current at their capture
    (generate inside `with gpumem.torch.tag(...)`). A discard sleep of the tag gives both
    back and the wake maps them again where they were, so the captured graphs replay with
    no new capture. reset() before each generate after a discard wake: the bytes are
    undefined then, and masked positions must not hold NaN."""

    def __init__(self, config, max_cache_len, *, tag=None, **kwargs):
        _require()
        if _Static is object:
            raise ImportError("gpumem.hf: transformers.cache_utils has no StaticCache "
                              "(transformers %s)" % _transformers_version())
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        self._gpumem_tag = tag

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # The first update of a layer makes its tensors: in the cache's tag. Compiled
        # steps (the decode) only write into tensors made already.
        if self._gpumem_tag is None or torch.compiler.is_compiling():
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        import gpumem.torch as gt  # pylint: disable=import-outside-toplevel
        with gt.tag(self._gpumem_tag):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _dtype_name(dtype):
    if dtype is None:
        return None
    return gkv._DTYPE_NAMES[gkv.dtype_code(dtype)]


# --- the paged attention path ----------------------------------------------------------

_ACTIVE = [None]  # (cache, layer) of the update that returned paged markers


class _PagedMarker:
    """A decode step's update() in paged mode returns the new token's keys and values
    (shape [batch, heads, 1, D], what an attention implementation that ignores the marker
    would see); the layer's views ride along as an attribute."""

    @staticmethod
    def wrap(view, new_states):
        t = new_states
        t._gpumem_view = view
        return t


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from gpumem.kv_attention import paged_decode
    active = _ACTIVE[0]
    view_k = getattr(key, "_gpumem_view", None)
    if active is None or view_k is None or query.shape[2] != 1 or attention_mask is not None:
        if view_k is not None and active is not None:
            _ACTIVE[0] = None
            # A padded decode batch: gather instead (the Triton kernel has no mask).
            cache, layer = active
            cache.decode_layers_gathered += 1
            st = cache._step
            k, v = cache._kv.layer_views(layer)
            key = k[st["r_blocks"], st["r_slots"], st["r_heads"]]
            value = v[st["r_blocks"], st["r_slots"], st["r_heads"]]
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    cache, layer = active
    _ACTIVE[0] = None  # consumed (update() checks that every layer's was)
    cache.decode_layers_paged += 1
    st = cache._step
    out = paged_decode(query[:, :, 0], view_k, value._gpumem_view, (st["table"], st["lengths"]),
                       sm_scale=scaling, lengths_max=cache._length)
    return out.unsqueeze(1), None  # [batch, 1, heads, D], as sdpa_attention_forward returns


def register_paged_attention():
    """Registers "gpumem_paged" with transformers' attention and mask interfaces; then
    model.set_attn_implementation("gpumem_paged") (or config._attn_implementation)."""
    _require()
    from transformers import AttentionInterface
    AttentionInterface.register(PAGED_ATTENTION, _paged_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)
    except ImportError:
        pass
    return PAGED_ATTENTION
