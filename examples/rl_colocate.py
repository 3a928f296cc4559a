#!/usr/bin/env python3
"""RL post-training on one GPU (GRPO-shaped): a trainer and a generator take turns on the
device; gpumem's tags sleep the idle side, and the generator reads the trainer's weights
without a copy (docs/RL_COLOCATE.md).

    python examples/rl_colocate.py --json $OUT/rl.json          # every layout, faults, capacity
    python examples/rl_colocate.py --layout one --iters 20
    python examples/rl_colocate.py --layout two --faults
    python examples/rl_colocate.py --find-max-batch --layout baseline --cap-gib 14

Each iteration: the generator makes a batch of rollouts (Hugging Face generate, sampled
from the seed's random stream; in the gpumem layouts over GpumemCache(attention="contiguous"), or with --decode graphs over
gpumem.hf.GpumemStaticCache with the decode steps in CUDA graphs, which transformers
compiles for a static cache, the cache and the graphs' memory in tag "rollout" and kept at
their addresses across its discard sleeps; transformers' own cache in the baseline), the rollouts get random rewards, the trainer takes one AdamW step
on a GRPO policy-gradient loss (group-normalised advantages, activation checkpointing), and
the generator gets the new weights. The policy is a Llama-shaped model with random weights
(bf16, ~1.1B parameters by default; no network).

Layouts (--layout):
  one       one process. The generator is the trainer's model itself: no weight sync.
            Gradients live in tag "train", offloaded during generation; AdamW's states
            in tag "optim", offloaded from the end of one optimizer step to the start of
            the next (awake for opt.step() alone, so the forward and backward's
            activations take their room, for the same bytes copied); generate's memory, the KV cache (with --decode graphs the CUDA graphs' pool
            too) included, lives in tag "rollout", discarded during training.
  two       two processes (gpumem.colocate). The trainer's weights live in one allocation
            of the shared tag, mapped by the generator through gpumem.ipc (one descriptor,
            no copy); after each step the trainer records a CUDA interprocess event, which
            the generator waits on before it reads the weights. Each process sleeps its
            idle tags ("train" and "optim" offload as in one, "rollout" discard).
  baseline  two processes under PyTorch's own allocator, as frameworks do it today: the
            weights copied in buckets through torch.multiprocessing.reductions.reduce_tensor
            (CUDA IPC; verl's pattern), the idle side's tensors moved to pinned host memory
            and back, torch.cuda.empty_cache() after each move.
  all       (default) each layout in a fresh process, then the faults, then the capacity
            search, one JSON document of all of it.

Measured per iteration: generate, train, weight sync, sleep and wake times; bytes moved by
sleep and wake against a pinned host<->device copy measured in the same process; open
descriptors, resident host memory, reserved GPU memory and pinned host bytes held for
offload of each process and the device memory in use; logits of the generator against the
trainer's on a fixed batch after each sync; the loss. At the end of the gpumem layouts, the
pinned host memory of the offload tags is given back (gpumem.torch.release_host) and
checked to drop to 0. --faults (layout two): the generator killed with SIGKILL mid-iteration (the
trainer goes on; descriptors and device memory back to where they were), and a wake with
no room (out-of-memory error, the bytes still on the host). --find-max-batch: the largest
rollout batch that runs 2 iterations under a device memory cap, each try a fresh process,
the rest of the device held by a ballast process.

Needs torch with CUDA, transformers and the gpumem plug-in (GPUMEM_LIB or a built tree).
"""
import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from gpumem import colocate  # noqa: E402  (no torch needed)

