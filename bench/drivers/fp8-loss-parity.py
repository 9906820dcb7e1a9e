#!/usr/bin/env python3
"""FP8 loss parity (issue 23): a small MoE language model trained from scratch twice, with bf16
expert MLPs and with FP8 ones (`GroupedMLP(..., fp8_recipe=Fp8Recipe())`), from the same seed, the
same initial weights and the same data, and the two loss curves recorded side by side. The claim
checked: final loss (the mean over the last 5% of steps) within 1% relative, and no NaN/inf.

The model (everything but the experts' GEMMs is plain PyTorch, identical in both runs):
- token embedding -> L pre-norm transformer layers -> RMSNorm -> untied output head;
- each layer: RMSNorm -> causal self-attention (`F.scaled_dot_product_attention`, rotary
  positions) -> residual; RMSNorm -> MoE FFN -> residual;
- MoE FFN: a float32 router (linear, softmax, top-k, the k probabilities renormalized), the rows
  sorted by expert (stable argsort, splits by index_add on the device: no host sync), then
  `moe_engine.torch.GroupedMLP` (SwiGLU, glu_layout="blocks:32", router probs passed in, FC1/FC2
  wgrads accumulated into float32 main_grad), the k outputs of a token summed back in float32
  through the inverse permutation (deterministic: no atomics); a Switch-style load-balancing loss
  (coefficient 0.01) is added to the loss that is trained, not to the one recorded.
Optimizer (both runs alike): bf16 model parameters (the router float32), a float32 master copy of
every parameter, AdamW on the masters (betas 0.9/0.95, weight decay 0.1 on matrices), global
gradient-norm clipping at 1.0, linear warm-up over 5% of the steps and a cosine decay to 10% of
the peak rate; after each step the masters are copied into the model and every GroupedMLP's FP8
weight cache is dropped (`invalidate_fp8_weights()`; the copy already bumps the weights' version).

The data is a synthetic language generated from the seed (no files, no network), the same token
stream for both runs:
- vocabulary V; token 0 is a copy marker, the others have Zipfian popularity (exponent 1.1);
- each sequence has a hidden topic (uniform over 4); given the topic, a sparse first-order Markov
  chain: every token has 8 successors, drawn without replacement by popularity, with
  Dirichlet(1) transition probabilities (one table per topic);
- copy structure: at a Markov step (position >= L), with probability 0.03 the marker is emitted
  and the next L = 16 tokens repeat the span of L tokens that starts at a uniformly chosen earlier
  position (ending before the marker), an induction-head task;
- the first token of a sequence is drawn by popularity.
The state the generator conditions on (topic posterior, copy mode, copy candidates) is a function
of the visible past, so the loss of the Bayes-optimal predictor is computable: the script
computes it exactly for a sample of sequences (`entropy_floor_nats`, with its standard error) and
the empirical unigram entropy of the training tokens (what a context-free model reaches).

Usage:
  fp8-loss-parity.py [--precision bf16|fp8|both] [--device cuda|cpu] [--steps 3000] [--seed 0]
                     [--out PREFIX] [--tiny] [model / data / optimizer flags, see --help]
Writes PREFIX.json (both curves, final losses, step times, config, data) and PREFIX.png (the
curves, smoothed and raw, and their relative difference; skipped with a message when matplotlib
is missing: `--out PREFIX --replot` draws it later from the JSON). Exits 1 when a loss is
NaN/inf, or (with both runs, unless --no-check) when the final losses differ by more than
--tolerance (0.01). `scripts/gpu fp8-loss` runs it on the GPU machine.
"""
import argparse
import gc
import inspect
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import moe_engine.torch as me

FULL = dict(layers=6, hidden=512, heads=8, experts=16, top_k=2, ffn=512, vocab=4096, seq=256, batch=16,
            steps=3000, lr=2e-3, topics=4, branching=8, zipf=1.1, copy_prob=0.03, copy_len=16, floor_sequences=256)
