#!/usr/bin/env python3
"""Continuous batching of a Llama-shaped model (random weights) over gpumem's paged KV
cache, against the same engine over a max-length contiguous cache on the same memory
budget.

    python examples/serve_llama.py                    # both modes, one line of JSON each
    python examples/serve_llama.py --mode paged --requests 400 --rate 50 --budget 4G

Requests arrive (Poisson, wall clock), join the running batch when memory allows, share
system-prompt prefixes (paged: prefix caching, only the uncached part of a prompt is
computed), decode one token a step together, finish and free their blocks. Under memory
pressure the most recently admitted request is preempted: recomputed later from its
prompt and the tokens it produced (--preempt recompute) or swapped to pinned host memory
and back (--preempt swap). Requests sampling n outputs fork their sequence (copy on
write).

The workload follows `gpumem serve-sim` (tools/serve_sim.hpp): log-normal prompt and
output lengths (sigma 1), a fraction of requests opening with one of a few shared system
prompts, a fraction sampling 2..4 outputs. --workload-out PATH writes the requests that
arrived (a workload file: one request per line, ARRIVAL_SECONDS OUTPUT_TOKENS SAMPLES
TOKEN...), and `gpumem serve-sim --workload PATH` serves the very same requests, so its
prefix hit rate is the simulator's prediction for this run (the command is printed);
--workload PATH serves a file's requests here (token ids modulo the vocabulary).

Both modes run the same model code and the same Triton decode kernel
(gpumem.kv_attention.paged_decode): the contiguous cache is one tensor in the same block
layout whose slot s owns blocks [s * max_blocks_per_seq, (s + 1) * max_blocks_per_seq),
reserved at admission for max_model_len tokens. Only where the keys and values live
differs.

Prints per mode: tokens/s, time to first token (mean, p50, p99), peak concurrent
sequences, prefix hit rate, KV memory held (peak and mean), preemptions.
"""

import argparse
import collections
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpumem  # noqa: E402
import gpumem.kv as gkv  # noqa: E402
from gpumem.kv_attention import gather_kv, paged_decode  # noqa: E402

GiB = 1 << 30


# --- workload ------------------------------------------------------------------------------

Request = collections.namedtuple("Request", "rid arrival prompt output samples")


def read_workload(path, vocab):
    """The requests of a workload file (see the module text)."""
    reqs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            try:
                arrival, out, samples = float(fields[0]), int(fields[1]), int(fields[2])
                prompt = [3 + int(t) % (vocab - 3) for t in fields[3:]]
            except (ValueError, IndexError):
                raise SystemExit("serve_llama: %s line %d is not ARRIVAL OUTPUT SAMPLES TOKEN..."
                                 % (path, number))
            if out < 1 or samples < 1 or not prompt or not math.isfinite(arrival):
                raise SystemExit("serve_llama: %s line %d: output, samples and the prompt must "
                                 "be non-empty" % (path, number))
            reqs.append(Request(len(reqs), arrival, prompt, out, samples))
    if not reqs:
        raise SystemExit("serve_llama: %s holds no request" % path)
    return reqs


def write_workload(path, reqs):
    with open(path, "w") as f:
        f.write("# arrival_seconds output_tokens samples prompt_tokens...\n")
        for r in reqs:
            f.write("%.6f %d %d %s\n" % (r.arrival, r.output, r.samples,
                                         " ".join(str(t) for t in r.prompt)))


