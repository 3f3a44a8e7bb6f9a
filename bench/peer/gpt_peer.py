#!/usr/bin/env python3
"""The side-by-side peer (issue 20): crowdgrad's `gpt` model trained in PyTorch on this CPU.

Same data (the sentences corpus, built here by the rules of the Rust loader), same model
(docs: the `gpt` architecture: names, shapes, init), AdamW, warmup + cosine schedule, clipping.
It is a benchmark, not a test dependency: nothing in the Rust workspace imports or runs it.

    python3 bench/peer/gpt_peer.py --tokens 2000000 --save /tmp/peer.pt    # a training run
    python3 bench/peer/gpt_peer.py --bench 30                              # step timings only
    python3 bench/peer/generate.py /tmp/peer.pt --temperature 0.8          # a sample

Output: JSON lines on stdout (one per eval, a first `config` line, a last `final` line); logs
on stderr.
"""
import argparse
import collections
import glob
import json
import math
import os
import subprocess
import sys
import tarfile
import time

import torch
import torch.nn.functional as F

CORPUS_PKG = "nlp-corpus@4.4.0"
UNKNOWN = "\ufffd"  # how the unknown id is shown when decoding (it is not a vocabulary char)


# ---------------------------------------------------------------------------------------------
# Data: the sentences corpus and its windows (the text rules)
# ---------------------------------------------------------------------------------------------

