"""gpumem's paged KV cache from Python (the C API of include/gpumem/interop/gpumem_kv.h).

    import gpumem.kv
    cache = gpumem.kv.KVCache(layers=32, kv_heads=8, head_dim=128, dtype="bf16")
    seq, cached = cache.add_sequence(prompt_token_ids)   # shares cached prompt blocks
    cache.append(seq, [next_token])                       # grows by blocks
    child = cache.fork(seq)                               # copy on write
    k, v = cache.layer_views(layer)                       # torch tensors, no copy
    tables = cache.block_tables([seq, child])             # what a paged kernel indexes
    cache.free(seq)

The storage is one virtual range of `max_blocks` blocks, fixed for the cache's life:

    storage[block][layer][kv][token][head][dim]    kv 0 = keys, 1 = values

`storage_view()` describes it through `__cuda_array_interface__` (torch.as_tensor, CuPy,
Numba); `tensor()` is that range as a torch tensor of the cache's dtype (made through
DLPack, else that interface) and
`layer_views(l)` the per-layer key and value tensors of shape
[max_blocks, block_tokens, kv_heads, head_dim] (strided views of the same memory). Token t
of a sequence is at `k[table[t // block_tokens], t % block_tokens]`. The cache manages
blocks only: the caller writes keys and values into the slots its sequences own, on the
cache's stream (or one ordered after it); the cache's own copies (copy on write, swap)
run on that stream.

Lifetime of views, and stale block tables:
 - a view (the storage_view() object, and every torch tensor made from it) keeps the
   cache's storage alive: close() only stops the cache being used; its memory goes back
   to the pool when the last view is gone. A view never points at memory another
   allocation of the pool can get while it lives.
 - a block id names a block, not a sequence. After free(seq) (or swap_out, or an append
   that copies a shared block), the ids in a table read earlier may belong to another
   sequence (its keys, or zeros with scrub=True), or, after shrink(), to unmapped pages,
   where a kernel faults with an illegal address (a sticky CUDA error). The cache cannot
   see a kernel's reads, so it detects the stale table instead: block_tables() returns a
   BlockTables that records each sequence's generation (bumped by append, free, swap), and
   check_tables() / the attention functions in gpumem.kv_attention refuse a table whose
   sequences changed since, with StaleBlockTableError. Operations on a freed sequence id
   are refused ("... was freed"): ids are never reused.
"""

import ctypes
import weakref

import gpumem
from gpumem import InvalidArgumentError, _check
# The C API and the shared shape, the views, and VirtualSequences live in package-private
# modules; every name below stays importable from gpumem.kv.
from gpumem._kv_c_api import (DTYPES, NOT_RESIDENT, Layout, dtype_code, _DTYPE_BYTES,  # noqa: F401
                              _DTYPE_NAMES, _TYPESTR, _Config, _Layout, _Stats, _Storage,
                              _c_int, _c_ints, _c_size, _declare_lock, _declared,
                              _default_pool, _in_tag, _lib)
from gpumem._kv_views import (SequenceView, StorageView, _DL_CODES, _DL_CUDA,  # noqa: F401
                              _DLDataType, _DLDeleter, _DLDevice, _DLManagedTensor, _DLTensor,
                              _DLTENSOR_NAME, _dlpack_capsule, _dlpack_deleter,
                              _dlpack_forget_unconsumed, _dlpack_live, _dlpack_lock,
                              _dlpack_release, _to_torch, _torch_dtype)
from gpumem._kv_vseqs import VirtualSequences, _VseqsInfo, _VseqsOwner, _vseqs_lib  # noqa: F401

__all__ = ["KVCache", "Layout", "BlockTables", "StaleBlockTableError", "DTYPES",
           "VirtualSequences"]


class StaleBlockTableError(InvalidArgumentError):
    """A block table read before its sequences changed (append, free, swap)."""


class _Owner:
    """Owns the C cache handle and what it stands on (the pool). Views hold it, so the
    storage outlives close() until the last view is gone."""

    def __init__(self, lib, handle, pool):
        self.lib = lib
        self.handle = handle
        self.pool = pool  # kept alive: the cache's pages are the pool's

    def __del__(self):
        if self.handle is not None:
            try:
                self.lib.gpumem_kv_destroy(self.handle)
            except Exception:
                pass
            self.handle = None

