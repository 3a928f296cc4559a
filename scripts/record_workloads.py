#!/usr/bin/env python3
"""Record allocation traces of PyTorch workloads unlike the shared ones, to check that
gpumem's pools generalize (the shared traces are examples, not the exam).

Each workload runs under PyTorch's native allocator with memory history on; its trace is
written as a gpumem trace CSV (OUT_DIR/NAME.csv.gz) with the native allocator's own peaks
(OUT_DIR/NAME.json: peak reserved, peak allocated and peak requested bytes), so a replay
can be set beside what PyTorch itself reserved.

Workloads (small models, a few seconds each on an H200):
  ckpt_train     Llama training with gradient checkpointing, batch and sequence varying
                 per step (activations recomputed in backward: other lifetimes)
  conv_multiscale  a convolutional net trained under bf16 autocast on images whose size
                 changes every step (multi-scale training: many distinct sizes)
  encode_varlen  inference only: an encoder over batches of random sequence lengths
                 (an embedding/reranking server: every batch a new shape)
  generate_sampled  Llama generate() with sampling, batch 1-48, prompts 16-768 tokens
  side_stream    training where each batch is copied from pinned host memory on a side
                 stream and handed over with record_stream (two streams in the trace)
  moe_train      top-2 mixture-of-experts blocks: each expert's token count, so its
                 activation sizes, change every step and layer (data-dependent shapes)
  unet_sample    diffusion-style sampling with a U-Net, inference: shapes repeat for the 15
                 steps of a request and change across requests
  gnn_varlen     a graph network trained on random graphs of varying size: gathers and
                 scatter-adds of a new size every step
  lstm_varlen    an LSTM trained on packed batches of random size and length (cuDNN's
                 workspace varies)
  vit_accum      a ViT-style encoder in fp16 with a GradScaler, four micro-batches of random
                 size accumulated per optimizer step
  recsys_sparse  embedding bags with sparse gradients (SparseAdam) and a dense MLP: sparse
                 gradients of a new size every step
  fsdp_layers    FSDP-style: each layer's flat fp32 parameters gathered into a bf16 copy
                 before it runs and dropped after (again in backward, checkpointed); ten
                 layers of five widths, batch and length varying
  beam_search    Llama generate() with 4 beams: a growing cache reordered every token
  multi_model_serve  at most three of six models on the GPU, the least recently used one
                 dropped when a request needs another (weights made and freed over and over)
  clip_contrastive  two towers and a batch x batch similarity loss, batch 128-1024
  speculative_decode  assisted generation: a draft model's proposals checked by the Llama,
                 both caches grown and cut back
  lora_finetune  the Llama frozen in bf16, rank-16 adapters trained, batch and length varying
  vae_decode     a convolutional decoder, latents of 32-128 px to images 8x larger (activations
                 of up to a GiB, a new size every request)
  offload_train  activations saved to pinned host memory in forward (save_on_cpu), back in
                 backward

With --time MODE it records nothing: each workload runs --warm times (default 1: caches,
cuDNN and the pool warmed; more: a long job's steady state) and once more, timed, with the
same random shapes, in this process under PyTorch's allocator (MODE native) or gpumem's
plug-in (MODE gpumem, or gpumem:CONF with a GPUMEM_CONF string), and
OUT_DIR/time_NAME_MODE.json gets the timed run's seconds, the peak reserved and peak
requested bytes over all runs, and (gpumem) the pool's driver time. One workload and mode per process
(--only NAME): a plug-in must be installed before PyTorch allocates, and peaks are the
process's.

Usage (GPU machine, torch and transformers installed):
  record_workloads.py OUT_DIR [--only NAME,NAME] [--seed 0] [--time native|gpumem[:CONF]]
                     [--warm N]
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from snapshot_to_csv import convert, write_csv  # noqa: E402


def small_llama(hidden=1024, layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 128,
                      num_key_value_heads=hidden // 128, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg)


def bf16_llama_on_gpu(torch, hidden, layers):
    """small_llama's weights made in bf16 on the GPU (one allocation each, no fp32 copy)."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = small_llama(hidden, layers)
    torch.set_default_dtype(torch.float32)
    return model