def fetch_corpus(cache):
    """`npm pack nlp-corpus@4.4.0` into `cache` once; returns the folder of doc-*.json."""
    builds = os.path.join(cache, "package", "builds")
    if glob.glob(os.path.join(builds, "doc-*.json")):
        return builds
    os.makedirs(cache, exist_ok=True)
    out = subprocess.run(["npm", "pack", CORPUS_PKG], cwd=cache, check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with tarfile.open(os.path.join(cache, out)) as tar:
        tar.extractall(cache)
    return builds


def build_split(builds):
    """The rules: doc files by number, sentences in order, stripped, inner \\n\\t\\r -> space,
    empties dropped; global index i % 20 == 0 -> valid, the rest -> train; each + "\\n"."""
    files = sorted(glob.glob(os.path.join(builds, "doc-*.json")),
                   key=lambda p: int(os.path.basename(p)[4:-5]))
    sentences = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for item in doc:  # this version is a flat list of strings; flatten documents if not
            items = item if isinstance(item, list) else [item]
            for s in items:
                s = s.strip().replace("\n", " ").replace("\t", " ").replace("\r", " ")
                if s:
                    sentences.append(s)
    train = "".join(s + "\n" for i, s in enumerate(sentences) if i % 20 != 0)
    valid = "".join(s + "\n" for i, s in enumerate(sentences) if i % 20 == 0)
    return train, valid, len(sentences)


def load_text(repo_data, cache):
    """Builds train/valid from the npm tarball; if the repo has data/sentences/{train,valid}.txt
    they must be byte-identical to the build (so the Rust loader and the peer agree)."""
    train, valid, n = build_split(fetch_corpus(cache))
    for name, text in (("train.txt", train), ("valid.txt", valid)):
        path = os.path.join(repo_data, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    sys.exit(f"{path} differs from the build of {CORPUS_PKG} by the rules")
            log(f"{path}: identical to the build")
    return train, valid, n


def build_vocab(train):
    """Level `chars`: distinct scalar values of train.txt sorted by code point, ids 0..n-1, then
    `unknown` = n. With more than 255 distinct, the 255 most frequent are kept (ties: lower code
    point first) and then sorted by code point; the rest map to unknown."""
    counts = collections.Counter(train)
    chars = sorted(counts, key=ord)
    if len(chars) > 255:
        chars = sorted(sorted(counts, key=lambda c: (-counts[c], ord(c)))[:255], key=ord)
    return chars  # V = len(chars) + 1


def encode(text, chars):
    stoi = {c: i for i, c in enumerate(chars)}
    unk = len(chars)
    return torch.tensor([stoi.get(c, unk) for c in text], dtype=torch.long)


def windows(ids, T):
    """Rows of T+1 tokens starting at 0, T, 2T, ...; a tail shorter than T+1 is dropped."""
    rows = (len(ids) - 1) // T
    return ids.unfold(0, T + 1, T)[:rows].contiguous()


# ---------------------------------------------------------------------------------------------
# Model: the `gpt` architecture, parameters named and shaped as the Rust ParamLayout
# ---------------------------------------------------------------------------------------------

def param_specs(L, D, H, T, V, tied=True):
    """(name, shape, init) in ParamLayout order; matrices [in, out] as the Rust layers."""
    std, rstd = 0.02, 0.02 / math.sqrt(2 * L)
    specs = [("tok_emb.weight", (V, D), std), ("pos_emb.weight", (T, D), std)]
    for i in range(L):
        b = f"block{i}."
        specs += [
            (b + "ln1.weight", (D,), "one"), (b + "ln1.bias", (D,), "zero"),
            (b + "attn.qkv.weight", (D, 3 * D), std), (b + "attn.qkv.bias", (3 * D,), "zero"),
            (b + "attn.proj.weight", (D, D), rstd), (b + "attn.proj.bias", (D,), "zero"),
            (b + "ln2.weight", (D,), "one"), (b + "ln2.bias", (D,), "zero"),
            (b + "mlp.fc.weight", (D, 4 * D), std), (b + "mlp.fc.bias", (4 * D,), "zero"),
            (b + "mlp.proj.weight", (4 * D, D), rstd), (b + "mlp.proj.bias", (D,), "zero"),
        ]
    specs += [("ln_f.weight", (D,), "one"), ("ln_f.bias", (D,), "zero")]
    if not tied:
        specs.append(("head.weight", (D, V), std))
    return specs


class GPT(torch.nn.Module):
    def __init__(self, L, D, H, T, V, tied=True, seed=0, attn="sdpa"):
        super().__init__()
        assert D % H == 0, "D % H must be 0"
        self.L, self.D, self.H, self.T, self.V, self.tied, self.attn = L, D, H, T, V, tied, attn
        g = torch.Generator().manual_seed(seed)
        self.names = []
        self.p = torch.nn.ParameterDict()
        for name, shape, init in param_specs(L, D, H, T, V, tied):
            if init == "one":
                t = torch.ones(shape)
            elif init == "zero":
                t = torch.zeros(shape)
            else:
                t = torch.randn(shape, generator=g) * init
            self.p[name.replace(".", "__")] = torch.nn.Parameter(t)
            self.names.append(name)

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def _attention(self, qkv, B, T):
        D, H = self.D, self.H
        hd = D // H
        q, k, v = qkv.split(D, dim=2)  # columns 0..D q, D..2D k, 2D..3D v
        q, k, v = (z.view(B, T, H, hd).transpose(1, 2) for z in (q, k, v))  # head h: h*hd..
        if self.attn == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the spelled-out form of the spec: scores/sqrt(hd), causal mask, stable softmax
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            s = s.masked_fill(mask, float("-inf"))
            out = torch.softmax(s, dim=-1) @ v
        return out.transpose(1, 2).reshape(B, T, D)

    def forward(self, tok):
        """tok: [B, T'] ids with T' <= T; returns logits [B, T', V]."""
        B, T = tok.shape
        D, w = self.D, self.w
        x = w("tok_emb.weight")[tok] + w("pos_emb.weight")[:T]
        for i in range(self.L):
            b = f"block{i}."
            h = F.layer_norm(x, (D,), w(b + "ln1.weight"), w(b + "ln1.bias"), 1e-5)
            h = self._attention(torch.addmm(w(b + "attn.qkv.bias"), h.view(-1, D),
                                            w(b + "attn.qkv.weight")).view(B, T, 3 * D), B, T)
            x = x + torch.addmm(w(b + "attn.proj.bias"), h.reshape(-1, D),
                                w(b + "attn.proj.weight")).view(B, T, D)
            h = F.layer_norm(x, (D,), w(b + "ln2.weight"), w(b + "ln2.bias"), 1e-5)
            h = torch.addmm(w(b + "mlp.fc.bias"), h.view(-1, D), w(b + "mlp.fc.weight"))
            h = F.gelu(h, approximate="tanh")
            x = x + torch.addmm(w(b + "mlp.proj.bias"), h, w(b + "mlp.proj.weight")).view(B, T, D)
        h = F.layer_norm(x, (D,), w("ln_f.weight"), w("ln_f.bias"), 1e-5)
        head = w("tok_emb.weight").t() if self.tied else w("head.weight")
        return (h.view(-1, D) @ head).view(B, T, self.V)

    def loss(self, rows):
        """rows: [B, T+1]; mean cross-entropy over all B*T positions (nats), and accuracy."""
        logits = self(rows[:, :-1])
        tgt = rows[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, self.V), tgt.reshape(-1))
        return loss, logits

    def ordered_params(self):
        return [self.w(n) for n in self.names]


def count_params(model):
    return sum(p.numel() for p in model.ordered_params())


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def lr_at(tokens_done, base_lr, warmup, total):
    """Linear warmup over `warmup` tokens (the step that ends at token t uses lr*t/warmup), then
    cosine from lr down to 10% of lr at `total` tokens."""
    if tokens_done < warmup:
        return base_lr * tokens_done / warmup
    prog = min(1.0, (tokens_done - warmup) / max(1, total - warmup))
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * prog)))


