#!/usr/bin/env python3
"""Sample text from a checkpoint that gpt_peer.py --save wrote.

    python3 bench/peer/generate.py /tmp/peer.pt --temperature 0.8 --chars 600 --prompt "The "
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_peer import GPT, UNKNOWN, parse_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--chars", type=int, default=600)
    ap.add_argument("--prompt", default="\n", help="a newline starts a fresh sentence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ck = torch.load(args.checkpoint)
    L, D, H, T = parse_model(ck["model"])
    chars = ck["chars"]
    V = len(chars) + 1
    model = GPT(L, D, H, T, V, tied=ck["tied"])
    with torch.no_grad():
        for n, t in ck["state"].items():
            model.w(n).copy_(t)
    model.eval()
    stoi = {c: i for i, c in enumerate(chars)}
    ids = [stoi.get(c, V - 1) for c in args.prompt]
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.chars):
            ctx = torch.tensor([ids[-T:]])
            logits = model(ctx)[0, -1] / args.temperature
            ids.append(torch.multinomial(torch.softmax(logits, -1), 1, generator=g).item())
    text = "".join(chars[i] if i < len(chars) else UNKNOWN for i in ids)
    print(f"# {ck['model']} after {ck['tokens']} tokens (val {ck['val_bpc']:.3f} bits/char), "
          f"temperature {args.temperature}")
    print(text)


if __name__ == "__main__":
    main()
