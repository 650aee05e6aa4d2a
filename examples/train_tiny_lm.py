#!/usr/bin/env python3
"""Train a tiny character-level language model twice, with torch's SDPA and with sattn.torch's, and compare.

    PYTHONPATH=build/python build/venv/bin/python examples/train_tiny_lm.py            # check + timing, context 1024
    PYTHONPATH=build/python build/venv/bin/python examples/train_tiny_lm.py --smoke    # loss check only (CI)

Model: a decoder-only transformer, 4 pre-LayerNorm blocks (d_model 256, 4 heads of 64, causal self-attention, GELU MLP
of 4*d_model), learned positions, embeddings tied to the output layer, no dropout; fp32, batch 1, AdamW, on the CPU.

Data: a synthetic English-like text made here from a seeded grammar (subject-verb agreement, adjectives, objects,
places, times, clauses joined by "and"/"because"/"but", numbered paragraphs). It is deterministic (Python's
random.Random with a fixed seed: the same characters on every machine and Python 3 version), 400,000 characters
of a 44-character alphabet, nothing downloaded or stored, and learnable: the loss falls from ln 44 = 3.8 nats/char
to 2.4 in 50 steps at context 1024. Each step takes one window of --context + 1 characters at a random offset
(the inputs and the next-character targets).

The two runs are identical except for the attention function: the sattn model is built and then given the torch
model's state_dict (same initial weights), both have their own AdamW with the same settings, and step i of both uses
the same window (the offsets are drawn once, from --seed). The two implementations alternate step by step, and which
one goes first alternates too, so machine noise (other processes, frequency changes) hits both alike.

Phases: (1) the loss check, --steps steps: the per-step losses must agree to 1e-3 relative, else the script exits 1
naming the step and both losses. (Over hundreds of steps any two fp32 trainings that round differently drift apart:
at context 256, torch's SDPA against a plain softmax(q k^T / sqrt(d)) v crosses 1e-3 at step 214, exactly as against
sattn; hence a check of the first steps.) (2) Timing, --warmup + --timed more steps of the same runs: the step time
is forward + loss + backward + optimizer step (wall clock), reported as medians and the ratio torch/sattn (> 1: sattn
is faster). The attention share is estimated from the two attention functions timed alone (eager, forward +
backward on tensors shaped as in the model, times the number of layers) over the median step time.
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import sattn
    import sattn.torch as sattn_torch
except ImportError:  # run from a checkout without PYTHONPATH: use the build tree's module
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "python"))
    import sattn
    import sattn.torch as sattn_torch

RTOL = 1e-3  # the loss check's relative tolerance
N_LAYERS, D_MODEL, N_HEADS = 4, 256, 4


# ---- data -----------------------------------------------------------------------------------------------------------

def make_corpus(n_chars=400_000, seed=1234):
    """A deterministic English-like text from a small seeded grammar."""
    rng = random.Random(seed)
    nouns = ["cat", "dog", "bird", "fox", "owl", "teacher", "farmer", "robot", "sailor", "king", "queen", "baker"]
    adjectives = ["small", "old", "quiet", "happy", "red", "clever", "tired", "brave", "strange", "green"]
    verbs = [("see", "sees"), ("find", "finds"), ("follow", "follows"), ("help", "helps"), ("carry", "carries"),
             ("watch", "watches"), ("call", "calls"), ("like", "likes")]
    intransitive = [("sleep", "sleeps"), ("sing", "sings"), ("run", "runs"), ("wait", "waits"), ("laugh", "laughs")]
    things = ["apple", "box", "letter", "stone", "basket", "map", "lamp", "key", "book", "coin"]
    places = ["in the garden", "near the river", "at the market", "under the bridge", "on the hill", "in the house"]
    times = ["in the morning", "at night", "every day", "on sunday", "after dinner", "before the rain"]

    def plural_of(word):
        return word + ("es" if word.endswith("x") else "s")

    def noun_phrase(plural):
        words = [rng.choice(adjectives)] if rng.random() < 0.4 else []
        words.append(plural_of(rng.choice(nouns)) if plural else rng.choice(nouns))
        det = rng.choice(["the", "some", "two", "many"] if plural else ["the", "a", "one", "this"])
        if det == "a" and words[0][0] in "aeiou":
            det = "an"
        return " ".join([det] + words)

    def clause():
        plural = rng.random() < 0.4
        parts = [noun_phrase(plural)]
        if rng.random() < 0.3:
            parts.append(rng.choice(intransitive)[0 if plural else 1])   # verbs agree with the subject
        else:
            parts.append(rng.choice(verbs)[0 if plural else 1])
            n = rng.randint(1, 9)
            thing = rng.choice(things)
            parts.append("the " + thing if n == 1 else f"{n} {plural_of(thing)}")
        if rng.random() < 0.5:
            parts.append(rng.choice(places))
        if rng.random() < 0.3:
            parts.append(rng.choice(times))
        return " ".join(parts)

    out, n, paragraph = [], 0, 1
    while n < n_chars:
        sentences = []
        for _ in range(rng.randint(3, 7)):
            s = clause()
            if rng.random() < 0.35:
                s += " " + rng.choice(["and", "because", "but"]) + " " + clause()
            sentences.append(s[0].upper() + s[1:] + rng.choice(".....!?"))
        text = f"{paragraph}. " + " ".join(sentences) + "\n"
        out.append(text)
        n += len(text)
        paragraph += 1
    return "".join(out)[:n_chars]


# ---- model ----------------------------------------------------------------------------------------------------------

def torch_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sattn_attention(q, k, v):
    return sattn_torch.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, L, d = x.shape
        # [B, L, 3d] -> [3, B, heads, L, d/heads]: q, k, v are strided views, no copies
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q, k, v)                        # [B, heads, L, d/heads], causal, scale 1/sqrt(d/heads)
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, context, attention, d=D_MODEL, heads=N_HEADS, layers=N_LAYERS):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()          # tied embeddings
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# ---- measuring ------------------------------------------------------------------------------------------------------

def train_step(model, opt, x, y):
    """One optimizer step; returns (loss, seconds) for forward + loss + backward + AdamW step."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.item(), time.perf_counter() - t0