def make_workload(a):
    if a.workload:
        return read_workload(a.workload, a.vocab)
    rng = random.Random(a.seed)
    systems = [[rng.randint(3, a.vocab - 1) for _ in range(a.system_prompt_tokens)]
               for _ in range(a.system_prompts)]
    t = 0.0
    reqs = []
    for rid in range(a.requests):
        t += rng.expovariate(a.rate) if math.isfinite(a.rate) else 0.0
        out = int(min(max(1, rng.lognormvariate(math.log(a.output_median), 1.0)),
                      a.max_model_len // 4))
        max_prompt = a.max_model_len - out
        user = int(min(max(4, rng.lognormvariate(math.log(a.prompt_median), 1.0)),
                       max_prompt // 2))
        prompt = []
        if systems and rng.random() < a.shared_prefix:
            prompt = list(systems[rng.randrange(len(systems))])
        user = min(user, max_prompt - min(max_prompt, len(prompt)))
        prompt += [rng.randint(3, a.vocab - 1) for _ in range(user)]
        samples = rng.randint(2, 4) if rng.random() < a.multi_sample else 1
        reqs.append(Request(rid, t, prompt, out, samples))
    return reqs


# --- the model's forward over paged keys and values ---------------------------------------

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Runner:
    """The forward of a transformers LlamaForCausalLM over flattened tokens, its keys and
    values in a block store (gpumem.kv.KVCache or the contiguous baseline)."""

    def __init__(self, model):
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.layers = list(self.inner.layers)

    def rope(self, x, positions):
        """cos, sin [N, 1, D] of the model's rotary embedding at `positions`."""
        rotary = getattr(self.inner, "rotary_emb", None)
        if rotary is not None:
            cos, sin = rotary(x, positions.unsqueeze(0))
            return cos[0][:, None, :], sin[0][:, None, :]
        cfg = self.model.config
        theta = getattr(cfg, "rope_theta", None) or \
            (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        d = self.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]

    @torch.no_grad()
    def forward(self, tokens, positions, store, write_blocks, write_slots, attend):
        """tokens, positions: [N]; the new keys/values go to (write_blocks, write_slots);
        attend(layer, q [N, Hq, D]) -> [N, Hq, D]. Returns the final hidden states [N, H]."""
        x = self.inner.embed_tokens(tokens)
        cos, sin = self.rope(x, positions)
        n = tokens.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, self.heads, self.head_dim)
            k = attn.k_proj(h).view(n, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(n, self.kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kc, vc = store.layer_views(i)
            kc[write_blocks, write_slots] = k
            vc[write_blocks, write_slots] = v
            o = attend(i, q)
            x = x + attn.o_proj(o.reshape(n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.inner.norm(x)

    def logits(self, hidden):
        return self.model.lm_head(hidden)


class ContiguousStore:
    """The baseline: max_model_len tokens reserved per sequence slot at admission, in one
    tensor of the same block layout as gpumem's (so the same kernels read it)."""

    def __init__(self, layout, budget, max_model_len, device):
        bt = layout.block_tokens
        self.layout = layout
        self.per_seq = math.ceil(max_model_len / bt)
        bytes_per_slot = self.per_seq * layout.block_bytes
        self.slots = max(1, budget // bytes_per_slot)
        dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[layout.dtype]
        self.full = torch.empty((self.slots * self.per_seq, layout.layers, 2, bt,
                                 layout.kv_heads, layout.head_dim), dtype=dtype, device=device)
        self.free_slots = list(range(self.slots))
        self.length = {}
        # Slot s's block table: blocks [s * per_seq, (s + 1) * per_seq).
        self.rows = torch.arange(self.slots * self.per_seq, dtype=torch.int32,
                                 device=device).view(self.slots, self.per_seq)
        self.reserved_bytes = self.slots * bytes_per_slot

    def layer_views(self, layer):
        return self.full[:, layer, 0], self.full[:, layer, 1]


# --- the engine ----------------------------------------------------------------------------

class Engine:
    def __init__(self, a, model, mode):
        self.a = a
        self.mode = mode
        self.runner = Runner(model)
        cfg = model.config
        dtype = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[model.dtype]
        self.layout = gkv.Layout.from_hf_config(cfg, dtype=dtype, block_tokens=a.block_tokens)
        self.bt = a.block_tokens
        self.device = torch.device("cuda")
        if mode == "paged":
            self.kv = gkv.KVCache(self.layout, max_blocks=a.budget // self.layout.block_bytes,
                                  max_sequence_tokens=a.max_model_len, prefix_caching=True,
                                  swap=a.preempt == "swap",
                                  stream=torch.cuda.current_stream().cuda_stream)
            self.store = self.kv
        else:
            self.kv = None
            self.store = ContiguousStore(self.layout, a.budget, a.max_model_len, self.device)
        self.running = []     # dicts: seq (id or slot), req, pos, out, last, admitted
        self.swapped = []
        self.waiting = collections.deque()
        self.preemptions = 0
        self.rejected = 0
        self.arrived = []  # requests in arrival order, as they came
        self.ttft = []
        self.generated = 0
        self.peak_concurrent = 0
        self.mem_samples = []

    # -- memory --
    def kv_bytes(self):
        if self.kv is not None:
            return self.kv.stats()["mapped_bytes"]
        return self.store.reserved_bytes

    def table_tensor(self, seqs, row_blocks=None):
        if self.kv is not None:
            t = self.kv.block_tables(seqs, row_blocks=row_blocks)
            return t.tensors(self.device)
        lens = [self.store.length[s] for s in seqs]
        index = torch.tensor(seqs, dtype=torch.long, device=self.device)
        return (self.store.rows[index],
                torch.tensor(lens, dtype=torch.int32, device=self.device))

    # -- admission --
    def can_admit(self, prompt_len, samples):
        if self.kv is None:
            return len(self.store.free_slots) >= samples
        need = math.ceil(prompt_len / self.bt) + samples + len(self.running)
        return self.kv.available_blocks() >= need

    def admit(self, req):
        """Prefill of the request's prompt (only its uncached part with prefix caching);
        returns its running entries (one per sample, forks of the first), or None when
        memory refused it."""
        prompt = req.prompt
        n = len(prompt)
        if self.kv is not None:
            try:
                seq, cached = self.kv.add_sequence(prompt)
            except gpumem.OutOfMemoryError:
                return None
        else:
            seq = self.store.free_slots.pop()
            self.store.length[seq] = n
            cached = 0
        table, _ = self.table_tensor([seq])
        dev = self.device
        pos = torch.arange(cached, n, device=dev)
        toks = torch.tensor(prompt[cached:], device=dev)
        wb = table[0].long()[pos // self.bt]
        ws = pos % self.bt
        # Causal over the whole prompt; with a cached prefix, the new tokens see it all.
        mask = None if cached == 0 else \
            torch.arange(n, device=dev)[None, :] <= pos[:, None]  # [new tokens, n]
        group = self.runner.heads // self.runner.kv_heads

        def attend(layer, q):
            k, v = self.store.layer_views(layer)
            kk, vv = gather_kv(k, v, table, n)  # [1, Hkv, n, D]
            kk = kk.repeat_interleave(group, dim=1)  # GQA as plain heads: any SDPA backend
            vv = vv.repeat_interleave(group, dim=1)
            qq = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, new tokens, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                               is_causal=mask is None)
            return o[0].transpose(0, 1)

        hidden = self.runner.forward(toks, pos, self.store, wb, ws, attend)
        first = int(self.runner.logits(hidden[-1:]).argmax(-1).item())
        # out: tokens generated (the last one not yet in the cache); tokens: those fed back.
        entries = [{"seq": seq, "req": req, "out": 1, "last": first, "tokens": [], "len": n}]
        for _ in range(1, req.samples):
            if self.kv is not None:
                child = self.kv.fork(seq)
            else:
                child = self.store.free_slots.pop()
                nb = math.ceil(n / self.bt)
                per = self.store.per_seq
                self.store.full[child * per:child * per + nb].copy_(
                    self.store.full[seq * per:seq * per + nb])
                self.store.length[child] = n
            entries.append({"seq": child, "req": req, "out": 1, "last": first, "tokens": [],
                            "len": n})
        return entries

    def release(self, entry):
        if self.kv is not None:
            self.kv.free(entry["seq"])
        else:
            self.store.free_slots.append(entry["seq"])
            self.store.length.pop(entry["seq"], None)

    # -- preemption --
    def make_room(self):
        """Preempts the newest sequences until every running one can take a token."""
        if self.kv is None:
            return
        while self.running:
            need = sum(self.kv.blocks_needed(e["seq"], 1) for e in self.running)
            if self.kv.available_blocks() >= need:
                return
            victim = self.running.pop()
            self.preemptions += 1
            if self.a.preempt == "swap":
                self.kv.swap_out(victim["seq"])
                self.swapped.append(victim)
            else:
                # Recomputed later: its prompt and every token it produced become the new
                # prompt; it owes the rest of its output.
                self.release(victim)
                req = victim["req"]
                again = req._replace(prompt=req.prompt + victim["tokens"] + [victim["last"]],
                                     output=req.output - victim["out"], samples=1)
                self.waiting.appendleft((again, True))

    def resume_swapped(self):
        while self.swapped:
            e = self.swapped[-1]
            if self.kv.available_blocks() < self.kv.blocks_needed(e["seq"], 1) + len(self.running):
                return
            self.kv.swap_in(e["seq"])
            self.swapped.pop()
            self.running.append(e)

    # -- one decode step --
    def decode(self):
        seqs = [e["seq"] for e in self.running]
        toks = [e["last"] for e in self.running]
        for e in self.running:
            e["len"] += 1
        if self.kv is not None:
            self.kv.append_each(seqs, toks)
        else:
            for e in self.running:
                self.store.length[e["seq"]] = e["len"]
        lmax = max(e["len"] for e in self.running)
        table, lengths = self.table_tensor(seqs, row_blocks=math.ceil(lmax / self.bt))
        pos = lengths.long() - 1
        wb = torch.gather(table.long(), 1, (pos // self.bt).unsqueeze(1)).squeeze(1)
        ws = pos % self.bt
        tokens = torch.tensor(toks, device=self.device)

        def attend(layer, q):
            k, v = self.store.layer_views(layer)
            return paged_decode(q, k, v, (table, lengths), lengths_max=lmax)

        hidden = self.runner.forward(tokens, pos, self.store, wb, ws, attend)
        nxt = self.runner.logits(hidden).argmax(-1).tolist()
        self.generated += len(self.running)
        still = []
        for e, t in zip(self.running, nxt):
            e["out"] += 1
            e["tokens"].append(e["last"])
            e["last"] = t
            if e["out"] >= e["req"].output:
                self.release(e)
            else:
                still.append(e)
        self.running = still

    def run(self):
        a = self.a
        reqs = make_workload(a)
        pending = collections.deque(reqs)
        start = time.perf_counter()
        offset = 0.0  # idle time skipped (no request running or waiting)
        arrived_at = {}
        steps = 0
        while pending or self.waiting or self.running or self.swapped:
            now = time.perf_counter() - start + offset
            if not self.running and not self.waiting and not self.swapped and pending and \
                    pending[0].arrival > now:
                offset += pending[0].arrival - now
                now = pending[0].arrival
            while pending and pending[0].arrival <= now:
                r = pending.popleft()
                self.arrived.append(r)
                arrived_at[r.rid] = time.perf_counter()
                self.waiting.append((r, False))
            if self.swapped:
                self.resume_swapped()
            while self.waiting and not self.swapped and len(self.running) < a.max_batch:
                r, again = self.waiting[0]
                if not self.can_admit(len(r.prompt), r.samples):
                    if not self.running:
                        # Alone it cannot fit: serve-sim rejects such requests too.
                        self.waiting.popleft()
                        self.rejected += 1
                        continue
                    break
                entries = self.admit(r)
                if entries is None:
                    if not self.running:
                        self.waiting.popleft()  # the device itself has no room for it
                        self.rejected += 1
                        continue
                    break
                self.waiting.popleft()
                if not again:
                    self.ttft.append(time.perf_counter() - arrived_at[r.rid])
                self.generated += len(entries)
                for e in entries:
                    if e["out"] >= r.output:
                        self.release(e)
                    else:
                        self.running.append(e)
            self.peak_concurrent = max(self.peak_concurrent, len(self.running))
            if self.running:
                self.make_room()
            if self.running:
                self.decode()
            steps += 1
            if self.kv is not None and a.shrink_every and steps % a.shrink_every == 0:
                # Elastic: pages above the highest used block go back to the pool.
                self.kv.shrink(keep_free=len(self.running))
            self.mem_samples.append(self.kv_bytes())
            if a.duration and time.perf_counter() - start > a.duration:
                break
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        return self.report(wall)

    def report(self, wall):
        ttft = sorted(self.ttft)

        def pct(p):
            return ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else 0.0

        r = {"mode": self.mode, "requests": len(self.arrived), "seconds": round(wall, 3),
             "generated_tokens": self.generated,
             "tokens_per_s": round(self.generated / wall, 1) if wall else 0.0,
             "ttft_mean_s": round(sum(ttft) / len(ttft), 4) if ttft else 0.0,
             "ttft_p50_s": round(pct(0.5), 4), "ttft_p99_s": round(pct(0.99), 4),
             "peak_concurrent": self.peak_concurrent, "preemptions": self.preemptions,
             "rejected": self.rejected, "completed_ttft": len(ttft),
             "kv_bytes_peak": max(self.mem_samples or [0]),
             "kv_bytes_mean": int(sum(self.mem_samples) / max(1, len(self.mem_samples))),
             "budget_bytes": self.a.budget}
        if self.kv is not None:
            s = self.kv.stats()
            r["prefix_hit_rate"] = round(s["prefix_hits"] / s["prefix_queries"], 4) \
                if s["prefix_queries"] else 0.0
            r["cow_copies"] = s["cow_copies"]
            r["swaps_out"] = s["swaps_out"]
        else:
            r["prefix_hit_rate"] = 0.0
            r["slots"] = self.store.slots
        return r


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["paged", "contiguous", "both"], default="both")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second (inf: all at once)")
    p.add_argument("--budget", type=parse_bytes, default=parse_bytes("2G"), help="KV memory")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-median", type=float, default=256)
    p.add_argument("--output-median", type=float, default=160)
    p.add_argument("--shared-prefix", type=float, default=0.4)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-prompt-tokens", type=int, default=384)
    p.add_argument("--multi-sample", type=float, default=0.1)
    p.add_argument("--preempt", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--shrink-every", type=int, default=64,
                   help="paged: give unused pages back every N steps (0: never)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--duration", type=float, default=0, help="stop after this many seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workload", help="serve this workload file's requests (see the module "
                   "text) instead of generated ones")
    p.add_argument("--workload-out", help="write the requests that arrived (paged mode, else "
                   "the only mode run) as a workload file for gpumem serve-sim --workload")
    p.add_argument("--json", action="store_true", help="JSON lines only")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("serve_llama: needs a CUDA device", file=sys.stderr)
        return 2
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, max_position_embeddings=a.max_model_len)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    modes = ["paged", "contiguous"] if a.mode == "both" else [a.mode]
    results = []
    for mode in modes:
        engine = Engine(a, model, mode)
        r = engine.run()
        if a.workload_out and (mode == "paged" or len(modes) == 1):
            write_workload(a.workload_out, engine.arrived)
        if engine.kv is not None:
            r["kv_valid"] = engine.kv.validate() == ""
            engine.kv.close()
        del engine
        torch.cuda.empty_cache()
        results.append(r)
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print("%-10s %8.1f tokens/s  TTFT mean %.3fs p99 %.3fs  peak concurrent %4d  "
                  "prefix hits %5.1f%%  KV held peak %.2f GiB mean %.2f GiB  preemptions %d"
                  % (mode, r["tokens_per_s"], r["ttft_mean_s"], r["ttft_p99_s"],
                     r["peak_concurrent"], 100 * r["prefix_hit_rate"], r["kv_bytes_peak"] / GiB,
                     r["kv_bytes_mean"] / GiB, r["preemptions"]), flush=True)
    shape = ("--layers %d --kv-heads %d --head-dim %d --dtype bf16 --block-tokens %d "
             "--max-model-len %d --preempt %s --json"
             % (a.layers, a.kv_heads, a.hidden // a.heads, a.block_tokens, a.max_model_len,
                a.preempt))
    if a.workload_out or a.workload:
        sim = "gpumem serve-sim --strategy paged_prefix --budget %d --workload %s %s" % (
            a.budget, a.workload_out or a.workload, shape)
    else:
        sim = ("gpumem serve-sim --strategy paged_prefix --budget %d --requests %d --rate %s "
               "--load-period 0 --seed %d --prompt-median %g --output-median %g "
               "--shared-prefix %g --multi-sample %g %s"
               % (a.budget, a.requests, a.rate if math.isfinite(a.rate) else "1e12", a.seed,
                  a.prompt_median, a.output_median, a.shared_prefix, a.multi_sample, shape))
    if a.json:
        print(json.dumps({"simulator_command": sim}))
    else:
        print("simulator for the same workload: " + sim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