def ckpt_train(torch, rng):
    model = bf16_llama_on_gpu(torch, 1536, 12)
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for _ in range(10):
        batch, seq = rng.choice([2, 4, 8]), rng.choice([256, 512, 768, 1024, 1536])
        ids = torch.randint(0, 32000, (batch, seq), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def conv_multiscale(torch, rng):
    nn = torch.nn

    def stage(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    model = nn.Sequential(stage(3, 64, 2), stage(64, 128, 2), stage(128, 256, 2),
                          stage(256, 512, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(512, 1000)).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(24):
        side = rng.choice([160, 192, 224, 256, 288, 320, 384])
        batch = rng.choice([32, 48, 64])
        x = torch.randn(batch, 3, side, side, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def encode_varlen(torch, rng):
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model=1024, nhead=16, dim_feedforward=4096,
                                       batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
    model = model.cuda().to(torch.bfloat16).eval()
    emb = nn.Embedding(32000, 1024).cuda().to(torch.bfloat16)
    with torch.inference_mode():
        for _ in range(200):
            batch, seq = rng.randint(1, 64), rng.randint(8, 512)
            ids = torch.randint(0, 32000, (batch, seq), device="cuda")
            out = model(emb(ids))
            pooled = torch.nn.functional.normalize(out.mean(dim=1), dim=-1)
            pooled.cpu()


def llama_requests(torch, rng, requests, batch, prompt, new_tokens, **options):
    """The bf16 Llama (1536 hidden, 12 layers) serving `requests` generate() calls, each of a
    random batch, prompt length and number of new tokens (inclusive ranges)."""
    model = bf16_llama_on_gpu(torch, 1536, 12)
    model.eval()
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        for _ in range(requests):
            b, p = rng.randint(*batch), rng.randint(*prompt)
            ids = torch.randint(1, 32000, (b, p), device="cuda")
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=rng.randint(*new_tokens), **options)


def generate_sampled(torch, rng):
    llama_requests(torch, rng, 10, (1, 48), (16, 768), (16, 96), do_sample=True, top_k=50)


def side_stream(torch, rng):
    nn = torch.nn
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048))
                            for _ in range(6)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    copy_stream = torch.cuda.Stream()
    host = [torch.randn(b, 2048).pin_memory() for b in (1024, 2048, 3072, 4096)]
    for _ in range(30):
        src = host[rng.randrange(len(host))]
        with torch.cuda.stream(copy_stream):
            x = src.to("cuda", non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)
        x.record_stream(torch.cuda.current_stream())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x


def moe_train(torch, rng):
    """Top-2 mixture-of-experts blocks trained under bf16 autocast: the tokens routed to each
    expert, so its activations' sizes, change every step and layer."""
    nn, F = torch.nn, torch.nn.functional
    d, experts = 1024, 8

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 16, batch_first=True)
            self.gate = nn.Linear(d, experts, bias=False)
            self.w1 = nn.Parameter(torch.randn(experts, d, 4 * d) * 0.02)
            self.w2 = nn.Parameter(torch.randn(experts, 4 * d, d) * 0.02)

        def forward(self, x):
            h = self.norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            b, t, _ = x.shape
            flat = self.norm2(x).reshape(-1, d)
            weight, expert = self.gate(flat).softmax(-1).topk(2, dim=-1)
            out = torch.zeros_like(flat)
            for e in range(experts):
                token, slot = (expert == e).nonzero(as_tuple=True)
                if token.numel() == 0:
                    continue
                y = F.gelu(flat[token] @ self.w1[e]) @ self.w2[e]
                out = out.index_add(0, token, (y * weight[token, slot, None]).to(out.dtype))
            return x + out.reshape(b, t, d)

    model = nn.Sequential(*[Block() for _ in range(4)]).cuda()
    head = nn.Linear(d, 8000).cuda()
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-4)
    emb = torch.randn(8000, d, device="cuda")
    for _ in range(12):
        batch, seq = rng.choice([4, 8, 16]), rng.choice([128, 256, 512, 1024])
        ids = torch.randint(0, 8000, (batch, seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = head(model(emb[ids]))
        F.cross_entropy(logits.float().reshape(-1, 8000), ids.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def unet_sample(torch, rng):
    """Diffusion-style sampling, inference only in bf16: a U-Net with attention at the lower
    resolutions, 15 denoising steps with classifier-free guidance (batch doubled) per
    request, each request of its own latent size and batch (the same shapes repeat within a
    request, change across requests)."""
    nn, F = torch.nn, torch.nn.functional

    class Res(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x):
            h = self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(x))))))
            return h + self.skip(x)

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n, self.qkv, self.o = nn.GroupNorm(32, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)
            self.heads = c // 64

        def forward(self, x):
            b, c, h, w = x.shape
            q, k, v = self.qkv(self.n(x)).reshape(b, 3, self.heads, c // self.heads, h * w) \
                .transpose(-1, -2).unbind(1)
            y = F.scaled_dot_product_attention(q, k, v)
            return x + self.o(y.transpose(-1, -2).reshape(b, c, h, w))

    class UNet(nn.Module):
        def __init__(self, widths=(128, 256, 512)):
            super().__init__()
            self.inp = nn.Conv2d(4, widths[0], 3, padding=1)
            self.down, self.up = nn.ModuleList(), nn.ModuleList()
            c, last = widths[0], len(widths) - 1
            for i, w in enumerate(widths):
                self.down.append(nn.ModuleList([
                    Res(c, w), Attn(w) if i > 0 else nn.Identity(),
                    nn.Conv2d(w, w, 3, stride=2, padding=1) if i < last else nn.Identity()]))
                c = w
            self.mid = nn.Sequential(Res(c, c), Attn(c), Res(c, c))
            for i, w in reversed(list(enumerate(widths))):
                self.up.append(nn.ModuleList([
                    Res(c + w, w), Attn(w) if i > 0 else nn.Identity(),
                    nn.Upsample(scale_factor=2) if i > 0 else nn.Identity()]))
                c = w
            self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 4, 3, padding=1))

        def forward(self, x):
            h, skips = self.inp(x), []
            for res, attn, down in self.down:
                h = attn(res(h))
                skips.append(h)
                h = down(h)
            h = self.mid(h)
            for res, attn, up in self.up:
                h = up(attn(res(torch.cat([h, skips.pop()], 1))))
            return self.out(h)

    model = UNet().cuda().to(torch.bfloat16).eval()
    with torch.inference_mode():
        for _ in range(8):
            side, batch = rng.choice([32, 48, 64, 80, 96]), rng.choice([1, 2, 4, 8])
            x = torch.randn(batch, 4, side, side, device="cuda", dtype=torch.bfloat16)
            for _ in range(15):
                cond, uncond = model(torch.cat([x, x])).chunk(2)
                x = x - 0.05 * (uncond + 4.0 * (cond - uncond))
            x.float().cpu()