class BlockTables:
    """Block tables of several sequences for one kernel launch: `table` is a list of rows
    (padded with `pad`), `lengths` the token counts, `generations` what each sequence's
    generation was when read (check_tables() compares)."""

    __slots__ = ("seqs", "rows", "row_blocks", "lengths", "generations", "pad", "_cache")

    def __init__(self, cache, seqs, rows, row_blocks, lengths, generations, pad):
        self._cache = weakref.ref(cache)
        self.seqs = seqs
        self.rows = rows  # ctypes uint32 array of len(seqs) * row_blocks
        self.row_blocks = row_blocks
        self.lengths = lengths  # ctypes uint64 array
        self.generations = generations
        self.pad = pad

    def table(self):
        """The rows as a list of lists."""
        rb = self.row_blocks
        return [list(self.rows[i * rb:(i + 1) * rb]) for i in range(len(self.seqs))]

    def tensors(self, device="cuda"):
        """(block_table int32 [n, row_blocks], lengths int32 [n]) on `device`."""
        import torch
        n = len(self.seqs)
        table = torch.frombuffer(bytearray(self.rows), dtype=torch.int32).view(n, self.row_blocks)
        lengths = torch.tensor(list(self.lengths), dtype=torch.int32)
        return table.to(device, non_blocking=False), lengths.to(device, non_blocking=False)