@torch.no_grad()
def evaluate(model, rows, batch=256):
    model.eval()
    tot_loss, tot_ok, n = 0.0, 0, 0
    for i in range(0, len(rows), batch):
        r = rows[i:i + batch]
        loss, logits = model.loss(r)
        k = r.shape[0] * (r.shape[1] - 1)
        tot_loss += loss.item() * k
        tot_ok += (logits.argmax(-1) == r[:, 1:]).sum().item()
        n += k
    model.train()
    return tot_loss / n, tot_ok / n


def parse_model(spec):
    if spec == "gpt":
        return 4, 128, 4, 64
    if not spec.startswith("gpt:"):
        raise argparse.ArgumentTypeError("model is gpt or gpt:L,D,H,T")
    L, D, H, T = (int(x) for x in spec[4:].split(","))
    return L, D, H, T


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj), flush=True)


def make_optimizer(model, lr, wd):
    # One group: weight decay 0.1 on EVERY parameter (the Rust shard optimizer is element-wise
    # and decays all alike). torch's AdamW decays decoupled: p -= lr_t * wd * p.
    return torch.optim.AdamW(model.ordered_params(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=wd, foreach=False)


def bench(model, train_rows, args, gen):
    """Median seconds of a full step (fwd+bwd+clip+AdamW) and of fwd+bwd alone."""
    opt = make_optimizer(model, args.lr, args.weight_decay)
    params = model.ordered_params()

    def batch():
        return train_rows[torch.randint(len(train_rows), (args.batch,), generator=gen)]

    def fb():
        loss, _ = model.loss(batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    def full():
        fb()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    res = {}
    for name, fn in (("step", full), ("fwd_bwd", fb)):
        for _ in range(args.bench_warmup):
            fn()
        ts, cs = [], []
        for _ in range(args.bench):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            ts.append(time.perf_counter() - t0)
            cs.append(time.thread_time() - c0)
        ts.sort()
        cs.sort()
        med, cmed = ts[len(ts) // 2], cs[len(cs) // 2]
        # wall clock, and this thread's CPU time (with --threads 1 torch computes on the calling
        # thread, so CPU time is the step's cost even when other processes share the core)
        res[name] = {"median_s": med, "tokens_per_s": args.batch * model.T / med,
                     "min_s": ts[0], "max_s": ts[-1], "steps": len(ts),
                     "median_cpu_s": cmed, "tokens_per_cpu_s": args.batch * model.T / cmed}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=parse_model, default=(4, 128, 4, 64), help="gpt:L,D,H,T")
    ap.add_argument("--untied", action="store_true", help="a separate head.weight [D, V]")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="training tokens (B*T a step)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="default: tokens/20")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=32, help="windows a step")
    ap.add_argument("--seed", type=int, default=0, help="init and batch sampling")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=204_800, help="tokens between evals")
    ap.add_argument("--eval-windows", type=int, default=0,
                    help="validation windows evaluated, evenly spaced; 0 = all")
    ap.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa")
    ap.add_argument("--bench", type=int, default=0, help="only time N steps (median), no run")
    ap.add_argument("--bench-warmup", type=int, default=5)
    ap.add_argument("--save", default=None, help="checkpoint path for generate.py")
    ap.add_argument("--cache", default="/tmp/nlp-corpus-4.4.0", help="where npm pack unpacks")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--repo-data", default=os.path.join(here, "..", "..", "data", "sentences"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    L, D, H, T = args.model

    train, valid, nsent = load_text(args.repo_data, args.cache)
    chars = build_vocab(train)
    V = len(chars) + 1
    train_rows = windows(encode(train, chars), T)
    valid_rows = windows(encode(valid, chars), T)
    if args.eval_windows and args.eval_windows < len(valid_rows):
        idx = torch.linspace(0, len(valid_rows) - 1, args.eval_windows).round().long()
        eval_rows = valid_rows[idx]
    else:
        eval_rows = valid_rows

    model = GPT(L, D, H, T, V, tied=not args.untied, seed=args.seed, attn=args.attn)
    nparams = count_params(model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tps = args.batch * T
    total = args.tokens
    warmup = args.warmup_tokens if args.warmup_tokens is not None else total // 20
    emit({"config": {
        "model": f"gpt:{L},{D},{H},{T}", "tied": not args.untied, "V": V, "params": nparams,
        "sentences": nsent, "train_chars": len(train), "valid_chars": len(valid),
        "train_windows": len(train_rows), "valid_windows": len(valid_rows),
        "eval_windows": len(eval_rows), "batch": args.batch, "tokens_per_step": tps,
        "tokens": total, "warmup_tokens": warmup, "lr": args.lr, "min_lr": 0.1 * args.lr,
        "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay, "clip": 1.0,
        "seed": args.seed, "threads": torch.get_num_threads(), "attn": args.attn,
        "torch": torch.__version__}})

    if args.bench:
        emit({"bench": bench(model, train_rows, args, gen),
              "model": f"gpt:{L},{D},{H},{T}", "params": nparams, "batch": args.batch,
              "threads": torch.get_num_threads()})
        return

    opt = make_optimizer(model, args.lr, args.weight_decay)
    params = model.ordered_params()
    steps = math.ceil(total / tps)
    done, train_secs, cpu_secs, run_loss, run_n = 0, 0.0, 0.0, 0.0, 0
    next_eval = 0
    curve = []

    def do_eval():
        t0 = time.perf_counter()
        vl, va = evaluate(model, eval_rows)
        rec = {"tokens": done, "seconds": round(train_secs, 3), "cpu_seconds": round(cpu_secs, 3),
               "train_loss": (run_loss / run_n) if run_n else None,
               "val_loss": vl, "val_bpc": vl / math.log(2), "val_acc": va,
               "lr": opt.param_groups[0]["lr"], "eval_seconds": round(time.perf_counter() - t0, 3)}
        emit(rec)
        curve.append(rec)

    for step in range(steps):
        if done >= next_eval:
            do_eval()
            run_loss, run_n = 0.0, 0
            next_eval += args.eval_every
        t0, c0 = time.perf_counter(), time.thread_time()
        lr = lr_at(done + tps, args.lr, warmup, total)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = train_rows[torch.randint(len(train_rows), (args.batch,), generator=gen)]
        loss, _ = model.loss(rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        run_loss += loss.item()
        train_secs += time.perf_counter() - t0
        cpu_secs += time.thread_time() - c0
        done += tps
        run_n += 1
    do_eval()
    final = curve[-1]
    if len(eval_rows) < len(valid_rows):  # the curve used a subset: the end is measured on all
        vl, va = evaluate(model, valid_rows)
        final = {"val_loss": vl, "val_bpc": vl / math.log(2), "val_acc": va}
    emit({"final": {"tokens": done, "seconds": round(train_secs, 3),
                    "valid_windows": len(valid_rows),
                    "tokens_per_s": done / train_secs, "cpu_seconds": round(cpu_secs, 3),
                    "tokens_per_cpu_s": done / cpu_secs, "val_loss": final["val_loss"],
                    "val_bpc": final["val_bpc"], "val_acc": final["val_acc"],
                    "params": nparams, "V": V}})
    if args.save:
        torch.save({"model": f"gpt:{L},{D},{H},{T}", "tied": not args.untied, "chars": chars,
                    "state": {n: model.w(n).detach().clone() for n in model.names},
                    "tokens": done, "val_bpc": final["val_bpc"]}, args.save)
        log(f"saved {args.save}")


if __name__ == "__main__":
    main()