GiB = 1 << 30
MODELS = {
    # ~1.1B parameters: Llama-3.2-1B's shape with a 32k vocabulary, untied head.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=1024),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=["one", "two", "baseline", "all"], default="all")
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="rollouts per iteration")
    p.add_argument("--group", type=int, default=4, help="rollouts per prompt (GRPO group)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-mib", type=int, default=512, help="baseline: weight sync bucket")
    p.add_argument("--faults", action="store_true", help="layout two: kill / no-room checks")
    p.add_argument("--backward-untagged", action="store_true",
                   help="gpumem layouts: the training step's tag is this thread's only, so "
                   "autograd's thread allocates untagged and empty_cache() follows each "
                   "trainer sleep (by default the tag is the process tag too)")
    p.add_argument("--decode", choices=["graphs", "eager"], default="eager",
                   help="gpumem layouts: decode steps eagerly over "
                   "GpumemCache(attention='contiguous'), as the baseline decodes, so the "
                   "rollouts and losses of every layout are the same; or in CUDA graphs "
                   "(generate over gpumem.hf.GpumemStaticCache in tag rollout, compiled by "
                   "transformers), whose rollouts differ from eager decoding's")
    p.add_argument("--find-max-batch", action="store_true")
    p.add_argument("--cap-gib", type=float, default=14.0, help="capacity: device memory cap")
    p.add_argument("--capacity-layouts", default="one,baseline")
    p.add_argument("--capacity-tries", type=int, default=5)
    p.add_argument("--capacity-start", type=int, default=64, help="first batch tried")
    p.add_argument("--capacity-bounds", metavar="LAYOUT:FITS:FAILS", action="append",
                   default=[], help="capacity: bisect LAYOUT between a batch known to fit and "
                   "one known not to (from an earlier search; repeatable)")
    p.add_argument("--no-capacity", action="store_true", help="--layout all: skip capacity")
    p.add_argument("--json", help="write the measurements here")
    # Internal: the roles of child processes.
    p.add_argument("--role", choices=["main", "generator", "baseline-generator", "ballast"],
                   default="main", help=argparse.SUPPRESS)
    p.add_argument("--channel-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ballast-bytes", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.batch % a.group:
        p.error("--batch must be a multiple of --group")
    return a


def forward_args(a, **override):
    """The model and loop flags, for a child process."""
    d = dict(model=a.model, iters=a.iters, batch=a.batch, group=a.group, prompt_len=a.prompt_len,
             gen_len=a.gen_len, lr=a.lr, seed=a.seed, bucket_mib=a.bucket_mib)
    d.update(override)
    out = []
    for k, v in d.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    if a.backward_untagged:
        out.append("--backward-untagged")
    out += ["--decode", a.decode]
    return out


def train_tag(gt, a):
    """The scope of a training step: tag "train" for this thread and autograd's backward
    thread (the process tag), unless --backward-untagged."""
    return gt.tag("train", all_threads=not a.backward_untagged)


def drop_untagged_cache(gt, a):
    """After the trainer's sleep, with --backward-untagged: the backward's untagged blocks
    (autograd's thread) go back. By default they are the tag's, whose sleep released them
    and whose wake maps them again as the tag's cache."""
    if a.backward_untagged:
        gt.empty_cache()


# --- shared by every process that runs torch -------------------------------------------------

def setup_torch(use_gpumem):
    """torch, and gpumem.torch enabled (before any CUDA allocation) when use_gpumem."""
    gt = None
    if use_gpumem:
        import gpumem.torch as gt  # noqa: F811
        gt.enable()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("rl_colocate: needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch, gt


def build_model(torch, a):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**MODELS[a.model], max_position_embeddings=a.prompt_len + a.gen_len + 8,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(a.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.to(torch.bfloat16)


def set_param(torch, model, name, tensor, requires_grad):
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=requires_grad)


def to_bytes(torch, t):
    buf = io.BytesIO()
    torch.save(t.detach().cpu(), buf)
    return buf.getvalue()


def from_bytes(torch, b):
    return torch.load(io.BytesIO(b), weights_only=True)


def fixed_batch(torch, a, vocab):
    g = torch.Generator().manual_seed(12345)
    return torch.randint(3, vocab, (2, 16), generator=g).cuda()


def prompts_for(torch, a, vocab, iteration):
    g = torch.Generator().manual_seed(a.seed * 1000003 + iteration)
    base = torch.randint(3, vocab, (a.batch // a.group, a.prompt_len), generator=g)
    return base.repeat_interleave(a.group, dim=0)  # each prompt for its group, side by side


def rewards_for(torch, a, iteration):
    g = torch.Generator().manual_seed(a.seed * 7919 + iteration + 1)
    return torch.randn(a.batch, generator=g)


def logits_of(torch, model, batch):
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch, use_cache=False).logits.float()
    model.train(was)
    return out


_STATIC_CACHES = {}  # the gpumem layouts' decode caches, by (model, rows): kept for the run


def static_cache(a, model, rows):
    """The static cache of `rows` rollouts: made once, in tag "rollout", so its addresses,
    and the CUDA graphs captured over them, last the whole run while the tag's discard
    sleep gives its memory back between generations."""
    key = (id(model), rows)
    if key not in _STATIC_CACHES:
        from gpumem.hf import GpumemStaticCache
        _STATIC_CACHES[key] = GpumemStaticCache(
            model.config, max_cache_len=a.prompt_len + a.gen_len, tag="rollout")
    return _STATIC_CACHES[key]


def generate(torch, a, model, prompts, use_gpumem, iteration):
    """Rollouts [batch, prompt + gen] of the prompts, sampled (temperature 1) from the
    random-number stream of --seed and the iteration, so every layout draws the same
    tokens from the same logits and the rollouts of a group differ. The gpumem layouts decode in
    CUDA graphs over a GpumemStaticCache (--decode graphs: transformers compiles the decode
    step for a compileable cache; the graphs' memory is tag "rollout"'s, current here), or
    eagerly over GpumemCache (released at once; its pages are the tag's). The baseline
    uses transformers' default cache."""
    model.eval()
    prompts = prompts.cuda()
    kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=a.gen_len,
                  min_new_tokens=a.gen_len, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, pad_token_id=0, use_cache=True)
    torch.manual_seed(a.seed * 1000003 + iteration)
    with torch.no_grad():
        out = None
        if use_gpumem and a.decode == "graphs":
            cache = static_cache(a, model, prompts.shape[0])
            if getattr(cache, "_rl_used", False):
                cache.reset()  # after the tag's discard wake its bytes are undefined
            cache._rl_used = True  # pylint: disable=protected-access
            try:
                out = model.generate(prompts, past_key_values=cache, **kwargs)
            except Exception as e:  # pylint: disable=broad-except
                # Compilation is the installed torch's and transformers': a failure there
                # costs the run its graphs, not its figures. The result says so.
                a.decode = "eager"
                a.decode_fallback = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300])
                print(json.dumps({"decode_fallback": a.decode_fallback}), file=sys.stderr,
                      flush=True)
                _STATIC_CACHES.clear()
        if out is None and use_gpumem and a.decode == "eager":
            from gpumem.hf import GpumemCache
            cache = GpumemCache(model.config, attention="contiguous", tag="rollout",
                                max_sequence_tokens=a.prompt_len + a.gen_len + 8)
            try:
                out = model.generate(prompts, past_key_values=cache, **kwargs)
            finally:
                cache.release()
                del cache
        elif out is None:
            out = model.generate(prompts, **kwargs)
    return out


def graph_bytes(gt):
    """Bytes the private pools of CUDA graphs hold from the driver now (0 while the tag they
    belong to sleeps)."""
    return int(gt.graph_pools()["reserved_bytes"])