def gnn_varlen(torch, rng):
    """A graph network trained on random graphs of 20k-200k nodes and 8-32 edges a node:
    gathers and scatter-adds whose sizes differ on every step (no two steps alike)."""
    nn = torch.nn
    d = 256
    layers = nn.ModuleList([nn.Linear(2 * d, d) for _ in range(4)]).cuda()
    inp, out = nn.Linear(64, d).cuda(), nn.Linear(d, 16).cuda()
    params = list(layers.parameters()) + list(inp.parameters()) + list(out.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    for _ in range(16):
        nodes = rng.randint(20_000, 200_000)
        edges = nodes * rng.randint(8, 32)
        x = torch.randn(nodes, 64, device="cuda")
        src = torch.randint(0, nodes, (edges,), device="cuda")
        dst = torch.randint(0, nodes, (edges,), device="cuda")
        y = torch.randint(0, 16, (nodes,), device="cuda")
        h = inp(x).relu()
        for lin in layers:
            agg = torch.zeros_like(h).index_add(0, dst, h[src])
            h = h + lin(torch.cat([h, agg / 16], 1)).relu()
        nn.functional.cross_entropy(out(h), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def lstm_varlen(torch, rng):
    """An LSTM language model trained on packed batches of random size and length: cuDNN's
    workspace and every activation change size every step."""
    nn = torch.nn
    emb = nn.Embedding(16000, 512).cuda()
    lstm = nn.LSTM(512, 1024, num_layers=3, batch_first=True).cuda()
    head = nn.Linear(1024, 16000).cuda()
    params = list(emb.parameters()) + list(lstm.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    for _ in range(20):
        batch = rng.randint(8, 64)
        lengths = torch.tensor(sorted((rng.randint(16, 256) for _ in range(batch)), reverse=True))
        ids = torch.randint(0, 16000, (batch, int(lengths[0])), device="cuda")
        pack = nn.utils.rnn.pack_padded_sequence
        out, _ = lstm(pack(emb(ids), lengths, batch_first=True))
        target = pack(ids, lengths, batch_first=True).data
        nn.functional.cross_entropy(head(out.data), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def vit_encoder(torch, d=768, layers=8):
    """A ViT-style encoder on the GPU: 16x16 patches embedded to width d, `layers` pre-norm
    transformer layers (d / 64 heads), mean-pooled into a 1000-class head. Any image side
    that is a multiple of 16 serves (the token count follows it). Returns (parameters,
    forward: images -> logits)."""
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(d_model=d, nhead=d // 64, dim_feedforward=4 * d,
                                       batch_first=True, norm_first=True)
    body = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False).cuda()
    patch, head = nn.Conv2d(3, d, 16, stride=16).cuda(), nn.Linear(d, 1000).cuda()
    params = list(body.parameters()) + list(patch.parameters()) + list(head.parameters())

    def forward(x):
        return head(body(patch(x).flatten(2).transpose(1, 2)).mean(1))

    return params, forward


def vit_accum(torch, rng):
    """A ViT-style encoder trained in fp16 with a GradScaler, gradients accumulated over four
    micro-batches of random size per optimizer step."""
    nn = torch.nn
    params, vit = vit_encoder(torch)
    opt = torch.optim.AdamW(params, lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(8):
        for _ in range(4):
            batch = rng.choice([16, 24, 32, 48])
            x = torch.randn(batch, 3, 224, 224, device="cuda")
            y = torch.randint(0, 1000, (batch,), device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.cross_entropy(vit(x), y) / 4
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


def recsys_sparse(torch, rng):
    """A recommendation model: eight embedding bags of 0.25-4M rows with sparse gradients
    (SparseAdam) and a dense MLP (Adam), batches of 2k-16k samples of 1-60 ids a bag: the
    sparse gradients' sizes change every step."""
    nn = torch.nn
    rows = [1_000_000, 2_000_000, 4_000_000, 500_000, 1_500_000, 3_000_000, 250_000, 2_500_000]
    tables = nn.ModuleList([nn.EmbeddingBag(n, 64, mode="sum", sparse=True) for n in rows]).cuda()
    mlp = nn.Sequential(nn.Linear(64 * len(rows), 1024), nn.ReLU(), nn.Linear(1024, 512),
                        nn.ReLU(), nn.Linear(512, 1)).cuda()
    sparse_opt = torch.optim.SparseAdam(list(tables.parameters()), lr=1e-3)
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    for _ in range(20):
        batch = rng.choice([2048, 4096, 8192, 16384])
        feats = []
        for table, n in zip(tables, rows):
            counts = torch.randint(1, 61, (batch,), device="cuda")
            offsets = torch.cumsum(counts, 0) - counts
            ids = torch.randint(0, n, (int(counts.sum()),), device="cuda")
            feats.append(table(ids, offsets))
        y = torch.rand(batch, 1, device="cuda")
        nn.functional.binary_cross_entropy_with_logits(mlp(torch.cat(feats, 1)), y).backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)


FSDP_WIDTH = 2048


def fsdp_stack(torch, d=FSDP_WIDTH, widths=(4096, 5632, 8192, 6144, 3072) * 2):
    """An FSDP-style layer stack: layer i's parameters are one flat fp32 buffer (two
    matrices d x widths[i] and a norm weight), gathered into a bf16 copy just before the
    layer runs and dropped after it, again in backward (checkpointed), as FSDP all-gathers
    and frees. Returns (the flat parameters, forward: bf16 (batch, seq, d) -> same)."""
    nn, F = torch.nn, torch.nn.functional
    from torch.utils.checkpoint import checkpoint

    flats = [nn.Parameter(torch.randn(2 * d * w + d, device="cuda") * 0.02) for w in widths]

    def layer(x, flat, w):
        full = flat.to(torch.bfloat16)  # the all-gather
        w1, w2 = full[:d * w].view(d, w), full[d * w:2 * d * w].view(w, d)
        h = F.layer_norm(x, (d,), weight=full[2 * d * w:])
        return x + F.gelu(h @ w1) @ w2

    def forward(x):
        for flat, w in zip(flats, widths):
            x = checkpoint(layer, x, flat, w, use_reentrant=False)
        return x

    return flats, forward


def fsdp_layers(torch, rng):
    """FSDP-style training on one GPU: each layer's parameters are one flat fp32 buffer,
    gathered into a bf16 copy just before the layer runs and dropped after it (gathered again
    in backward, under checkpointing), its gradient one flat buffer; ten layers of five
    widths, batch and sequence length varying per step."""
    flats, stack = fsdp_stack(torch)
    opt = torch.optim.AdamW(flats, lr=1e-4)
    for _ in range(12):
        batch, seq = rng.choice([2, 4, 8]), rng.choice([256, 512, 1024])
        x = torch.randn(batch, seq, FSDP_WIDTH, device="cuda", dtype=torch.bfloat16)
        stack(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def beam_search(torch, rng):
    """Llama generate() with beam search (4 beams), batch 1-8, prompts 32-512 tokens: the
    cache grows a token a step and is reordered by the beams kept (index_select)."""
    llama_requests(torch, rng, 6, (1, 8), (32, 512), (16, 64), num_beams=4, do_sample=False)


def multi_model_serve(torch, rng):
    """A server keeping at most three of six models (60-540 MB of fp32 weights, served in
    bf16) on the GPU: each request names a model, some far more popular; one not loaded is
    built on the GPU (fp32, then a bf16 copy) after the least recently used one is dropped;
    each request runs a batch of random size and length."""
    nn = torch.nn
    dims = [(1024, 4), (1536, 6), (2048, 4), (768, 12), (2560, 3), (1280, 8)]  # width, depth

    def build(width, depth):
        with torch.device("cuda"):
            blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                    nn.Linear(4 * width, width)) for _ in range(depth)]
            return nn.Sequential(*blocks).to(torch.bfloat16).eval()

    loaded = {}  # model index -> model, least recently used first
    with torch.no_grad():
        for _ in range(120):
            m = rng.choices(range(len(dims)), [8, 4, 2, 1, 1, 1])[0]
            if m in loaded:
                model = loaded.pop(m)
            else:
                if len(loaded) == 3:
                    loaded.pop(next(iter(loaded)))
                model = build(*dims[m])
            loaded[m] = model
            x = torch.randn(rng.randint(1, 64), rng.randint(16, 256), dims[m][0], device="cuda",
                            dtype=torch.bfloat16)
            model(x).float().mean().item()


def clip_contrastive(torch, rng):
    """CLIP-style contrastive training under bf16 autocast: an image tower (a small conv net)
    and a text tower (a transformer encoder), the loss over the batch x batch similarity
    matrix; batch 128-1024 and text length vary per step."""
    nn, F = torch.nn, torch.nn.functional
    img = nn.Sequential(nn.Conv2d(3, 64, 7, 4, 3), nn.GELU(), nn.Conv2d(64, 256, 3, 2, 1),
                        nn.GELU(), nn.Conv2d(256, 512, 3, 2, 1), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(512, 512)).cuda()
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, norm_first=True)
    txt = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda()
    emb = nn.Embedding(32000, 512).cuda()
    params = list(img.parameters()) + list(txt.parameters()) + list(emb.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(16):
        b = rng.choice([128, 256, 384, 512, 768, 1024])
        x = torch.randn(b, 3, 128, 128, device="cuda")
        ids = torch.randint(0, 32000, (b, rng.choice([32, 64, 77])), device="cuda")
        labels = torch.arange(b, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            i = F.normalize(img(x), dim=-1)
            t = F.normalize(txt(emb(ids)).mean(1), dim=-1)
            logits = (i @ t.T).float() * 14.0
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def speculative_decode(torch, rng):
    """Assisted generation, batch 1: a 4-layer draft model (1024 hidden) proposes tokens that
    the 12-layer Llama checks, prompts 32-512 tokens: both models' caches grow, and are cut
    back when proposals are rejected."""
    model = bf16_llama_on_gpu(torch, 1536, 12)
    draft = bf16_llama_on_gpu(torch, 1024, 4)
    for m in (model, draft):
        m.eval()
        m.generation_config.pad_token_id = 0
    with torch.inference_mode():
        for _ in range(8):
            ids = torch.randint(1, 32000, (1, rng.randint(32, 512)), device="cuda")
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                           max_new_tokens=rng.randint(32, 128), do_sample=False)


def lora_finetune(torch, rng):
    """LoRA fine-tuning: the bf16 Llama (1536 hidden, 12 layers) frozen, rank-16 adapters on
    its attention and MLP projections, AdamW over the adapters only; batch 1-8 x sequence
    128-1024 per step."""
    nn = torch.nn
    model = bf16_llama_on_gpu(torch, 1536, 12)
    model.requires_grad_(False)

    class LoRA(nn.Module):
        def __init__(self, base, rank=16):
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features, device="cuda",
                                              dtype=torch.bfloat16) * 0.01)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank, device="cuda",
                                              dtype=torch.bfloat16))

        def forward(self, x):
            return self.base(x) + (x @ self.a.T) @ self.b.T

    adapters = []
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                lora = LoRA(getattr(parent, name))
                setattr(parent, name, lora)
                adapters += [lora.a, lora.b]
    opt = torch.optim.AdamW(adapters, lr=1e-4)
    model.train()
    for _ in range(16):
        batch, seq = rng.choice([1, 2, 4, 8]), rng.choice([128, 256, 512, 1024])
        ids = torch.randint(0, 32000, (batch, seq), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def vae_decode(torch, rng):
    """A VAE-style convolutional decoder in bf16, inference: latents of 32-128 px decoded to
    images 8x larger, batch 1-4: a few activations of up to a GiB, their sizes changing with
    every request."""
    nn = torch.nn

    def block(cin, cout):
        return nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))

    chans = [512, 512, 256, 128]
    layers = [nn.Conv2d(4, 512, 3, padding=1), block(512, 512), block(512, 512)]
    for cin, cout in zip(chans, chans[1:]):
        layers += [nn.Upsample(scale_factor=2), nn.Conv2d(cin, cout, 3, padding=1),
                   block(cout, cout), block(cout, cout)]
    layers += [nn.GroupNorm(32, 128), nn.SiLU(), nn.Conv2d(128, 3, 3, padding=1)]
    model = nn.Sequential(*layers).cuda().to(torch.bfloat16).eval()
    with torch.inference_mode():
        for _ in range(12):
            side, batch = rng.choice([32, 48, 64, 96, 128]), rng.choice([1, 2, 4])
            z = torch.randn(batch, 4, side, side, device="cuda", dtype=torch.bfloat16)
            model(z).float().clamp(-1, 1).cpu()