TINY = dict(layers=2, hidden=64, heads=2, experts=4, top_k=2, ffn=64, vocab=256, seq=32, batch=4,
            steps=20, lr=3e-3, topics=2, branching=8, zipf=1.1, copy_prob=0.05, copy_len=4, floor_sequences=32)
TAIL = 0.05  # the final loss: the mean over this fraction of the last steps


def fp8_modules_available():
    """True when this moe_engine has the FP8 GroupedMLP (issue 23)."""
    return hasattr(me, "Fp8Recipe") and "fp8_recipe" in inspect.signature(me.GroupedMLP.__init__).parameters


# ---- the synthetic language ----


class SyntheticLanguage:
    """See the module docstring. Tables are built on the CPU in float64 from ``seed``."""

    MARKER = 0

    def __init__(self, vocab, topics, branching, zipf, copy_prob, copy_len, seed):
        if vocab <= branching + 1:
            raise SystemExit(f"--vocab {vocab}: needs more than --branching + 1 = {branching + 1} tokens")
        self.V, self.K, self.b, self.zipf = vocab, topics, branching, zipf
        self.copy_prob, self.L = copy_prob, copy_len
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(vocab - 1, generator=g) + 1  # token ids by popularity rank
        pop = torch.zeros(vocab, dtype=torch.float64)
        pop[order] = 1.0 / torch.arange(1, vocab, dtype=torch.float64) ** zipf
        self.popularity = pop / pop.sum()  # the marker has 0
        logp = self.popularity.log()
        succ = torch.empty(topics, vocab, branching, dtype=torch.int64)
        chunk = max(1, (1 << 22) // vocab)
        for z in range(topics):
            for r in range(0, vocab, chunk):  # Gumbel top-k: sampling without replacement by popularity
                n = min(chunk, vocab - r)
                u = torch.rand(n, vocab, generator=g).clamp_(1e-30, 1 - 1e-7)
                succ[z, r : r + n] = (logp.float() - (-u.log()).log()).topk(branching, dim=1).indices
        e = -torch.rand(topics, vocab, branching, generator=g, dtype=torch.float64).clamp_(1e-300, 1).log()
        self.succ, self.prob = succ, e / e.sum(-1, keepdim=True)  # Dirichlet(1) rows
        self.cum = self.prob.cumsum(-1)
        self.cum[..., -1] = 1.0

    def sample(self, n, length, seed):
        """n sequences of ``length`` tokens, int64 [n, length] on the CPU, vectorized over n."""
        g = torch.Generator().manual_seed(seed)
        x = torch.empty(length, n, dtype=torch.int64)  # position-major while generating
        topic = torch.randint(self.K, (n,), generator=g) * self.V  # row offsets into the tables
        x[0] = torch.multinomial(self.popularity, n, replacement=True, generator=g)
        succ, cum = self.succ.view(-1, self.b), self.cum.view(-1, self.b)
        lanes = torch.arange(n)
        rem = torch.zeros(n, dtype=torch.int64)  # tokens of the current copy still to emit
        src = torch.zeros(n, dtype=torch.int64)  # the position copied next
        marker = torch.full((n,), self.MARKER, dtype=torch.int64)
        L = self.L
        for t in range(1, length):
            u = torch.rand(3, n, generator=g, dtype=torch.float64)
            copying = rem > 0
            row = topic + x[t - 1]
            idx = (u[1].unsqueeze(1) > cum.index_select(0, row)).sum(1, keepdim=True).clamp_max_(self.b - 1)
            nxt = succ.index_select(0, row).gather(1, idx).squeeze(1)
            nxt = torch.where(copying, x.view(-1).index_select(0, src * n + lanes), nxt)
            if t >= L:
                start = ~copying & (u[0] < self.copy_prob)
                nxt = torch.where(start, marker, nxt)
            x[t] = nxt
            src += copying
            rem -= copying.long()
            if t >= L:  # a new copy: the span starting uniformly in [0, t - L], ending before the marker
                j = (u[2] * (t - L + 1)).long().clamp_max_(t - L)
                src = torch.where(start, j, src)
                rem = torch.where(start, L, rem)
        return x.t().contiguous()

    def optimal_nll(self, seq):
        """-log p(x_t | x_<t) under the generator (the Bayes-optimal predictor) for t = 1..len-1:
        the topic posterior is filtered exactly, a copy's source posterior is uniform over the
        spans that match what was copied so far."""
        seq = seq.tolist()
        succ, prob = self._tables()
        K, L, pc = self.K, self.L, self.copy_prob
        post = [1.0 / K] * K
        rem, copied, cand = 0, 0, []
        out = []
        for t in range(1, len(seq)):
            w, prev = seq[t], seq[t - 1]
            if rem > 0:
                keep = [j for j in cand if seq[j + copied] == w]
                out.append(-math.log(len(keep) / len(cand)))
                cand, copied, rem = keep, copied + 1, rem - 1
                continue
            can_copy = t >= L
            if can_copy and w == self.MARKER:
                out.append(-math.log(pc))
                rem, copied, cand = L, 0, list(range(t - L + 1))
                continue
            pz = []
            for z in range(K):
                row = succ[z][prev]
                pz.append(prob[z][prev][row.index(w)] if w in row else 0.0)
            p = sum(a * b for a, b in zip(post, pz))
            out.append(-math.log(p * ((1 - pc) if can_copy else 1.0)))
            post = [a * b / p for a, b in zip(post, pz)]
        return out

    def _tables(self):
        if not hasattr(self, "_lists"):
            self._lists = (self.succ.tolist(), self.prob.tolist())
        return self._lists

    def describe(self):
        return (f"synthetic language (generated from the seed, no files): vocabulary {self.V}, token 0 a copy "
                f"marker, the others with Zipfian popularity (exponent {self.zipf:g}); per sequence a hidden topic "
                f"(uniform over {self.K}) selecting a sparse first-order Markov chain ({self.b} successors per "
                f"token, drawn by popularity without replacement, Dirichlet(1) probabilities); at a Markov step "
                f"at position >= {self.L}, with probability {self.copy_prob:g}, the marker, then a copy of the "
                f"{self.L} tokens starting at a uniformly chosen earlier position (induction); first token by "
                f"popularity")


# ---- the model ----


class RMSNorm(nn.Module):
    def __init__(self, dim, device, dtype, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden, heads, device, dtype):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x, cos, sin):
        B, S, H = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, H))