def grpo_loss(torch, a, model, seqs, rewards):
    """Policy gradient with group-normalised advantages (GRPO, on-policy: ratio 1, no KL)."""
    keep = seqs.shape[1] - a.prompt_len + 1
    logits = model(input_ids=seqs, use_cache=False, logits_to_keep=keep).logits[:, :-1].float()
    targets = seqs[:, a.prompt_len:]
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    r = rewards.cuda().view(-1, a.group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    return -(adv * logp).mean()


def make_trainer(torch, a, model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr)


def train_step(torch, a, model, opt, seqs, rewards, states=None):
    """One GRPO step; the loss. With `states` (OptimizerStates), AdamW's states are awake
    for opt.step() only."""
    model.train()
    loss = grpo_loss(torch, a, model, seqs, rewards)
    loss.backward()
    if states is None:
        opt.step()
    else:
        states.step(opt)
    opt.zero_grad(set_to_none=False)  # the gradients stay where they are (their tag)
    value = float(loss.detach())
    del loss
    return value


class OptimizerStates:
    """AdamW's states in tag "optim", awake for the optimizer step alone: they sleep
    (offload) from the end of one step to the start of the next, through generation and
    through the next forward and backward, whose activations take their room. The bytes
    copied per iteration are those of a sleep during generation alone; the wake moves from
    before the forward to before opt.step(). Addresses stay, so the optimizer's own tensors
    serve again with no code of its own. `last` holds the latest step's sleep and wake
    seconds."""

    def __init__(self, torch, gt):
        self.torch, self.gt = torch, gt
        self.last = {}

    def step(self, opt):
        torch, gt = self.torch, self.gt
        t = sync(torch)
        # Asleep since the last step (before the first, empty); tag "optim" is current in
        # the block, so the first step creates the states there.
        with gt.awake("optim", then="offload"):
            self.last["optim_wake_s"] = sync(torch) - t
            opt.step()
            t = sync(torch)
        self.last["optim_sleep_s"] = sync(torch) - t


def rollout_reply(torch, a, model, batch, msg, row, gpumem_cache):
    """A generator's answer to "generate": its logits on the fixed batch, then the rollouts
    of the prompts in msg.payload (generate_s in row); (logits bytes, whole payload)."""
    logits = logits_of(torch, model, batch)
    t = sync(torch)
    seqs = generate(torch, a, model, from_bytes(torch, msg.payload), gpumem_cache,
                    msg.meta["iteration"])
    row["generate_s"] = sync(torch) - t
    lb = to_bytes(torch, logits)
    return lb, lb + to_bytes(torch, seqs)


def sync(torch):
    torch.cuda.synchronize()
    return time.perf_counter()


def pinned_bandwidth(torch, nbytes=1 * GiB):
    """Pinned host<->device copy bandwidth (bytes/s), in this process, now."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        t = sync(torch)
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        out[name] = 3 * nbytes / (sync(torch) - t)
    del dev, host
    return out


SLEEPING_TAGS = ("train", "optim", "rollout")


def host_bytes_held(gt):
    """Pinned host bytes gpumem holds for this process's offload sleeps (every tag that
    sleeps): one block per tag, kept from sleep to sleep until release_host."""
    return sum(int(gt.host_bytes(tag)) for tag in SLEEPING_TAGS)


def counts(torch, gt, host_bytes=0):
    """Descriptors, resident host memory, this process's reserved GPU memory, device used,
    and the pinned host bytes held for offload (gpumem's, or `host_bytes` for the
    baseline's own buffers)."""
    free, total = torch.cuda.mem_get_info()
    reserved = gt.memory_reserved() if gt is not None else torch.cuda.memory_reserved()
    return {"fds": colocate.open_fds(), "rss": colocate.rss_bytes(), "reserved": int(reserved),
            "device_used": int(total - free),
            "host_bytes": host_bytes_held(gt) if gt is not None else int(host_bytes)}


def release_host(gt):
    """At the end of a run: wakes AdamW's states (asleep since the last step; the other
    tags are awake), gives back the pinned host memory of every sleeping tag and reports
    whether it dropped to 0."""
    wake_if_asleep(gt, "optim")
    before = host_bytes_held(gt)
    released = sum(int(gt.release_host(tag)) for tag in SLEEPING_TAGS
                   if gt.tag_stats(tag)["allocations"])
    after = host_bytes_held(gt)
    return {"host_bytes_before": before, "released_bytes": released, "host_bytes_after": after,
            "dropped_to_zero": after == 0 and released == before}


def offloaded_bytes(gt):
    """The bytes the offload sleeps of tags "train" and "optim" copy each way: their pinned
    host blocks, which hold the copy of every page the sleeps kept (free pages are given
    back uncopied)."""
    return int(gt.host_bytes("train")) + int(gt.host_bytes("optim"))


def crc_of(torch, t):
    """CRC of the tokens' values: a compact copy, as torch.save writes a view's whole
    storage (generate may return a view of a larger buffer)."""
    return zlib.crc32(to_bytes(torch, t.detach().to(torch.int64).contiguous().clone()))


def preallocate_grads(torch, model):
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def wake_if_asleep(gt, tag):
    if gt.asleep(tag):
        gt.wake(tag)


# --- layout one --------------------------------------------------------------------------------

def run_one(a):
    torch, gt = setup_torch(True)
    bw = pinned_bandwidth(torch)
    with gt.tag("weights"):
        model = build_model(torch, a)
    vocab = model.config.vocab_size
    batch = fixed_batch(torch, a, vocab)
    with gt.tag("train"):
        opt = make_trainer(torch, a, model)
        preallocate_grads(torch, model)
    states = OptimizerStates(torch, gt)
    rows = []
    for it in range(a.iters):
        row = {"iteration": it}
        reference = logits_of(torch, model, batch)  # the trainer's, before the generator runs
        t = sync(torch)
        gt.sleep("train", "offload")
        row["train_sleep_s"] = sync(torch) - t
        drop_untagged_cache(gt, a)
        row["sleep_s"] = sync(torch) - t
        row["empty_cache_s"] = row["sleep_s"] - row["train_sleep_s"]
        t = sync(torch)
        wake_if_asleep(gt, "rollout")
        row["wake_s"] = row["rollout_wake_s"] = sync(torch) - t
        row["sync_s"] = 0.0  # the generator reads the trainer's tensors themselves
        with gt.tag("rollout"):
            seen = logits_of(torch, model, batch)
            row["logits_equal"] = bool(torch.equal(seen, reference))
            row["logits_max_diff"] = float((seen - reference).abs().max())
            t = sync(torch)
            seqs = generate(torch, a, model, prompts_for(torch, a, vocab, it), True, it)
            row["generate_s"] = sync(torch) - t
        row["graph_bytes_generating"] = graph_bytes(gt)
        row["decode"] = a.decode
        # The rollouts leave the tag that sleeps next: a sleeping tag's addresses are unmapped.
        seqs = seqs.clone()
        row["tokens_crc"] = crc_of(torch, seqs)
        del seen, reference
        t = sync(torch)
        gt.sleep("rollout", "discard")
        row["rollout_sleep_s"] = sync(torch) - t
        row["sleep_s"] += row["rollout_sleep_s"]
        row["graph_bytes_training"] = graph_bytes(gt)
        t = sync(torch)
        gt.wake("train")
        row["train_wake_s"] = sync(torch) - t
        row["wake_s"] += row["train_wake_s"]
        row["moved_bytes"] = offloaded_bytes(gt)
        t = sync(torch)
        with train_tag(gt, a):
            row["loss"] = train_step(torch, a, model, opt, seqs, rewards_for(torch, a, it),
                                     states)
        row.update(states.last)
        # The states' sleep and wake count as sleep and wake, not as training.
        row["train_s"] = sync(torch) - t - row["optim_sleep_s"] - row["optim_wake_s"]
        row["sleep_s"] += row["optim_sleep_s"]
        row["wake_s"] += row["optim_wake_s"]
        del seqs
        row["trainer"] = counts(torch, gt)
        rows.append(row)
        print(json.dumps({"layout": "one", **row}), flush=True)
    return {"layout": "one", "pinned": bw, "iterations": rows, "host_release": release_host(gt),
            "parameters": sum(p.numel() for p in model.parameters())}


# --- layout two ----------------------------------------------------------------------------------

class GpumemTrainer:
    """The trainer of layout two: weights in one shared allocation, gradients in tag
    "train" (offloaded while the generator works), AdamW's states in tag "optim" (awake
    for the optimizer step alone: OptimizerStates), an interprocess event recorded after
    each step (trainer_iteration's protocol)."""

    def __init__(self, torch, gt, a):
        self.torch, self.gt, self.a = torch, gt, a
        model = build_model(torch, a)
        named = list(model.named_parameters())
        self.offsets, total = colocate.flat_layout(
            [(n, p.numel() * p.element_size()) for n, p in named])
        with gt.tag("shared"):
            self.flat = torch.empty(total // 2, dtype=torch.bfloat16, device="cuda")
        for n, p in named:
            off = self.offsets[n] // 2
            view = self.flat[off:off + p.numel()].view(p.shape)
            view.copy_(p.data)
            set_param(torch, model, n, view, True)
        self.shapes = {n: list(p.shape) for n, p in named}
        del named, p
        gt.empty_cache()
        self.model = model
        self.vocab = model.config.vocab_size
        self.batch = fixed_batch(torch, a, self.vocab)
        with gt.tag("train"):
            self.opt = make_trainer(torch, a, model)
            preallocate_grads(torch, model)
        self.states = OptimizerStates(torch, gt)
        self.event = torch.cuda.Event(interprocess=True)
        self.event.record()
        self.reference = logits_of(torch, model, self.batch)
        self.last = {}
        self.losses = []

    def share(self, channel):
        """Sends the weights (one descriptor) and the event to a new generator."""
        import gpumem.ipc as ipc
        h = ipc.share(self.flat)
        try:
            meta = {"size": h.size, "dtype": h.dtype, "shape": list(h.shape), "device": h.device,
                    "offsets": self.offsets, "shapes": self.shapes}
            channel.call("weights", meta, bytes(self.event.ipc_handle()), fds=[h.fd]).close()
        finally:
            h.close()

    def sleep(self):
        t = sync(self.torch)
        self.gt.sleep("train", "offload")
        drop_untagged_cache(self.gt, self.a)
        self.last["trainer_sleep_s"] = sync(self.torch) - t

    def wake(self):
        t = sync(self.torch)
        self.gt.wake("train")
        self.last["trainer_wake_s"] = sync(self.torch) - t

    def request(self, iteration):
        self.iteration = iteration
        return {"iteration": iteration}, to_bytes(self.torch, prompts_for(
            self.torch, self.a, self.vocab, iteration))

    def train(self, reply):
        torch = self.torch
        seen = from_bytes(torch, reply.payload[:reply.meta["logits_bytes"]]).cuda()
        seqs = from_bytes(torch, reply.payload[reply.meta["logits_bytes"]:]).cuda()
        self.last["logits_equal"] = bool(torch.equal(seen, self.reference))
        self.last["logits_max_diff"] = float((seen - self.reference).abs().max())
        self.last["tokens_crc"] = crc_of(torch, seqs)
        with train_tag(self.gt, self.a):
            loss = train_step(torch, self.a, self.model, self.opt, seqs,
                              rewards_for(torch, self.a, self.iteration),
                              self.states)
        if self.states is not None:
            self.last.update(self.states.last)
        self.losses.append(loss)
        return loss

    def publish(self):
        self.reference = logits_of(self.torch, self.model, self.batch)
        self.event.record()  # the generator's stream waits on this before reading


def generator_main(a):
    """Layout two's generator: maps the trainer's weights, waits on its event, generates
    with its memory in tag "rollout" (discarded between requests)."""
    torch, gt = setup_torch(True)
    import gpumem.ipc as ipc
    model = build_model(torch, a)
    model.eval()
    state = {"event": None, "flat": None}
    batch = fixed_batch(torch, a, model.config.vocab_size)

    def on_weights(msg, channel):
        m = msg.meta
        handle = ipc.Handle(msg.take_fd(), m["size"], m["dtype"], m["shape"], m["device"])
        try:
            flat = ipc.open(handle)
        finally:
            handle.close()
        for name, off in m["offsets"].items():
            n = 1
            for d in m["shapes"][name]:
                n *= d
            view = flat[off // 2:off // 2 + n].view(m["shapes"][name])
            set_param(torch, model, name, view, False)
        state["flat"] = flat
        state["event"] = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(),
                                                         msg.payload)
        gt.empty_cache()  # the parameters built before the mapping
        return {"mapped_bytes": m["size"]}, b""

    def on_generate(msg, channel):
        channel.send("progress", {"stage": "generating"})
        row = {}
        t = sync(torch)
        wake_if_asleep(gt, "rollout")
        row["generator_wake_s"] = sync(torch) - t
        t = sync(torch)
        torch.cuda.current_stream().wait_event(state["event"])
        row["sync_s"] = sync(torch) - t
        with gt.tag("rollout"):
            lb, payload = rollout_reply(torch, a, model, batch, msg, row, True)
        row["graph_bytes_generating"] = graph_bytes(gt)
        row["decode"] = a.decode
        t = sync(torch)
        gt.sleep("rollout", "discard")
        row["generator_sleep_s"] = sync(torch) - t
        row["graph_bytes_training"] = graph_bytes(gt)
        row["logits_bytes"] = len(lb)
        row["generator"] = counts(torch, gt)
        return row, payload

    channel = colocate.Channel.from_fd(a.channel_fd)
    colocate.serve(channel, {"weights": on_weights, "generate": on_generate})
    channel.close()
    return 0


def spawn_generator(a, role):
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--channel-fd", "{fd}"]
    return colocate.Peer.spawn(argv + forward_args(a))


def two_process_loop(torch, gt, a, trainer, peer, layout):
    rows = []
    for it in range(a.iters):
        trainer.last = {}
        loss, meta, timings = colocate.trainer_iteration(trainer, peer.channel, it)
        row = {"iteration": it, "loss": loss, **timings, **trainer.last,
               **{k: v for k, v in meta.items() if k != "logits_bytes"}}
        # The AdamW states' sleep and wake (inside train) count as sleep and wake.
        row["train_s"] -= row.get("optim_sleep_s", 0) + row.get("optim_wake_s", 0)
        row["sleep_s"] = sum(row.get(k, 0) for k in ("trainer_sleep_s", "generator_sleep_s",
                                                      "optim_sleep_s"))
        row["wake_s"] = sum(row.get(k, 0) for k in ("trainer_wake_s", "generator_wake_s",
                                                     "optim_wake_s"))
        row["moved_bytes"] = trainer.moved_bytes() if hasattr(trainer, "moved_bytes") \
            else offloaded_bytes(gt)
        row["trainer"] = counts(torch, gt, trainer.moved_bytes() if gt is None else 0)
        rows.append(row)
        print(json.dumps({"layout": layout, **row}), flush=True)
    return rows


def run_two(a):
    torch, gt = setup_torch(True)
    bw = pinned_bandwidth(torch)
    trainer = GpumemTrainer(torch, gt, a)
    alone = counts(torch, gt)
    peer = spawn_generator(a, "generator")
    trainer.share(peer.channel)
    rows = two_process_loop(torch, gt, a, trainer, peer, "two")
    result = {"layout": "two", "pinned": bw, "iterations": rows,
              "parameters": sum(p.numel() for p in trainer.model.parameters())}
    if a.faults:
        result["faults"] = faults(torch, gt, a, trainer, peer, alone)
    else:
        peer.stop()
    result["host_release"] = release_host(gt)
    return result


def faults(torch, gt, a, trainer, peer, alone):
    """The generator killed mid-iteration, then a wake with no room (see the module text)."""
    import gpumem
    out = {}
    try:
        colocate.trainer_iteration(trainer, peer.channel, a.iters,
                                   progress=lambda msg: peer.kill())
        out["kill"] = {"error": "the iteration finished: the generator was not killed"}
    except colocate.PeerClosed:
        status = peer.proc.returncode
        torch.cuda.synchronize()
        time.sleep(1.0)  # the driver reclaims the dead process's memory
        after = counts(torch, gt)
        # The trainer goes on: one more step on the last rollouts' shape, alone.
        seqs = torch.cat([prompts_for(torch, a, trainer.vocab, 0).cuda(),
                          torch.full((a.batch, a.gen_len), 5, device="cuda")], 1)
        with gt.tag("train"):
            loss = train_step(torch, a, trainer.model, trainer.opt, seqs,
                              rewards_for(torch, a, 0), trainer.states)
        trainer.publish()
        peer2 = spawn_generator(a, "generator")
        trainer.share(peer2.channel)
        loss2, meta2, _ = colocate.trainer_iteration(trainer, peer2.channel, a.iters + 1)
        stop = peer2.stop()
        torch.cuda.synchronize()
        time.sleep(1.0)
        end = counts(torch, gt)
        out["kill"] = {"exit_status": status, "trainer_alone_before": alone,
                       "trainer_after_kill": after, "trainer_after_restart_and_stop": end,
                       "fds_leaked": after["fds"] - alone["fds"],
                       "fds_after_stop_over_alone": end["fds"] - alone["fds"],
                       # Both trainer alone, after training steps: a killed generator leaves
                       # no more behind than a stopped one.
                       "device_used_after_kill_over_after_stop":
                           after["device_used"] - end["device_used"],
                       "trainer_step_after_kill_loss": loss, "new_generator_loss": loss2,
                       "new_generator_logits_equal": trainer.last.get("logits_equal"),
                       "new_generator_stop_status": stop}
    # A wake with no room: tag "optim" (AdamW's states, asleep between steps) offloaded, the
    # device filled, wake refused; once there is room, the states come back intact.
    def state_sums():
        return [t.detach().float().sum().item()
                for st in trainer.opt.state.values() for t in st.values()
                if torch.is_tensor(t) and t.is_cuda]
    wake_if_asleep(gt, "optim")
    probe = state_sums()
    gt.sleep("optim", "offload")
    gt.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(max(free - 256 * (1 << 20), 0), dtype=torch.uint8, device="cuda")
    try:
        gt.wake("optim")
        out["no_room"] = {"error": "the wake succeeded with %d bytes free" % (256 << 20)}
    except gpumem.OutOfMemoryError as e:
        still = gt.pool().asleep("optim")
        del ballast
        gt.empty_cache()
        gt.wake("optim")
        out["no_room"] = {"error_type": type(e).__name__, "message": str(e).split("\n")[0],
                          "tag_still_asleep": still, "bytes_restored_after": state_sums() == probe,
                          "states_checked": len(probe)}
    return out


# --- baseline --------------------------------------------------------------------------------

class PinnedOffload:
    """Moves a set of tensors to pinned host memory and back (the tensors' .data), the
    device memory given back with torch.cuda.empty_cache(); the pinned buffers are kept."""

    def __init__(self, torch):
        self.torch = torch
        self.host = {}

    def out(self, tensors):
        torch = self.torch
        for i, t in enumerate(tensors):
            h = self.host.get(i)
            if h is None or h.shape != t.shape:
                h = self.host[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t.data, non_blocking=True)
        torch.cuda.synchronize()
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype, device="cuda")
        torch.cuda.empty_cache()

    def back(self, tensors):
        torch = self.torch
        for i, t in enumerate(tensors):
            t.data = self.host[i].to("cuda", non_blocking=True)
        torch.cuda.synchronize()

    def bytes(self):
        return sum(h.numel() * h.element_size() for h in self.host.values())


class BaselineTrainer:
    """Layout "baseline": PyTorch's allocator; gradients and AdamW states to pinned host
    memory while the generator works; weights sent in buckets through reduce_tensor."""

    def __init__(self, torch, a):
        self.torch, self.a = torch, a
        self.model = build_model(torch, a)
        self.vocab = self.model.config.vocab_size
        self.batch = fixed_batch(torch, a, self.vocab)
        self.opt = make_trainer(torch, a, self.model)
        preallocate_grads(torch, self.model)
        self.offload = PinnedOffload(torch)
        self.states = None  # AdamW's states stay on the device through the training step
        self.reference = logits_of(torch, self.model, self.batch)
        self.last = {}
        self.losses = []
        self.channel = None

    def idle_tensors(self):
        ts = [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.opt.state.values():
            ts += [v for v in st.values() if self.torch.is_tensor(v) and v.is_cuda]
        return ts

    def moved_bytes(self):
        return self.offload.bytes()

    def sleep(self):
        t = sync(self.torch)
        self.offload.out(self.idle_tensors())
        self.last["trainer_sleep_s"] = sync(self.torch) - t

    def wake(self):
        t = sync(self.torch)
        self.offload.back(self.idle_tensors())
        self.last["trainer_wake_s"] = sync(self.torch) - t

    def send_weights(self, channel):
        """verl's pattern: parameters packed into buckets, each shared by reduce_tensor
        (CUDA IPC), copied by the generator into its own parameters, acknowledged."""
        import pickle
        from torch.multiprocessing.reductions import reduce_tensor
        torch = self.torch
        limit = self.a.bucket_mib << 20
        named = [(n, p) for n, p in self.model.named_parameters()]
        i = 0
        while i < len(named):
            group, size = [], 0
            while i < len(named) and (not group or size + named[i][1].numel() * 2 <= limit):
                group.append(named[i])
                size += named[i][1].numel() * 2
                i += 1
            bucket = torch.cat([p.data.reshape(-1) for _, p in group])
            meta = {"names": [n for n, _ in group], "numels": [p.numel() for _, p in group]}
            channel.call("bucket", meta, pickle.dumps(reduce_tensor(bucket))).close()
            del bucket
        torch.cuda.ipc_collect()

    def request(self, iteration):
        self.iteration = iteration
        t = sync(self.torch)
        self.channel.call("wake").close()
        self.last["generator_wake_s"] = sync(self.torch) - t
        t = sync(self.torch)
        self.send_weights(self.channel)
        self.last["sync_s"] = sync(self.torch) - t
        return {"iteration": iteration}, to_bytes(self.torch, prompts_for(
            self.torch, self.a, self.vocab, iteration))

    train = GpumemTrainer.train

    def publish(self):
        self.reference = logits_of(self.torch, self.model, self.batch)


class _NoTag:
    def tag(self, name, all_threads=False):  # pylint: disable=unused-argument
        import contextlib
        return contextlib.nullcontext()


def baseline_generator_main(a):
    torch, _ = setup_torch(False)
    import pickle
    import torch.multiprocessing  # noqa: F401  (CUDA IPC rebuilds)
    model = build_model(torch, a)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    params = dict(model.named_parameters())
    offload = PinnedOffload(torch)
    weights = list(params.values())
    batch = fixed_batch(torch, a, model.config.vocab_size)
    state = {"asleep": False}

    def on_wake(msg, channel):
        if state["asleep"]:
            offload.back(weights)
            state["asleep"] = False
        return {}, b""

    def on_bucket(msg, channel):
        fn, args = pickle.loads(msg.payload)
        bucket = fn(*args)
        off = 0
        for name, n in zip(msg.meta["names"], msg.meta["numels"]):
            params[name].data.view(-1).copy_(bucket[off:off + n])
            off += n
        torch.cuda.synchronize()
        del bucket
        return {}, b""

    def on_generate(msg, channel):
        channel.send("progress", {"stage": "generating"})
        row = {}
        lb, payload = rollout_reply(torch, a, model, batch, msg, row, False)
        t = sync(torch)
        offload.out(weights)  # the weights to the host, the KV cache's blocks freed
        state["asleep"] = True
        row["generator_sleep_s"] = sync(torch) - t
        row["logits_bytes"] = len(lb)
        row["generator"] = counts(torch, None, offload.bytes())
        return row, payload

    channel = colocate.Channel.from_fd(a.channel_fd)
    colocate.serve(channel, {"wake": on_wake, "bucket": on_bucket, "generate": on_generate})
    channel.close()
    return 0


def run_baseline(a):
    torch, _ = setup_torch(False)
    bw = pinned_bandwidth(torch)
    trainer = BaselineTrainer(torch, a)
    trainer.gt = _NoTag()
    peer = spawn_generator(a, "baseline-generator")
    trainer.channel = peer.channel
    rows = two_process_loop(torch, None, a, trainer, peer, "baseline")
    for r in rows:  # the generator's weights move too
        r["moved_bytes"] += sum(p.numel() * 2 for p in trainer.model.parameters())
    peer.stop()
    return {"layout": "baseline", "pinned": bw, "iterations": rows,
            "parameters": sum(p.numel() for p in trainer.model.parameters())}


# --- summaries, capacity and the driver ---------------------------------------------------------

# Iterations that warm up: the first step creates AdamW's states, so the second sleep is the
# first to offload them (and takes the pinned host block the later ones reuse).
WARM_UP = 2


def summarize(result, skip=WARM_UP):
    rows = result["iterations"][skip:] or result["iterations"]
    bw = result["pinned"]

    def values(key):
        return [r[key] for r in rows if r.get(key) is not None]

    def mean(key):
        vals = values(key)
        return sum(vals) / len(vals) if vals else None

    def median(key):
        vals = sorted(values(key))
        return vals[len(vals) // 2] if vals else None

    moved = mean("moved_bytes") or 0
    pinned_s = moved / bw["d2h"] + moved / bw["h2d"]
    per_iteration = [r["sleep_s"] + r["wake_s"] for r in rows]
    ratios = sorted(x / pinned_s for x in per_iteration) if pinned_s else []
    keys = ("generate_s", "train_s", "sync_s", "sleep_s", "wake_s", "train_sleep_s",
            "train_wake_s", "rollout_sleep_s", "rollout_wake_s", "empty_cache_s",
            "trainer_sleep_s", "trainer_wake_s", "generator_sleep_s", "generator_wake_s",
            "optim_sleep_s", "optim_wake_s")
    s = {k + "_mean": mean(k) for k in keys if values(k)}
    s.update({k + "_median": median(k) for k in keys if values(k)})
    s.update(moved_bytes=moved, pinned_copy_s=pinned_s, iterations_summarized=len(rows),
             sleep_wake_over_pinned=ratios[len(ratios) // 2] if ratios else None,
             sleep_wake_over_pinned_range=[ratios[0], ratios[-1]] if ratios else None,
             logits_equal_all=all(r.get("logits_equal") for r in result["iterations"]),
             logits_max_diff=max(r.get("logits_max_diff") or 0 for r in result["iterations"]),
             losses=[r["loss"] for r in result["iterations"]],
             first_generate_s=result["iterations"][0].get("generate_s"),
             graph_bytes_generating=max(values("graph_bytes_generating") or [0]),
             graph_bytes_training=max(values("graph_bytes_training") or [0]))
    for side in ("trainer", "generator"):
        series = [r[side] for r in result["iterations"] if side in r]
        if series:
            s[side + "_growth"] = {k: series[-1][k] - series[skip if len(series) > skip else 0][k]
                                   for k in series[0]}
    return s


def memory_state(torch):
    """What this process holds when it runs out of memory: the device's free bytes, the
    allocator's reserved and allocated bytes and, under gpumem, each tag's, the graph
    pools' and where the pool's reserved bytes go (for the capacity search's failures)."""
    free, total = torch.cuda.mem_get_info()
    state = {"device_free": int(free), "device_total": int(total),
             "reserved": int(torch.cuda.memory_reserved()),
             "allocated": int(torch.cuda.memory_allocated())}
    if "gpumem.torch" in sys.modules:
        gt = sys.modules["gpumem.torch"]
        state["tags"] = {}
        for tag in ("weights", "train", "optim", "rollout"):
            try:
                st = gt.tag_stats(tag)
                state["tags"][tag] = {k: st[k] for k in ("live_bytes", "reserved_bytes",
                                                          "peak_reserved_bytes") if k in st}
            except Exception as e:  # pylint: disable=broad-except
                state["tags"][tag] = str(e)
        state["graph_pools"] = gt.graph_pools()
        try:
            state["explain"] = gt.explain()
        except Exception as e:  # pylint: disable=broad-except
            state["explain"] = str(e)
    return state


# A layout's process that ran out of device memory (in itself, or in its generator) exits
# with this status; any other failure exits otherwise, so the capacity search never counts a
# crash, a timeout or a failing tear-down as "does not fit".
OUT_OF_MEMORY_EXIT = 86


def run_child(a, layout, extra=(), timeout=None):
    """Runs one layout in a fresh process: (its exit status, None on a timeout; its JSON
    when it exited 0)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--layout", layout, "--json", path] + \
        forward_args(a) + list(extra)
    try:
        proc = subprocess.run(cmd, timeout=timeout)
        status = proc.returncode
        out = json.load(open(path)) if status == 0 and os.path.getsize(path) else None
    except subprocess.TimeoutExpired:
        status, out = None, None
    finally:
        os.unlink(path)
    return status, out


def ballast_main(a):
    import torch
    t = torch.empty(a.ballast_bytes, dtype=torch.uint8, device="cuda")
    print("ready", flush=True)
    sys.stdin.read()  # held until the driver closes stdin
    del t
    return 0


def known_bounds(a, layout):
    """(largest batch known to fit, smallest known not to, first batch to try) for the
    capacity search of `layout`: --capacity-bounds's, else (0, None, --capacity-start)."""
    for spec in a.capacity_bounds:
        name, _, rest = spec.partition(":")
        fits, _, fails = rest.partition(":")
        if name == layout:
            lo, hi = int(fits), int(fails)
            if not 0 <= lo < hi or lo % a.group or hi % a.group:
                raise SystemExit("rl_colocate: --capacity-bounds %s: want FITS < FAILS, both "
                                 "multiples of --group" % spec)
            return lo, hi, None
    return 0, None, a.capacity_start


def find_max_batch(a):
    """Largest rollout batch (a multiple of --group) that runs 2 iterations of each layout
    with --cap-gib of device memory free; each try a fresh process."""
    import torch
    cap = int(a.cap_gib * GiB)
    free, total = torch.cuda.mem_get_info()
    ballast = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "ballast",
                                "--ballast-bytes", str(max(free - cap, 0))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert ballast.stdout.readline().strip() == "ready"
    results = {"cap_bytes": cap, "device_total": total, "free_during_search":
               torch.cuda.mem_get_info()[0]}
    try:
        for layout in a.capacity_layouts.split(","):
            tries, failed = [], []

            def fits(b):
                status, _ = run_child(a, layout, ["--iters", "2", "--batch", str(b)],
                                      timeout=300)
                if status not in (0, OUT_OF_MEMORY_EXIT):
                    failed.append({"batch": b, "exit_status": status})
                    print(json.dumps({"capacity": layout, "batch": b, "error": failed[-1]}),
                          flush=True)
                    return None
                tries.append([b, status == 0])
                print(json.dumps({"capacity": layout, "batch": b, "fits": status == 0}),
                      flush=True)
                return status == 0

            lo, hi, b = known_bounds(a, layout)
            while len(tries) < a.capacity_tries:
                batch = b if hi is None else (lo + hi) // 2 // a.group * a.group
                if hi is not None and batch <= lo:
                    break
                ok = fits(batch)
                if ok is None:
                    break  # neither fits nor runs out of memory: the search stops there
                if ok:
                    lo, b = batch, batch * 2
                else:
                    hi = batch
            given = known_bounds(a, layout)
            results[layout] = {"max_batch": lo, "first_failing": hi, "tries": tries,
                               "given_bounds": list(given[:2]) if given[2] is None else None,
                               "errors": failed}
    finally:
        ballast.stdin.close()
        ballast.wait()
    if "baseline" in results and results["baseline"]["max_batch"]:
        for layout in ("one", "two"):
            if layout in results:
                results[layout]["over_baseline"] = \
                    results[layout]["max_batch"] / results["baseline"]["max_batch"]
    return results


def main(argv=None):
    a = parse_args(argv)
    if a.role == "generator":
        return generator_main(a)
    if a.role == "baseline-generator":
        return baseline_generator_main(a)
    if a.role == "ballast":
        return ballast_main(a)
    if a.find_max_batch and a.layout != "all":
        a.capacity_layouts = a.layout
        out = {"capacity": find_max_batch(a)}
    elif a.layout == "all":
        out = {"date": time.strftime("%Y-%m-%d"), "args": vars(a), "layouts": {}}
        for layout in ("baseline", "one", "two"):
            status, r = run_child(a, layout, ["--faults"] if layout == "two" else [])
            if status != 0:
                out["layouts"][layout] = {"error": "the %s run failed (see its stderr)" % layout,
                                          "exit_status": status}
                continue
            out["layouts"][layout] = r
        base = out["layouts"].get("baseline", {}).get("summary", {}).get("losses")
        for layout in ("one", "two"):
            s = out["layouts"].get(layout, {}).get("summary")
            if s and base:
                s["losses_equal_baseline"] = s["losses"] == base
                s["losses_max_diff_baseline"] = max(abs(x - y) for x, y in zip(s["losses"], base))
        if not a.no_capacity:
            out["capacity"] = find_max_batch(a)
    else:
        import torch
        import gpumem
        runner = {"one": run_one, "two": run_two, "baseline": run_baseline}[a.layout]
        try:
            out = runner(a)
        except (torch.OutOfMemoryError, gpumem.OutOfMemoryError) as e:
            # The allocator's whole report too: gpumem's says where every reserved byte is.
            print(json.dumps({"out_of_memory": a.layout, "batch": a.batch,
                              **memory_state(torch), "report": str(e)[:20000]}), flush=True)
            traceback.print_exc()
            return OUT_OF_MEMORY_EXIT
        except colocate.PeerError as e:
            if e.error_type not in ("OutOfMemoryError", "torch.OutOfMemoryError"):
                raise
            print(json.dumps({"out_of_memory": a.layout, "batch": a.batch, "in": "generator",
                              **memory_state(torch), "report": str(e)[:20000]}), flush=True)
            return OUT_OF_MEMORY_EXIT
        out["summary"] = summarize(out)
        out["decode"] = a.decode if a.layout != "baseline" else "eager"
        out["decode_fallback"] = getattr(a, "decode_fallback", None)
        out["device"] = torch.cuda.get_device_name()
        out["torch"] = torch.__version__
        import transformers
        out["transformers"] = transformers.__version__
    text = json.dumps(out, indent=1, default=str)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    if a.role == "main" and (a.layout == "all" or a.find_max_batch):
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