def offload_train(torch, rng):
    """Training with activations offloaded to pinned host memory
    (torch.autograd.graph.save_on_cpu): saved tensors leave the GPU in forward and come back
    layer by layer in backward; twelve MLP blocks (1024 wide), batch 1024-4096 per step."""
    nn = torch.nn
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(1024), nn.Linear(1024, 4096), nn.GELU(),
                                          nn.Linear(4096, 1024)) for _ in range(12)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(10):
        x = torch.randn(rng.choice([1024, 2048, 3072, 4096]), 1024, device="cuda")
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


WORKLOADS = {f.__name__: f for f in (ckpt_train, conv_multiscale, encode_varlen,
                                     generate_sampled, side_stream, moe_train, unet_sample,
                                     gnn_varlen, lstm_varlen, vit_accum, recsys_sparse,
                                     fsdp_layers, beam_search, multi_model_serve,
                                     clip_contrastive, speculative_decode, lora_finetune,
                                     vae_decode, offload_train)}


def record(name, out_dir, seed):
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=3_000_000)
    t0 = time.time()
    WORKLOADS[name](torch, rng)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    rows = convert(snapshot, 0)
    path = os.path.join(out_dir, name + ".csv.gz")
    write_csv(rows, path)
    s = torch.cuda.memory_stats()
    peaks = {"workload": name, "events": len(rows), "seconds": round(time.time() - t0, 1),
             "native_peak_reserved": s["reserved_bytes.all.peak"],
             "native_peak_allocated": s["allocated_bytes.all.peak"],
             "native_peak_requested": s["requested_bytes.all.peak"]}
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(peaks, f)
    print(f"{name}: {len(rows)} events in {peaks['seconds']} s; native reserved / allocated "
          f"{peaks['native_peak_reserved'] / peaks['native_peak_allocated']:.4f}", flush=True)