class MoE(nn.Module):
    def __init__(self, hidden, ffn, experts, top_k, fp8_recipe, device, dtype):
        super().__init__()
        self.E, self.k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False, device=device, dtype=torch.float32)
        fp8 = {} if fp8_recipe is None else {"fp8_recipe": fp8_recipe}
        self.experts = me.GroupedMLP(experts, hidden, ffn, activation="swiglu", glu_layout="blocks:32",
                                     accumulate_into_main_grad=True, device=device, dtype=dtype, **fp8)

    def forward(self, x):
        """x [T, H] -> (y [T, H], load-balancing loss); nothing reads the routing on the host."""
        T, H = x.shape
        scores = torch.softmax(self.router(x.float()), dim=-1)
        probs, expert = scores.topk(self.k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        flat = expert.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the T*k rows sorted by expert
        splits = torch.zeros(self.E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        y = self.experts(x[order // self.k], splits, probs.reshape(-1)[order].contiguous())
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        out = y.float()[inverse].view(T, self.k, H).sum(1)  # the k outputs of each token, in float32
        balance = self.E * (splits.float() / flat.numel() * scores.mean(0)).sum()
        return out.to(x.dtype), balance


class Layer(nn.Module):
    def __init__(self, c, fp8_recipe, device, dtype):
        super().__init__()
        self.norm1 = RMSNorm(c["hidden"], device, dtype)
        self.attn = Attention(c["hidden"], c["heads"], device, dtype)
        self.norm2 = RMSNorm(c["hidden"], device, dtype)
        self.moe = MoE(c["hidden"], c["ffn"], c["experts"], c["top_k"], fp8_recipe, device, dtype)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        y, balance = self.moe(self.norm2(x).view(-1, x.shape[-1]))
        return x + y.view(x.shape), balance


class MoeLM(nn.Module):
    def __init__(self, c, fp8_recipe, device, dtype=torch.bfloat16):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["hidden"], device=device, dtype=dtype)
        self.layers = nn.ModuleList(Layer(c, fp8_recipe, device, dtype) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"], device, dtype)
        self.head = nn.Linear(c["hidden"], c["vocab"], bias=False, device=device, dtype=dtype)
        d = c["hidden"] // c["heads"]
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        angle = torch.arange(c["seq"], dtype=torch.float32, device=device)[:, None] * inv
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        balance = []
        for layer in self.layers:
            x, b = layer(x, self.cos, self.sin)
            balance.append(b)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss, torch.stack(balance).mean()

    def grouped_mlps(self):
        return [m for m in self.modules() if isinstance(m, me.GroupedMLP)]


class MasterAdamW:
    """AdamW on float32 master copies of the model's parameters (the expert weights' gradients come
    from their float32 main_grad, the others' from autograd), global-norm clipping, then the masters
    copied back into the model."""

    def __init__(self, model, lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8):
        self.model = model
        self.pairs = [(p, p.detach().float().clone()) for p in model.parameters()]
        decay = [m for p, m in self.pairs if p.dim() >= 2]
        other = [m for p, m in self.pairs if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
        for mlp in model.grouped_mlps():
            for p in mlp.parameters():
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def step(self, lr, clip):
        for p, m in self.pairs:
            if hasattr(p, "main_grad"):
                m.grad = p.main_grad
            elif p.grad is None:  # not reached by this step's loss
                m.grad = torch.zeros_like(m)
            else:
                m.grad = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], clip)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)  # bumps the version counter: the FP8 weight caches see the change
                p.grad = None
                m.grad = None
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()
        for mlp in self.model.grouped_mlps():
            if hasattr(mlp, "invalidate_fp8_weights"):
                mlp.invalidate_fp8_weights()
        return norm


def learning_rate(step, steps, peak):
    warm = max(1, int(0.05 * steps))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(precision, c, data, init_state, device, log_every):
    """One run; returns the result dict and the model's initial state (for the next run)."""
    torch.manual_seed(c["seed"])
    recipe = me.Fp8Recipe() if precision == "fp8" else None
    model = MoeLM(c, recipe, device)
    identical_init = None
    if init_state is not None:  # the other run's initial weights, loaded (they should be equal already)
        identical_init = all(torch.equal(v, init_state[k].to(v.device)) for k, v in model.state_dict().items())
        model.load_state_dict(init_state)
    init = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    opt = MasterAdamW(model, c["lr"])
    steps, B = c["steps"], c["batch"]
    losses = torch.zeros(steps, dtype=torch.float32, device=device)
    grad_norms = torch.zeros(steps, dtype=torch.float32, device=device)
    warm = min(20, steps // 10)
    sync(device)
    t0 = tw = time.perf_counter()
    for step in range(steps):
        if step == warm:
            sync(device)
            tw = time.perf_counter()
        batch = data[step * B : (step + 1) * B].to(torch.int64)
        loss, balance = model(batch[:, :-1], batch[:, 1:])
        (loss + c["balance_coef"] * balance).backward()
        grad_norms[step] = opt.step(learning_rate(step, steps, c["lr"]), c["clip"]).detach()
        losses[step] = loss.detach()
        if (step + 1) % log_every == 0 or step == steps - 1:
            value = losses[step].item()  # a sync, only when logging
            ms = (time.perf_counter() - t0) * 1e3 / (step + 1)
            print(f"{precision} step {step + 1:5d}/{steps}  loss {value:.4f}  grad norm {grad_norms[step].item():.3f}"
                  f"  {ms:.1f} ms/step so far", flush=True)
    sync(device)
    t1 = time.perf_counter()
    me.check_errors()
    timed = steps - warm
    curve = losses.cpu().tolist()
    tail = curve[-max(1, round(TAIL * steps)) :]
    finite = all(math.isfinite(v) for v in curve)
    result = {
        "loss": curve,
        "grad_norm": grad_norms.cpu().tolist(),
        "final_loss": sum(tail) / len(tail) if finite else None,
        "step_time_ms": (t1 - tw) * 1e3 / timed if timed > 0 else (t1 - t0) * 1e3 / steps,
        "wall_s": t1 - t0,
        "nan_or_inf": not finite,
        "identical_init": identical_init,
    }
    print(f"{precision}: final loss {result['final_loss']} (mean of the last {len(tail)} steps), "
          f"{result['step_time_ms']:.2f} ms/step, {result['wall_s']:.1f} s, nan/inf: {result['nan_or_inf']}",
          flush=True)
    del model, opt, losses, grad_norms
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, init


# ---- output ----


def clean(values):
    return [v if v is None or math.isfinite(v) else None for v in values]


def smooth(values, window):
    out, acc, queue = [], 0.0, []
    for v in values:
        v = float("nan") if v is None else v
        queue.append(v)
        acc += v
        if len(queue) > window:
            acc -= queue.pop(0)
        out.append(acc / len(queue))
    return out


def plot(prefix, report):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no PNG written (pip install matplotlib)")
        return None
    curves = {p: report[f"loss_{p}"] for p in ("bf16", "fp8") if report.get(f"loss_{p}")}
    steps = list(range(1, report["steps"] + 1))
    window = max(1, report["steps"] // 50)
    if len(curves) == 2:
        fig, (ax, dx) = plt.subplots(1, 2, figsize=(14, 5))
    else:
        fig, ax = plt.subplots(1, 1, figsize=(8, 5))
    smoothed = {}
    for name, color in (("bf16", "tab:blue"), ("fp8", "tab:orange")):
        if name not in curves:
            continue
        raw = [float("nan") if v is None else v for v in curves[name]]
        smoothed[name] = smooth(curves[name], window)
        final = report[f"final_loss_{name}"]
        label = f"{name} (final {final:.4f})" if final is not None else f"{name} (NaN/inf)"
        ax.plot(steps, raw, color=color, alpha=0.2, lw=0.6)
        ax.plot(steps, smoothed[name], color=color, lw=1.5, label=label, ls="-" if name == "bf16" else "--")
    d = report["data"]
    ax.axhline(d["unigram_entropy_nats"], color="gray", ls="--", lw=0.8, label="unigram entropy")
    ax.axhline(d["entropy_floor_nats"], color="black", ls=":", lw=0.8, label="entropy floor (optimal predictor)")
    top = max((v for s in smoothed.values() for v in s[window:] if math.isfinite(v)), default=None)
    if top is not None:
        ax.set_ylim(d["entropy_floor_nats"] * 0.9, max(top, d["unigram_entropy_nats"]) * 1.05)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / token)")
    ax.set_title(f"{report['device']}: " + " vs ".join(f"{n} expert MLPs" for n in curves))
    ax.legend()
    if len(smoothed) == 2:
        rel = [100 * (f / b - 1) if b and math.isfinite(b) and math.isfinite(f) else float("nan")
               for b, f in zip(smoothed["bf16"], smoothed["fp8"])]
        dx.plot(steps, rel, color="tab:red", lw=1.2)
        dx.axhline(0, color="gray", lw=0.8)
        for s in (-1, 1):
            dx.axhline(s * 100 * report["tolerance"], color="gray", ls="--", lw=0.8)
        dx.set_ylim(-5, 5)
        dx.set_title(f"fp8 / bf16 - 1 (moving average of {window} steps); final: "
                     f"{100 * report['relative_difference']:.3f}%" if report["relative_difference"] is not None
                     else "fp8 / bf16 - 1")
        dx.set_xlabel("step")
        dx.set_ylabel("%")
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=110)
    plt.close(fig)
    return prefix + ".png"


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=("bf16", "fp8", "both"), default="both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="fp8-loss-parity", help="writes PREFIX.json and PREFIX.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a very small configuration, for CPU smoke tests")
    ap.add_argument("--steps", type=int, help=f"default {FULL['steps']} ({TINY['steps']} with --tiny)")
    for name in ("layers", "hidden", "heads", "experts", "top_k", "ffn", "vocab", "seq", "batch"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, dest=name,
                        help=f"default {FULL[name]} ({TINY[name]} with --tiny)")
    ap.add_argument("--lr", type=float, help=f"peak learning rate, default {FULL['lr']:g}")
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping")
    ap.add_argument("--balance-coef", type=float, default=0.01, help="load-balancing loss coefficient")
    ap.add_argument("--topics", type=int, help="data: hidden topics per language")
    ap.add_argument("--branching", type=int, help="data: successors per token")
    ap.add_argument("--zipf", type=float, help="data: popularity exponent")
    ap.add_argument("--copy-prob", type=float, help="data: probability of a copy at a Markov step")
    ap.add_argument("--copy-len", type=int, help="data: tokens per copy")
    ap.add_argument("--floor-sequences", type=int, help="sequences for the entropy-floor estimate")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--tolerance", type=float, default=0.01, help="relative difference of the final losses")
    ap.add_argument("--no-check", action="store_true", help="exit 0 even when the final losses differ too much")
    ap.add_argument("--replot", action="store_true",
                    help="only write PREFIX.png again from PREFIX.json (e.g. on a machine with matplotlib)")
    a = ap.parse_args(argv)
    base = TINY if a.tiny else FULL
    for k, v in base.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.replot:
        with open(a.out + ".json") as f:
            png = plot(a.out, json.load(f))
        return 0 if png else 1
    device = torch.device(a.device)
    if device.type == "cpu" and a.tiny:
        torch.set_num_threads(1)  # tiny ops: threads only add synchronization (and stall on a busy host)
    runs = ["bf16", "fp8"] if a.precision == "both" else [a.precision]
    if "fp8" in runs:
        if not fp8_modules_available():
            raise SystemExit("fp8-loss-parity: this moe_engine has no FP8 GroupedMLP (moe_engine.torch.Fp8Recipe and "
                             "GroupedMLP(fp8_recipe=...), issue 23); install a build that has them, or run "
                             "--precision bf16")
        if device.type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
            raise SystemExit(f"fp8-loss-parity: the FP8 GEMMs run on Hopper only (compute capability 9.0); "
                             f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
    if a.hidden % a.heads or (a.hidden // a.heads) % 2:
        raise SystemExit(f"--hidden {a.hidden} must be a multiple of 2 x --heads {a.heads}")
    c = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "experts", "top_k", "ffn", "vocab", "seq", "batch",
                                    "steps", "lr", "clip", "balance_coef", "seed")}
    c.update(dtype="bfloat16 parameters (router float32), float32 master weights", optimizer="AdamW on float32 "
             f"masters, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices; gradient-norm clip {a.clip:g}; "
             "warm-up 5% of the steps, cosine to 10%",
             glu="swiglu, blocks:32", tokens_per_step=a.batch * a.seq, final_loss_tail=TAIL)
    print(f"fp8-loss-parity on {device_name(device)}: {a.layers} layers, hidden {a.hidden}, {a.experts} experts "
          f"top-{a.top_k}, ffn {a.ffn}, vocab {a.vocab}, {a.batch} x {a.seq} tokens/step, {a.steps} steps", flush=True)

    t = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small vectorized ops: one thread is fastest (and immune to a busy host)
    lang = SyntheticLanguage(a.vocab, a.topics, a.branching, a.zipf, a.copy_prob, a.copy_len, a.seed)
    data = lang.sample(a.steps * a.batch, a.seq + 1, a.seed + 1)
    counts = torch.bincount(data[:, 1:].reshape(-1), minlength=a.vocab).double()
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * p.log()).sum())
    nll = [lang.optimal_nll(s) for s in data[: min(a.floor_sequences, len(data))]]
    per_seq = [sum(v) / len(v) for v in nll]
    floor = sum(per_seq) / len(per_seq)
    stderr = (sum((v - floor) ** 2 for v in per_seq) / max(1, len(per_seq) - 1) / len(per_seq)) ** 0.5
    markers = float((data == SyntheticLanguage.MARKER).double().mean())
    torch.set_num_threads(threads)
    gen_s = time.perf_counter() - t
    data_info = {
        "description": lang.describe(),
        "vocab": a.vocab, "topics": a.topics, "branching": a.branching, "zipf": a.zipf,
        "copy_prob": a.copy_prob, "copy_len": a.copy_len, "seed": a.seed,
        "sequences": a.steps * a.batch, "sequence_tokens": a.seq + 1, "tokens": a.steps * a.batch * a.seq,
        "reuse": "none: every step reads new sequences, so the training loss is a held-out loss",
        "unigram_entropy_nats": unigram,
        "entropy_floor_nats": floor,
        "entropy_floor_stderr": stderr,
        "entropy_floor_note": f"the mean -log p of the Bayes-optimal predictor (the generator's own posterior) over "
                              f"{len(per_seq)} training sequences, all positions weighted as in the loss",
        "log_vocab_nats": math.log(a.vocab),
        "marker_fraction": markers,
        "generation_s": gen_s,
    }
    print(f"data: {data.numel()} tokens in {gen_s:.1f} s; unigram entropy {unigram:.3f} nats, entropy floor "
          f"{floor:.3f} +- {stderr:.3f} nats (log V = {math.log(a.vocab):.3f})", flush=True)
    data = data.to(torch.int32).to(device)

    report = {
        "device": device_name(device),
        "command": " ".join([os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "fp8-loss-parity.py"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "torch": torch.__version__,
        "steps": a.steps,
        "precision": a.precision,
        "tolerance": a.tolerance,
        "final_loss_bf16": None, "final_loss_fp8": None, "relative_difference": None, "parity_ok": None,
        "loss_bf16": None, "loss_fp8": None,
        "step_time_ms_bf16": None, "step_time_ms_fp8": None,
        "wall_s": {}, "grad_norm": {}, "nan_or_inf": {}, "identical_init": None,
        "config": c,
        "data": data_info,
    }
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)

    def write():
        with open(a.out + ".json", "w") as f:
            json.dump(report, f, indent=1, allow_nan=False)

    init = None
    for precision in runs:
        r, state = train(precision, c, data, init, device, a.log_every)
        init = init or state
        report[f"loss_{precision}"] = clean(r["loss"])
        report[f"final_loss_{precision}"] = r["final_loss"]
        report[f"step_time_ms_{precision}"] = r["step_time_ms"]
        report["wall_s"][precision] = r["wall_s"]
        report["grad_norm"][precision] = clean(r["grad_norm"])
        report["nan_or_inf"][precision] = r["nan_or_inf"]
        if r["identical_init"] is not None:
            report["identical_init"] = r["identical_init"]
        write()  # after each run: a failing second run keeps the first's curve
    b, f = report["final_loss_bf16"], report["final_loss_fp8"]
    if len(runs) == 2 and b is not None and f is not None:
        report["relative_difference"] = abs(f - b) / b
        report["parity_ok"] = report["relative_difference"] <= a.tolerance
    elif len(runs) == 2:
        report["parity_ok"] = False
    write()
    png = plot(a.out, report)
    print(f"wrote {a.out}.json" + (f" and {png}" if png else ""))
    failed = [p for p, bad in report["nan_or_inf"].items() if bad]
    if failed:
        print(f"FAIL: NaN/inf loss in {', '.join(failed)}", file=sys.stderr)
        return 1
    if len(runs) == 2:
        verdict = "PASS" if report["parity_ok"] else "FAIL"
        print(f"{verdict}: final loss bf16 {b:.4f}, fp8 {f:.4f}, relative difference "
              f"{100 * report['relative_difference']:.3f}% (tolerance {100 * a.tolerance:g}%)")
        if not report["parity_ok"] and not a.no_check:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
