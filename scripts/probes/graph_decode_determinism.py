#!/usr/bin/env python3
"""Are the decode steps transformers compiles into CUDA graphs deterministic, and do they
give eager decoding's tokens? One process, one Llama-shaped policy with random weights (the
shapes of examples/rl_colocate.py), fixed prompts, greedy decoding:

  eager      generate with transformers' default cache, twice
  graphs     generate over a static cache (compiled decode, CUDA graphs), three times,
             reset between: gpumem.hf.GpumemStaticCache in a tag under gpumem, or
             transformers' StaticCache under PyTorch's own allocator

and, for the first token where two runs part, the largest logit difference of the step
before (a near tie decided the other way, or numbers that are wrong).

    PYTHONPATH=python GPUMEM_LIB=build/src/interop/libgpumem_torch.so \\
        python3 scripts/probes/graph_decode_determinism.py --allocator gpumem --json out.json
    python3 scripts/probes/graph_decode_determinism.py --allocator native

Prints one JSON document: for each pair of runs whether the tokens are equal, and where
they first differ.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))


def first_difference(a, b):
    """(row, position) of the first token where a and b differ, or None."""
    diff = (a != b).nonzero()
    if diff.numel() == 0:
        return None
    pos = int(diff[:, 1].min())
    row = int(diff[diff[:, 1] == pos][0, 0])
    return row, pos


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--allocator", choices=["gpumem", "native"], default="gpumem")
    p.add_argument("--model", default="1b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--json")
    a = p.parse_args()
    import rl_colocate as rl  # the example's model and prompts
    ra = rl.parse_args(["--model", a.model, "--batch", str(a.batch), "--group", "4",
                        "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len)])
    torch, gt = rl.setup_torch(a.allocator == "gpumem")
    model = rl.build_model(torch, ra).eval()
    prompts = rl.prompts_for(torch, ra, model.config.vocab_size, 0).cuda()
    kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=a.gen_len,
                  min_new_tokens=a.gen_len, do_sample=False, pad_token_id=0, use_cache=True)
    runs = {}
    with torch.no_grad():
        for i in range(2):
            runs["eager%d" % i] = model.generate(prompts, **kwargs)
        if gt is not None:
            from gpumem.hf import GpumemStaticCache
            cache = GpumemStaticCache(model.config, max_cache_len=a.prompt_len + a.gen_len,
                                      tag="probe")
        else:
            from transformers import StaticCache
            cache = StaticCache(config=model.config, max_cache_len=a.prompt_len + a.gen_len)
        for i in range(3):
            if i:
                cache.reset()
            runs["graphs%d" % i] = model.generate(prompts, past_key_values=cache, **kwargs)
    out = {"allocator": a.allocator, "model": a.model, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "pairs": {}}
    names = list(runs)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            where = first_difference(runs[x], runs[y])
            entry = {"equal": where is None}
            if where is not None:
                row, pos = where
                entry.update(row=row, position=pos - a.prompt_len)
                # The logits of the step that chose the differing token, from the common prefix.
                prefix = runs[x][row:row + 1, :pos]
                with torch.no_grad():
                    logits = model(input_ids=prefix, use_cache=False).logits[0, -1].float()
                top = torch.topk(logits, 2)
                entry["eager_top2_gap"] = float(top.values[0] - top.values[1])
                entry["tokens"] = [int(runs[x][row, pos]), int(runs[y][row, pos])]
            out["pairs"]["%s-%s" % (x, y)] = entry
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