def timed(name, seed, mode, warm_runs=1):
    import torch

    def run():
        torch.manual_seed(seed)
        WORKLOADS[name](torch, random.Random(seed))
        torch.cuda.synchronize()

    names = ["cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemCreate", "pages_reclaimed",
             "cuMemMap.ns", "cuMemUnmap.ns", "cuMemSetAccess.ns", "cuMemCreate.ns", "remap_ns",
             "slack_raises", "driver_ns"]

    def driver_counters():
        if mode == "native":
            return {}
        import gpumem.torch

        return gpumem.torch.counters(0, names)

    for _ in range(warm_runs):
        run()
    before = driver_counters()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    after = driver_counters()
    if mode == "native":
        s = torch.cuda.memory_stats()
        reserved, live = s["reserved_bytes.all.peak"], s["requested_bytes.all.peak"]
    else:
        import gpumem.torch

        s = gpumem.torch.stats(0)
        reserved, live = s["peak_reserved_bytes"], s["peak_live_bytes"]
    r = {"workload": name, "mode": mode, "seconds": round(seconds, 3), "peak_reserved": reserved,
         "peak_requested": live, "reserved_over_requested": round(reserved / live, 4)}
    if mode != "native":
        # Where the pool's driver time went: both runs together, and the timed run alone.
        r["driver_ms"] = round(after["driver_ns"] / 1e6, 1)
        r["timed_driver_ms"] = round((after["driver_ns"] - before["driver_ns"]) / 1e6, 1)
        r["timed_driver"] = {k: after[k] - before[k] for k in names if k != "driver_ns"}
        # The growth slack in force at the end (raised by a remap budget).
        end = gpumem.torch.counters(0, ["growth_slack_permille", "lifetime_hints_active",
                                        "long_lived_allocations", "long_lived_pages_moved"])
        r["growth_slack"] = end["growth_slack_permille"] / 1000
        # Lifetime hints: still guessing at the end (or stopped by their move budget), and
        # their counts over all runs.
        r["lifetime_hints_active"] = end["lifetime_hints_active"]
        r["long_lived_allocations"] = end["long_lived_allocations"]
        r["long_lived_pages_moved"] = end["long_lived_pages_moved"]
    print(json.dumps(r), flush=True)
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--only", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time", default="")
    p.add_argument("--warm", type=int, default=1,
                   help="with --time: runs before the timed one (a long job's steady state)")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    for name in names:
        if name not in WORKLOADS:
            sys.exit(f"record_workloads.py: unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    if args.time:
        if len(names) != 1:
            sys.exit("record_workloads.py: --time runs one workload (--only NAME): the peaks "
                     "are the process's")
        if args.time != "native":
            if not args.time.startswith("gpumem"):
                sys.exit("record_workloads.py: --time takes native, gpumem or gpumem:CONF")
            import gpumem.torch

            gpumem.torch.enable(args.time.partition(":")[2] or None)
        r = timed(names[0], args.seed, args.time, max(0, args.warm))
        path = os.path.join(args.out_dir, "time_%s_%s.json" % (names[0], args.time.replace(":", "_")))
        with open(path, "w") as f:
            json.dump(r, f)
        return 0
    failed = 0
    for name in names:
        try:
            record(name, args.out_dir, args.seed)
        except Exception as e:  # one failing workload must not cost the others
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            import torch
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