class KVCache:
    """A paged KV cache whose pages come from a gpumem pool (see the module text).

    layout or (layers, kv_heads, head_dim, dtype, block_tokens): the shape.
    pool: a gpumem.Pool with allocator vmm_page_pool; by default the PyTorch plug-in's
        pool of `device` when gpumem.torch is enabled (one budget with PyTorch's tensors),
        else a new Pool of `device` (GPUMEM_DEVICE=sim selects the sim device).
    max_blocks: cap on blocks (0: as many as the device holds); initial_blocks: mapped now
        (at least 1, so that views can be made at once); max_sequence_tokens: cap per
        sequence (0: none); prefix_caching; scrub (zero blocks on release); swap (a pinned
        host pool for swap_out/swap_in); stream: the stream of the cache's copies
        (a torch.cuda.Stream, an int, None for the default stream).
    tag: the tag whose pages the cache takes (a name or an int, gpumem.tag_id): they are
        the tag's (its stats) and go back when it sleeps (the sleep is refused while the
        cache holds pages); None: the thread's current tag now (gpumem.torch.tag)."""

    def __init__(self, layout=None, *, layers=None, kv_heads=None, head_dim=None, dtype="bf16",
                 block_tokens=16, pool=None, device=0, max_blocks=0, initial_blocks=1,
                 max_sequence_tokens=0, grow_pages=0, prefix_caching=True, scrub=False,
                 swap=True, stream=None, lib=None, tag=None):
        if layout is None:
            if layers is None or kv_heads is None or head_dim is None:
                raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                           "gpumem.kv: give a Layout or layers, kv_heads "
                                           "and head_dim")
            layout = Layout(layers, kv_heads, head_dim, dtype, block_tokens)
        elif not isinstance(layout, Layout):
            raise TypeError("gpumem.kv: layout must be a gpumem.kv.Layout")
        self.layout = layout
        self._lib = _lib(lib)
        if pool is None:
            pool = _default_pool(device)
        self.device = pool.device
        self._stream = gpumem._stream_value(stream)
        cfg = _Config()
        self._lib.gpumem_kv_config_init(ctypes.byref(cfg))
        cfg.layout = layout._c()
        cfg.max_blocks = _c_size(max_blocks, "max_blocks")
        cfg.initial_blocks = _c_size(initial_blocks, "initial_blocks")
        cfg.max_sequence_tokens = _c_size(max_sequence_tokens, "max_sequence_tokens")
        cfg.grow_pages = _c_size(grow_pages, "grow_pages")
        cfg.prefix_caching = 1 if prefix_caching else 0
        cfg.scrub = 1 if scrub else 0
        cfg.swap = 1 if swap else 0
        cfg.stream = self._stream
        handle = ctypes.c_void_p()
        _check(self._lib, _in_tag(self._lib, tag, lambda: self._lib.gpumem_kv_create(
            pool.handle, ctypes.byref(cfg), ctypes.byref(handle))))
        self._owner = _Owner(self._lib, handle, pool)
        self._generations = {}  # live sequence -> generation
        self._next_generation = 1
        self._storage = self._storage_struct()
        self._view = None
        self._torch_views = None

    # --- handle ------------------------------------------------------------------------

    @property
    def handle(self):
        if self._owner is None:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: the cache is closed")
        return self._owner.handle

    def close(self):
        """No call works on the cache after this; its storage goes back to the pool once no
        view of it is left (at once when none was made)."""
        self._owner = None
        self._view = None
        self._torch_views = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _bump(self, seq):
        self._generations[seq] = self._next_generation
        self._next_generation += 1

    # --- sequences ---------------------------------------------------------------------

    @staticmethod
    def _tokens(tokens):
        """Token ids as a C int32 array (and their count), checked as _c_int does."""
        return _c_ints(tokens, "token", 32, True)

    @staticmethod
    def _seq(seq):
        return _c_int(seq, "sequence id")

    def add_sequence(self, tokens=(), salt=0):
        """A new sequence holding the prompt `tokens` (token ids). Returns (seq, cached):
        the first `cached` tokens' keys and values are already in shared blocks (prefix
        caching) and need no computing."""
        arr, n = self._tokens(tokens)
        seq, cached = ctypes.c_uint64(), ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_add_sequence(
            self.handle, arr, n, _c_int(salt, "salt"), ctypes.byref(seq),
            ctypes.byref(cached)))
        self._bump(seq.value)
        return seq.value, cached.value

    def append(self, seq, tokens):
        """Appends token ids to `seq` (blocks as they fill; all or nothing)."""
        seq = self._seq(seq)
        arr, n = self._tokens(tokens)
        _check(self._lib, self._lib.gpumem_kv_append(self.handle, seq, arr, n))
        self._bump(seq)

    def append_each(self, seqs, tokens):
        """One token to each sequence (a decode step); stops at the first failure, raising
        it after the sequences before it got theirs."""
        ids, count = _c_ints(seqs, "sequence id", 64, False)
        arr, n = self._tokens(tokens)
        if n != count:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: %d sequences, %d tokens" % (count, n))
        done = ctypes.c_size_t()
        status = self._lib.gpumem_kv_append_each(self.handle, ids, arr, n, ctypes.byref(done))
        for s in ids[:done.value]:
            self._bump(s)
        _check(self._lib, status)

    def fork(self, seq):
        """A new sequence sharing every block of `seq`; the first append to either copies
        a shared, partly filled last block (copy on write)."""
        child = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_fork(self.handle, self._seq(seq),
                                                   ctypes.byref(child)))
        self._bump(child.value)
        return child.value

    def free(self, seq):
        seq = self._seq(seq)
        _check(self._lib, self._lib.gpumem_kv_free(self.handle, seq))
        self._generations.pop(seq, None)

    def swap_out(self, seq):
        """Copies the blocks only `seq` holds to pinned host memory and releases them."""
        seq = self._seq(seq)
        _check(self._lib, self._lib.gpumem_kv_swap_out(self.handle, seq))
        self._bump(seq)

    def swap_in(self, seq):
        seq = self._seq(seq)
        _check(self._lib, self._lib.gpumem_kv_swap_in(self.handle, seq))
        self._bump(seq)

    def is_swapped(self, seq):
        out = ctypes.c_int32()
        _check(self._lib, self._lib.gpumem_kv_is_swapped(self.handle, self._seq(seq),
                                                         ctypes.byref(out)))
        return bool(out.value)

    def sequence_tokens(self, seq):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_sequence_tokens(self.handle, self._seq(seq),
                                                              ctypes.byref(out)))
        return out.value

    def generation(self, seq):
        """Changes whenever seq's block table may have changed (append, swap)."""
        seq = self._seq(seq)
        if seq not in self._generations:
            self.sequence_tokens(seq)  # raises "was freed" / "does not exist"
        return self._generations.get(seq)

    def block_table(self, seq):
        """The block ids of `seq` in token order (NOT_RESIDENT where swapped out)."""
        seq = self._seq(seq)
        count = ctypes.c_size_t()
        _check(self._lib, self._lib.gpumem_kv_block_table(self.handle, seq, None, 0,
                                                          ctypes.byref(count)))
        out = (ctypes.c_uint32 * max(1, count.value))()
        _check(self._lib, self._lib.gpumem_kv_block_table(self.handle, seq, out, count.value,
                                                          ctypes.byref(count)))
        return list(out[:count.value])

    def block_tables(self, seqs, row_blocks=None, pad=0):
        """A BlockTables of `seqs` (rows padded with `pad` to row_blocks, by default the
        longest). Refused for a freed, unknown or swapped-out sequence."""
        ids, n = _c_ints(seqs, "sequence id", 64, False)
        seqs = list(ids[:n])
        if row_blocks is None:
            bt = self.layout.block_tokens
            row_blocks = max([(self.sequence_tokens(s) + bt - 1) // bt for s in seqs] or [0])
            row_blocks = max(1, row_blocks)
        row_blocks = _c_size(row_blocks, "row_blocks")
        rows = (ctypes.c_uint32 * max(1, n * row_blocks))()
        lengths = (ctypes.c_uint64 * max(1, n))()
        _check(self._lib, self._lib.gpumem_kv_block_tables(
            self.handle, ids, n, rows, row_blocks, _c_int(pad, "pad", 32), lengths))
        gens = [self._generations.get(s) for s in seqs]
        return BlockTables(self, seqs, rows, row_blocks, lengths[:n], gens, pad)

    def check_tables(self, tables):
        """Raises StaleBlockTableError when a sequence of `tables` was appended to, swapped
        or freed after the tables were read."""
        for s, g in zip(tables.seqs, tables.generations):
            now = self._generations.get(s)
            if now != g:
                what = "was freed" if now is None else "changed (append or swap)"
                raise StaleBlockTableError(
                    gpumem.ERROR_INVALID_ARGUMENT,
                    "gpumem.kv: stale block table: sequence %d %s after the table was read; "
                    "read it again with block_tables()" % (s, what))

    def blocks_needed(self, seq, tokens):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_blocks_needed(
            self.handle, self._seq(seq), _c_size(tokens, "tokens"), ctypes.byref(out)))
        return out.value

    def available_blocks(self):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_available_blocks(self.handle, ctypes.byref(out)))
        return out.value

    def evict(self, blocks):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_evict(self.handle, _c_size(blocks, "blocks"),
                                                    ctypes.byref(out)))
        return out.value

    def shrink(self, keep_free=0, drop_cached=False):
        """Gives pages above the highest used block back to the pool; returns pages."""
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_shrink(self.handle, _c_size(keep_free, "keep_free"),
                                                     1 if drop_cached else 0, ctypes.byref(out)))
        return out.value

    def stats(self):
        s = _Stats()
        _check(self._lib, self._lib.gpumem_kv_stats_get(self.handle, ctypes.byref(s)))
        return s.as_dict()

    def synchronize(self):
        """Waits for the cache's stream (copies on write, swaps)."""
        _check(self._lib, self._lib.gpumem_kv_synchronize(self.handle))

    def validate(self):
        """"" when the cache's invariants hold, else what is wrong."""
        n = self._lib.gpumem_kv_validate(self.handle, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.gpumem_kv_validate(self.handle, buf, n + 1)
        return buf.value.decode(errors="replace")

    def check_layout(self, layers, kv_heads, head_dim, dtype):
        """InvalidArgumentError naming each field where the model differs from the cache."""
        model = Layout(layers, kv_heads, head_dim, dtype, self.layout.block_tokens)
        c = model._c()
        _check(self._lib, self._lib.gpumem_kv_check_layout(self.handle, ctypes.byref(c)))

    # --- storage -----------------------------------------------------------------------

    def _storage_struct(self):
        s = _Storage()
        _check(self._lib, self._lib.gpumem_kv_storage_get(self.handle, ctypes.byref(s)))
        return s

    def storage(self):
        """Base address, max_blocks, capacity_blocks and the byte strides, as a dict."""
        s = self._storage_struct()
        d = {name: getattr(s, name) for name, _ in _Storage._fields_ if name != "layout"}
        d["layout"] = self.layout
        return d

    @property
    def max_blocks(self):
        return self._storage.max_blocks

    def storage_view(self):
        """The whole block range as a StorageView (__cuda_array_interface__)."""
        handle = self.handle  # refuses a closed cache
        del handle
        if self._view is None:
            self._view = StorageView(self._owner, self._storage, self._stream)
        return self._view

    def tensor(self):
        """The whole block range as one torch tensor of the cache's dtype, shape
        [max_blocks, layers, 2, block_tokens, kv_heads, head_dim], no copy. Only blocks
        named by a live block table are mapped: index it through block tables."""
        if self._torch_views is None:
            import torch  # noqa: F401  (refused before a block is mapped when torch is missing)
            view = self.storage_view()
            if self._storage_struct().capacity_blocks == 0:
                # The __cuda_array_interface__ path asks the driver which device the base
                # address is on: map block 0 while the tensor is made.
                seq, _ = self.add_sequence([0], salt=(1 << 64) - 1)
                try:
                    raw = _to_torch(view, self.device)
                finally:
                    self.free(seq)
            else:
                raw = _to_torch(view, self.device)
            want = _torch_dtype(self.layout.dtype)
            full = raw.view(want) if raw.dtype != want else raw
            self._torch_views = full
        return self._torch_views

    def layer_views(self, layer):
        """(keys, values) of one layer: tensors [max_blocks, block_tokens, kv_heads,
        head_dim] over the cache's memory (no copy); token t of a sequence with block table
        `table` is keys[table[t // block_tokens], t % block_tokens]."""
        layer = _c_int(layer, "layer")
        if not layer < self.layout.layers:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: layer %d of a %d-layer cache"
                                       % (layer, self.layout.layers))
        full = self.tensor()
        return full[:, layer, 0], full[:, layer, 1]
