#!/usr/bin/env python3
"""Load a crowdgrad `gpt` export in Python (numpy + safetensors only) and evaluate it.

    crowdgrad export --server http://127.0.0.1:8080 --out model.safetensors
    python3 bench/peer/load_export.py model.safetensors --valid data/sentences/valid.txt

It reads the tensors by their names (`tok_emb.weight`, `block0.attn.qkv.weight`, ...) and the
run spec from the file's metadata (the model `gpt:L,D,H,T` and the `chars` vocabulary), runs the
`gpt` forward pass written out in numpy (pre-LN blocks, causal attention, tanh GELU, tied or
untied head), and prints the mean cross-entropy over the validation windows the server's
evaluator reads (512 evenly spaced windows of T+1 tokens at stride T). Compare it with the
server's own `eval.loss` at the same versions. `--all` reads every window at stride T, the
whole validation set `crowdgrad sim` evaluates at the end. Needs `pip install numpy safetensors`; a
benchmark script, not a test dependency.
"""
import argparse
import json
import math
import sys

import numpy as np
from safetensors import safe_open

EVAL_WINDOWS = 512  # server/src/coordinator/mod.rs EVAL_WINDOWS


def layer_norm(x, g, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * g + b


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def forward(w, tok, L, D, H):
    """tok: [B, T] ids; returns logits [B, T, V] (float64)."""
    B, T = tok.shape
    hd = D // H
    x = w["tok_emb.weight"][tok] + w["pos_emb.weight"][:T]
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    for i in range(L):
        p = f"block{i}."
        h = layer_norm(x, w[p + "ln1.weight"], w[p + "ln1.bias"])
        qkv = h @ w[p + "attn.qkv.weight"] + w[p + "attn.qkv.bias"]
        q, k, v = (qkv[..., j * D:(j + 1) * D].reshape(B, T, H, hd).transpose(0, 2, 1, 3)
                   for j in range(3))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        s = np.where(mask, -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        a = a.transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + a @ w[p + "attn.proj.weight"] + w[p + "attn.proj.bias"]
        h = layer_norm(x, w[p + "ln2.weight"], w[p + "ln2.bias"])
        h = gelu(h @ w[p + "mlp.fc.weight"] + w[p + "mlp.fc.bias"])
        x = x + h @ w[p + "mlp.proj.weight"] + w[p + "mlp.proj.bias"]
    h = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    head = w["head.weight"] if "head.weight" in w else w["tok_emb.weight"].T
    return h @ head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export")
    ap.add_argument("--valid", required=True, help="the run's valid.txt")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--all", action="store_true",
                    help="every window at stride T (what `crowdgrad sim` reports at the end), "
                         "not the evaluator's 512")
    args = ap.parse_args()

    with safe_open(args.export, "np") as f:
        meta = f.metadata()
        if meta.get("format") != "crowdgrad-model":
            sys.exit(f"{args.export}: not a crowdgrad export (format {meta.get('format')!r})")
        w = {k: f.get_tensor(k).astype(np.float64) for k in f.keys()}
    run = json.loads(meta["run"])
    # The run spec states the model as its layer list: embed (D, T), L blocks (H), layer_norm,
    # head (tied or not).
    layers = run["model"]["layers"]
    kinds = [x["kind"] for x in layers]
    blocks = [x for x in layers if x["kind"] == "block"]
    if kinds[:1] != ["embed"] or not blocks or kinds[-2:] != ["layer_norm", "head"]:
        sys.exit(f"{args.export}: model {json.dumps(run['model'])}, not a gpt")
    D, T, L, H = layers[0]["dim"], layers[0]["context"], len(blocks), blocks[0]["heads"]
    model = f"gpt:{L},{D},{H},{T}"
    text = run["dataset"]["text"]
    if text["level"] != "chars":
        sys.exit("only the chars level is read here")
    chars = text["vocab"]
    stoi = {c: i for i, c in enumerate(chars)}
    unk = len(chars)
    ids = np.array([stoi.get(c, unk) for c in open(args.valid, encoding="utf-8").read()])
    rows = (len(ids) - 1) // T
    n = rows if args.all else min(EVAL_WINDOWS, rows)
    picks = [k * rows // n for k in range(n)]
    windows = np.stack([ids[r * T:r * T + T + 1] for r in picks])
    total, hits = 0.0, 0
    for i in range(0, n, args.batch):
        rb = windows[i:i + args.batch]
        logits = forward(w, rb[:, :-1], L, D, H)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        tgt = rb[:, 1:]
        total += -np.take_along_axis(logp, tgt[..., None], -1).sum()
        hits += int((logits.argmax(-1) == tgt).sum())
    positions = n * T
    loss = total / positions
    print(json.dumps({
        "model": model, "tensors": len(w), "parameters": int(sum(t.size for t in w.values())),
        "versions": json.loads(meta["versions"]), "windows": n,
        "loss": round(loss, 6), "bits_per_char": round(loss / math.log(2), 6),
        "accuracy": round(hits / positions, 6),
    }))


if __name__ == "__main__":
    main()