def attention_seconds(L, repeats):
    """Median time of one attention forward + backward alone, per implementation (alternating), on q/k/v shaped and
    strided as in the model."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, L, 3, N_HEADS, D_MODEL // N_HEADS, generator=g).permute(2, 0, 3, 1, 4)
    grad = torch.randn(1, N_HEADS, L, D_MODEL // N_HEADS, generator=g)
    times = {"torch": [], "sattn": []}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name, attention in (("torch", torch_attention), ("sattn", sattn_attention)):
            q, k, v = (t.detach().requires_grad_() for t in qkv)
            t0 = time.perf_counter()
            attention(q, k, v).backward(grad)
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t[1:]) for n, t in times.items()}


def write_json_atomic(path, data):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".train_tiny_lm.", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=1024, help="sequence length in characters per step (1024)")
    p.add_argument("--steps", type=int, default=50, help="steps of the loss check: the per-step losses of the two "
                   "runs must agree to 1e-3 relative (50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per implementation after the loss check, "
                   "before the timed ones (5)")
    p.add_argument("--timed", type=int, default=20, help="timed steps per implementation; medians are reported (20)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads(N); sattn.torch follows "
                   "torch.get_num_threads() (default: torch's own default)")
    p.add_argument("--float32-precision", choices=("highest", "high", "medium"), default="highest",
                   help="torch.set_float32_matmul_precision for both runs, which sattn.torch follows ('high': float32 "
                   "as two bf16 in sattn's AMX forward; 'medium': rounded to bf16) (highest)")
    p.add_argument("--compile", action="store_true", help="wrap both models with torch.compile(fullgraph=True); the "
                   "first step then includes compiling (its time is printed)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend with --compile (inductor)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate; weight decay 0.01 (1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the window offsets (0)")
    p.add_argument("--check-only", action="store_true", help="run the loss check only, no timing")
    p.add_argument("--time-only", action="store_true", help="run the timing only, no loss check")
    p.add_argument("--smoke", action="store_true", help="fast run for CI: --context 256 --steps 20 --check-only")
    p.add_argument("--json", metavar="PATH", help="write the measured numbers (settings, versions, per-step losses "
                   "and times, medians, ratio) to PATH, atomically")
    args = p.parse_args()
    if args.smoke:
        args.context, args.steps, args.check_only = 256, 20, True
    if args.check_only and args.time_only:
        p.error("--check-only and --time-only exclude each other")
    if args.time_only:
        args.steps = 0
    if args.check_only:
        args.warmup = args.timed = 0
    if args.context < 1 or args.steps < 0 or args.warmup < 0 or args.timed < 0 or (args.threads or 1) < 1:
        p.error("--context and --threads must be positive, --steps/--warmup/--timed non-negative")
    if not args.time_only and args.steps == 0:
        p.error("--steps 0: nothing to check (use --time-only)")
    return args


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.float32_precision)
    result = {"command": " ".join([sys.executable] + sys.argv), "torch": torch.__version__,
              "sattn": sattn.__version__, "threads": torch.get_num_threads(), "context": args.context,
              "compile": args.backend if args.compile else None, "seed": args.seed, "lr": args.lr,
              "float32_precision": args.float32_precision,
              "loadavg_start": os.getloadavg()}
    print(f"command: {result['command']}")
    mode = f"torch.compile(fullgraph=True, backend={args.backend})" if args.compile else "eager"
    print(f"torch {torch.__version__}, sattn {sattn.__version__}, {torch.get_num_threads()} thread(s), context "
          f"{args.context}, {mode}, float32 matmul precision {args.float32_precision}, load average "
          f"{' '.join('%.2f' % a for a in os.getloadavg())}")

    text = make_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    if len(data) <= args.context + 1:
        sys.exit(f"--context {args.context}: the corpus has only {len(data)} characters")
    n_total = args.steps + args.warmup + args.timed
    offsets = torch.randint(0, len(data) - args.context - 1, (n_total,),
                            generator=torch.Generator().manual_seed(args.seed)).tolist()

    torch.manual_seed(args.seed)
    names = ("torch", "sattn")
    models = {"torch": TinyLM(len(chars), args.context, torch_attention),
              "sattn": TinyLM(len(chars), args.context, sattn_attention)}
    models["sattn"].load_state_dict(models["torch"].state_dict())  # same initial weights
    opts = {n: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01) for n, m in models.items()}
    if args.compile:
        models = {n: torch.compile(m, fullgraph=True, backend=args.backend) for n, m in models.items()}
    n_params = sum(p.numel() for p in models["torch"].parameters())
    print(f"model: {N_LAYERS} layers, d_model {D_MODEL}, {N_HEADS} heads of {D_MODEL // N_HEADS}, {n_params:,} "
          f"parameters; data: {len(text):,} characters of synthetic text, vocabulary {len(chars)}")

    losses = {n: [] for n in names}
    times = {n: [] for n in names}
    worst = (-1.0, -1)  # (largest relative difference, its step) in the loss check
    for step, off in enumerate(offsets):
        window = data[off: off + args.context + 1]
        x, y = window[:-1].unsqueeze(0), window[1:].unsqueeze(0)
        for name in (names if step % 2 == 0 else names[::-1]):  # alternate which one goes first
            loss, seconds = train_step(models[name], opts[name], x, y)
            losses[name].append(loss)
            times[name].append(seconds)
        if step == 0 and args.compile:
            print(f"first step (includes compiling): torch {times['torch'][0]:.1f} s, sattn {times['sattn'][0]:.1f} s")
        if step < args.steps:
            lt, ls = losses["torch"][step], losses["sattn"][step]
            rel = abs(lt - ls) / max(abs(lt), 1e-12)
            worst = max(worst, (rel, step))
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d}: loss torch {lt:.6f}, sattn {ls:.6f} nats/char (relative difference {rel:.1e})")
            if not rel <= RTOL:
                msg = (f"loss check FAILED at step {step}: torch loss {lt:.6f}, sattn loss {ls:.6f} nats/char "
                       f"(relative difference {rel:.2e} > {RTOL:g})")
                print(msg, file=sys.stderr)
                if args.json:
                    write_json_atomic(args.json, dict(result, loss_check="failed", failed_step=step, losses=losses))
                sys.exit(1)
            if step == args.steps - 1:
                print(f"loss check passed: {args.steps} steps, largest relative difference {worst[0]:.1e} "
                      f"(step {worst[1]}) <= {RTOL:g}")
    if args.steps:
        result.update(loss_check="passed", check_steps=args.steps, max_rel_loss_diff=worst[0],
                      max_rel_loss_diff_step=worst[1])
    result["losses"] = losses
    if args.compile:
        result["first_step_s"] = {n: times[n][0] for n in names}

    if args.timed:
        first = args.steps + args.warmup
        timed = {n: times[n][first:] for n in names}
        med = {n: statistics.median(timed[n]) for n in names}
        ratio = med["torch"] / med["sattn"]
        print(f"step time (forward + backward + AdamW), median of {args.timed} alternating steps after "
              f"{args.warmup} warm-up: torch {med['torch'] * 1e3:.1f} ms, sattn {med['sattn'] * 1e3:.1f} ms, "
              f"torch/sattn {ratio:.3f} ({'sattn faster' if ratio > 1 else 'torch faster' if ratio < 1 else 'equal'})")
        result.update(step_ms={n: [t * 1e3 for t in timed[n]] for n in names},
                      median_step_ms={n: med[n] * 1e3 for n in names}, ratio_torch_over_sattn=ratio)
        # attention share: the attention functions timed alone (eager), once per layer, over the median step
        att = {n: N_LAYERS * t for n, t in attention_seconds(args.context, max(3, min(10, args.timed))).items()}
        share = {n: att[n] / med[n] for n in names}
        print(f"attention alone (eager forward + backward, x{N_LAYERS} layers, median of alternating runs): torch "
              f"{att['torch'] * 1e3:.1f} ms = {100 * share['torch']:.0f} % of its step, sattn {att['sattn'] * 1e3:.1f}"
              f" ms = {100 * share['sattn']:.0f} % of its step")
        result.update(attention_ms_per_step={n: att[n] * 1e3 for n in names}, attention_share=share)

    result["loadavg_end"] = os.getloadavg()
    print(f"load average at the end: {' '.join('%.2f' % a for a in os.getloadavg())}")
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
