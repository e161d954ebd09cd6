"""
Speed (and, on a GPU, memory) of SLTrain against dense training, always as ratios measured side by side in one run.

    python bench.py --quick                  # a couple of minutes on a 2-core CPU
    python bench.py                          # CPU: layer at 4096 tokens, 60m train steps, optimizer steps on 60m
    python bench.py --size 350m 1b --batch_size 16 --json --out bench.json   # choose the models; write the figures
    python bench.py --suite gpu --data_dir data/c4 --out out/gpu.json        # every GPU figure, one H100
    python bench.py --suite gpu --only layer optimizer                       # some of its sections
    python bench.py --suite tiny                                             # the same code at toy sizes, on CPU
    python bench.py --only inference --size 130m 350m 1b                      # Table 5 on a GPU: forward only
    python bench.py --only step heavy host                                    # the optimizers alone

Sections (--only picks some):
    layer      forward+backward of the SLTrain layer and of the low-rank layer ÷ nn.Linear of the same shape,
               2048x2048, r=128, delta=0.03: 4096 tokens in float32 on CPU (floor 1 + 4r/(3·tokens) = 1.042,
               target <= 1.05), 65536 tokens in bf16 on CUDA (target <= 1.01)
    model      train-step tokens/s of full, lowrank, relora, sltrain (optim.AdamW) and galore (galore.GaLore, the
               steps between its SVDs) (CUDA default: 350m and 1b; paper: sltrain/full = 0.945 at 350m)
    optimizer  step time of optim.AdamW and optim.Adam8bit ÷ torch.optim.AdamW on the same tensors
    inference  forward-only tokens/s and memory of full, sltrain (factors as trained) and sltrain merged once into
               dense weights (the paper's Table 5); CUDA batch 128 at 130m/350m, 32 at 1b/7b
    memory     CUDA only: peak memory at 350m, 1b and 7b (batch 1 x 256, bf16) of full-rank AdamW, full-rank,
               low-rank and GaLore 8-bit per-layer and 8-bit SLTrain per-layer, beside estimate_memory.py's
               estimate of each
               (paper, SLTrain vs full AdamW: -51%, -58%, -73%)
  run only when --only names them, not in a suite:
    step       one step of optim.AdamW, Adam8bit and Adam8bit(compile=True) ÷ torch's foreach AdamW on a 4096x4096
               float32 tensor, on CPU
    heavy      Adam8bit beside float32 AdamW on heavy-tailed gradients (200 steps, three cases), on CPU: the largest
               update ÷ lr of each, and how far the 8-bit run ends from the float32 one
    host       the host time per update of per-layer updates (AdamW, Adam8bit, compiled) for models with the layers
               and trained tensors of each --size (default 60m 350m 7b) at toy width, and the aten operations

--suite gpu: the layer at every projection shape of 60m/350m/1b/7b (N = 32768, bf16), with the parts of SLTrain's
extra work timed alone; model: 350m train steps of the four methods with AdamW and 8-bit per-layer; model_compiled:
the same, compiled as train.py --compile, for full, lowrank and sltrain; amp (train.py --amp beside pure bf16 at
350m); the memory section; the 8-bit step, eager and compiled, against fused AdamW on the 7b shapes, and the host
time of per-layer updates; inference; and, with --data_dir, program: train.py itself (a 60m 8-bit per-layer run,
SIGTERM + --resume, --compile, --sync_debug, torchrun). --suite tiny runs the same code at toy sizes on CPU
(test_bench.py). The sections model_compiled, amp and program exist only in a suite. A suite runs its sections one by
one: after each, its table prints and --out is rewritten, with the section's seconds under "seconds". With or without
a suite, a section that raises is recorded under "errors", --out keeps what is done, the next one runs, and the
command exits non-zero if any failed. The GPU suite has
never run; BENCHMARKS.md splits it with --only into five shorter commands (how long each takes is an estimate).

How we time: every variant runs in its own timed block (CUDA events on a GPU) after warm-up, and the rounds
interleave the variants, alternating their order, so that a shared, noisy machine slows them all alike; a ratio is
the median over rounds of the per-round ratio.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn

import galore
import optim
from checkpoint import atomic_file
from devices import device_from_flag
from estimate_memory import estimate, measure
from export import dense_state
from model import LLaMA, METHODS, SIZES, config_for, is_projection
from sllinear import SLLinear, scaled_mm


# ----------------------------------------------------------------------------- timing

def timed(fn, device):
    """Seconds of one call of fn."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # nothing of the previous variant may run inside this block
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(variants, rounds, device, warmup=2):
    """{name: [seconds per round]}: warm-up calls of each variant, then rounds that run each once, order alternating."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in variants}
    for i in range(rounds):
        for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            times[name].append(timed(variants[name], device))
    return times


def ratio(times, name, base, invert=False):
    """Median over rounds of time[name] / time[base] (>1: name is slower), and the range over rounds, which shows
    how noisy the machine was. invert gives the throughput ratio time[base] / time[name] instead."""
    ratios = sorted(b / a if invert else a / b for a, b in zip(times[name], times[base]))
    return statistics.median(ratios), (ratios[0], ratios[-1])


def summary(times, base, invert=False):
    """Median ms, ratio and its range per variant, and every round's ms for the JSON."""
    out = {}
    for name, seconds in times.items():
        median_ratio, spread = ratio(times, name, base, invert)
        out[name] = dict(ms=1e3 * statistics.median(seconds), ratio=median_ratio, range=spread,
                         rounds_ms=[1e3 * t for t in seconds])
    return out


# ----------------------------------------------------------------------------- sections

def bench_layer(device, tokens, dtype, rounds, dim=2048, rank=128, delta=0.03):
    """Forward+backward (input and weight gradients) of one layer, SLTrain and low-rank ÷ dense."""
    torch.manual_seed(0)
    kw = dict(device=device, dtype=dtype)
    layers = {"dense": nn.Linear(dim, dim, bias=False, **kw), "sltrain": SLLinear(dim, dim, rank, delta, 32.0, **kw),
              "lowrank": SLLinear(dim, dim, rank, 0.0, 32.0, **kw)}
    x = torch.randn(tokens, dim, **kw, requires_grad=True)  # (N, in): an inner layer also needs dL/dx
    g = torch.randn(tokens, dim, **kw)  # (N, out)

    def fwd_bwd(layer):
        params = [x, *layer.parameters()]
        return lambda: torch.autograd.grad(layer(x), params, g)  # returned, not accumulated: no .grad traffic

    times = interleave({name: fwd_bwd(layer) for name, layer in layers.items()}, rounds, device)
    return dict(shape=f"{dim}x{dim}", rank=rank, delta=delta, tokens=tokens, dtype=str(dtype).removeprefix("torch."),
                floor=1 + 4 * rank / (3 * tokens), variants=summary(times, "dense"))


def bench_model(size, batch_size, max_length, device, dtype, rounds):
    """Train-step tokens/s of each method (forward, backward, optim.AdamW step; GaLore's own step), and ÷ full."""
    variants = {}
    for method in (*METHODS, "galore"):
        torch.manual_seed(0)
        model = LLaMA(config_for(size, method="full" if method == "galore" else method), device=device).to(dtype)
        hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        opt = optim.AdamW(model.parameters(), **hyper)
        if method == "galore":  # projections refreshed every 200 updates: the timed steps are the usual ones
            groups = galore.galore_param_groups(model.named_parameters(), model.config.rank,
                                               lambda name, p: is_projection(name))
            opt = galore.GaLore(groups, **hyper)
        idx = torch.randint(model.config.vocab_size, (batch_size, max_length + 1), device=device)

        def step(model=model, opt=opt, idx=idx):
            loss = model(idx[:, :-1], idx[:, 1:].contiguous())[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        variants[method] = step
    times = interleave(variants, rounds, device, warmup=1)
    variants = summary(times, "full", invert=True)  # ratio of throughputs: >1 is faster than full
    for v in variants.values():
        v["tok_s"] = batch_size * max_length / (v["ms"] / 1e3)
    return dict(size=size, batch_size=batch_size, max_length=max_length, dtype=str(dtype).removeprefix("torch."),
                variants=variants)


def bench_optimizer(size, device, dtype, rounds):
    """Step time of our optimizers ÷ torch.optim.AdamW, each on its own copy of the sltrain model's tensors."""
    torch.manual_seed(0)
    base = [p.detach() for p in LLaMA(config_for(size, method="sltrain"), device=device).to(dtype).parameters()]
    grads = [torch.randn_like(p) * 1e-3 for p in base]

    def stepper(cls):
        params = [nn.Parameter(p.clone()) for p in base]
        for p, g in zip(params, grads):
            p.grad = g  # the same gradients every step: the work per step does not depend on their values
        return cls(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1).step

    variants = {"torch.optim.AdamW": stepper(torch.optim.AdamW), "optim.AdamW": stepper(optim.AdamW),
                "optim.Adam8bit": stepper(optim.Adam8bit)}
    times = interleave(variants, rounds, device)
    return dict(size=size, params_m=sum(p.numel() for p in base) / 1e6, dtype=str(dtype).removeprefix("torch."),
                variants=summary(times, "torch.optim.AdamW"))


# ----------------------------------------------------------------------------- the optimizers alone

def bench_step(size=4096, steps=10, warmup=3, rounds=3):
    """One step on a size x size float32 tensor on CPU for each optimizer, each in its own block of steps after a
    warm-up (interleaving single steps would time the allocator), as ratios to torch's foreach AdamW. Each round keeps
    the median step of each block; the best round counts, and range is the ratio's spread over rounds."""
    makers = {
        "torch.optim.AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, foreach=True),
        "AdamW": lambda ps: optim.AdamW(ps, weight_decay=0.1),
        "Adam8bit": lambda ps: optim.Adam8bit(ps, weight_decay=0.1),
        "Adam8bit(compile=True)": lambda ps: optim.Adam8bit(ps, weight_decay=0.1, compile=True),  # compiles in warm-up
    }
    medians = {name: [] for name in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            torch.manual_seed(0)
            p = nn.Parameter(torch.randn(size, size) * 0.02)
            p.grad = torch.randn(size, size) * 1e-3
            opt = make([p])
            for _ in range(warmup):
                opt.step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            medians[name].append(sorted(times)[steps // 2])
    reference = medians["torch.optim.AdamW(foreach=True)"]
    variants = {}
    for name, seconds in medians.items():
        ratios = [s / r for s, r in zip(seconds, reference)]
        variants[name] = dict(ms=min(seconds) * 1e3, ratio=min(seconds) / min(reference),
                              range=(min(ratios), max(ratios)), rounds_ms=[s * 1e3 for s in seconds])
    return dict(size=size, steps=steps, warmup=warmup, rounds=rounds, threads=torch.get_num_threads(),
                variants=variants)


HEAVY_CASES = ("short rows", "long rows", "values")


def heavy_tailed(case, steps=200, lr=1e-3, make=None):
    """Train one tensor for `steps` steps on gradients whose rows differ in scale by orders of magnitude (log-normal,
    σ = 2.3, as the embedding rows of rare and common tokens do; a fixed drift plus fresh noise per entry) with
    float32 AdamW and with make([p]) (Adam8bit by default). Returns (max |update|/lr of each, ||p8 - p32|| /
    ||p32 - p0||). case: "short rows" (64 per row, 4 rows per block), "long rows" (1024, 4 blocks per row) or
    "values" (a flat vector whose entries belong to random rows, as SLTrain's S does)."""
    gen = torch.Generator().manual_seed(0)
    shape, rows = {"short rows": ((512, 64), torch.arange(512 * 64) // 64),
                   "long rows": ((64, 1024), torch.arange(64 * 1024) // 1024),
                   "values": ((32768,), torch.randint(0, 1024, (32768,), generator=gen))}[case]
    scale = torch.exp(2.3 * torch.randn(int(rows.max()) + 1, generator=gen))[rows].view(shape)
    drift = 0.5 * torch.randn(shape, generator=gen)
    p0 = 0.02 * torch.randn(shape, generator=gen)
    params = [nn.Parameter(p0.clone()) for _ in range(2)]
    opts = [optim.AdamW(params[:1], lr=lr), (make or (lambda ps: optim.Adam8bit(ps, lr=lr)))(params[1:])]
    worst = [0.0, 0.0]
    for _ in range(steps):
        g = 1e-3 * scale * (drift + torch.randn(shape, generator=gen))
        for i, (p, opt) in enumerate(zip(params, opts)):
            before, p.grad = p.detach().clone(), g.clone()
            opt.step()
            worst[i] = max(worst[i], (p - before).abs().max().item() / lr)
    p32, p8 = params
    return worst[0], worst[1], ((p8 - p32).norm() / (p32 - p0).norm()).item()


def bench_heavy(steps=200, lr=1e-3):
    """heavy_tailed for each case: {case: dict(adamw=..., adam8bit=..., distance=...)}."""
    rows = {}
    for case in HEAVY_CASES:
        adamw, adam8bit, distance = heavy_tailed(case, steps, lr)
        rows[case] = dict(adamw=adamw, adam8bit=adam8bit, distance=distance)
    return dict(steps=steps, lr=lr, cases=rows)


def per_layer_host_time(device="cpu", size="350m", method="sltrain", rounds=5):
    """Host time of per-layer updates: a training step of a model with the layers and trained tensors of `size`
    (a 350m SLTrain model: 24 blocks, 555 tensors) at the tiny size's width, with per-layer updates, minus the same
    step without them, for AdamW, Adam8bit and Adam8bit(compile=True) (every tensor a projection has takes the 8-bit
    path, as at full width). At that width the arithmetic is negligible and what remains is what the host issues
    for every tensor of every update: Python, dispatch and, on a GPU, kernel launches, whatever the tensors' sizes.
    On CPU the 8-bit step takes the path it takes on a GPU (whole tensors, small ones together), not the chunked
    one. Returns {name: (ms per update, operations per update)} (operations: the aten calls, views included; None
    for compiled code, whose kernels run below the dispatcher)."""
    device = torch.device(device)
    small = 65  # the norms (64 wide here) keep float32 moments, as they do at full width; the rest is 8-bit
    makers = {"none": None, "AdamW": lambda ps: optim.AdamW(ps, lr=1e-3),
              "Adam8bit": lambda ps: optim.Adam8bit(ps, lr=1e-3, min_8bit_size=small),
              "Adam8bit(compile=True)": lambda ps: optim.Adam8bit(ps, lr=1e-3, min_8bit_size=small, compile=True)}
    config = config_for("tiny", method=method, n_layers=config_for(size).n_layers, vocab_size=256)
    idx = torch.randint(256, (1, 17), device=device)
    times, chunked = {}, set(optim.CHUNKED_DEVICES)
    optim.CHUNKED_DEVICES.discard(device.type)
    try:
        for name, make in makers.items():
            torch.manual_seed(0)
            times[name] = _host_step_time(LLaMA(config, device=device), make, idx, rounds, ops="compile" not in name)
    finally:
        optim.CHUNKED_DEVICES.update(chunked)
    (none, none_ops) = times.pop("none")
    return {name: ((t - none) * 1e3, None if n is None else n - none_ops) for name, (t, n) in times.items()}


def count_ops(fn):
    """The number of aten operations fn() issues, views included: on a GPU, about the kernel launches and what else
    the host must do for each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _host_step_time(model, make, idx, rounds, ops):
    """(best seconds, aten operations if ops else None) of a training step of model with per-layer updates by make
    (none if make is None)."""
    sync = (lambda: torch.cuda.synchronize(idx.device)) if idx.device.type == "cuda" else lambda: None
    per_layer = optim.attach_per_layer(model, make) if make else None

    def step():
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        if per_layer is None:
            model.zero_grad(set_to_none=True)

    for _ in range(3):  # the state appears, and compiled code compiles, here
        step()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times), count_ops(step) if ops else None


def bench_host(device, sizes, rounds=5):
    """per_layer_host_time at each size for full and sltrain, with each model's count of trained tensors."""
    rows = []
    for size in sizes:
        for method in ("full", "sltrain"):
            model = LLaMA(config_for(size, method=method), device="meta")
            rows.append(dict(size=size, method=method, tensors=sum(p.requires_grad for p in model.parameters()),
                             host=per_layer_host_time(device, size, method, rounds)))
    return dict(device=str(device), rounds=rounds, rows=rows)


# ----------------------------------------------------------------------------- the GPU suite

# `--suite gpu` runs every figure of the paper's GPU claims in one command (never run yet; split it with --only);
# `--suite tiny` is the same code at toy sizes, which the CPU tests run end to end.
SUITES = {
    "gpu": dict(layer_sizes=("60m", "350m", "1b", "7b"), tokens=32768, model_size="350m", model_batch=64,
                max_length=256, memory_sizes=("350m", "1b", "7b"), memory_steps=3, backend="inductor", rounds=5,
                optimizer_shapes=((4096, 4096), (11008, 4096), (int(0.05 * 4096 * 11008),)),
                program=dict(size="60m", steps=300, batch=64, eval_every=100, eval_tokens=200_000, short=20,
                             compile=True),
                inference_sizes=("130m", "350m", "1b", "7b")),
    "tiny": dict(layer_sizes=("tiny",), tokens=64, model_size="tiny", model_batch=1, max_length=32, vocab=512,
                 memory_sizes=("tiny",), memory_steps=1, backend="eager", rounds=1,
                 optimizer_shapes=((64, 32), (32, 64), (500,)),
                 program=dict(size="tiny", steps=40, batch=2, eval_every=20, eval_tokens=2000, short=4,
                              compile=True),  # per block and the 8-bit step: ~half a minute of inductor on CPU
                 inference_sizes=("tiny",)),
}
# (method, optimizer, per-layer) of the memory figure: full-rank baselines and the paper's 8-bit per-layer setting
# (in this order: the paper's headline pair first; GaLore, whose first step takes an SVD of every projection, runs
# after every other setting of every size)
MEMORY_SETTINGS = (("full", "adamw", False), ("sltrain", "adam8bit", True), ("full", "adam8bit", True),
                   ("lowrank", "adam8bit", True), ("galore", "adam8bit", True))
PAPER_REDUCTION = {"350m": 0.51, "1b": 0.58, "7b": 0.73}  # Figure 3: 8-bit SLTrain per-layer vs full-rank Adam
# Figure 3 does not give its delta; the appendix's memory count for 7b has 194.28M sparse values, delta 0.03, where
# 7b trains at 0.05 (§4.1). Where a size's delta differs, the memory section adds an SLTrain row at this one.
PAPER_MEMORY_DELTA = 0.03


def projection_shapes(size):
    """(out, in) of the distinct projections of a size: attention d×d, MLP up/gate ffn×d and down d×ffn."""
    c = config_for(size)
    return c, ((c.dim, c.dim), (c.ffn_dim, c.dim), (c.dim, c.ffn_dim))


def suite_layer(s, device, dtype, progress=lambda partial: None):
    """SLTrain forward+backward ÷ nn.Linear at every projection shape, and where SLTrain's extra time goes: forming
    W alone (merge) and the parts of sllinear.py's extra work, each timed alone. Forward forms W (form s·BA, scatter
    V into it); backward forms it again, then G = gᵀx (as dense does), the factor gradients G Aᵀ and Bᵀ G, and V's
    gradient (gather G at I). So accounted = dense + 2·(form + scatter) + factor_grads + gather, beside sltrain.
    progress gets the rows after each shape."""
    rows = []
    for size in s["layer_sizes"]:
        c, shapes = projection_shapes(size)
        for out_f, in_f in shapes:
            torch.manual_seed(0)
            kw = dict(device=device, dtype=dtype)
            dense = nn.Linear(in_f, out_f, bias=False, **kw)
            sl = SLLinear(in_f, out_f, c.rank, c.delta, c.alpha, **kw)
            x = torch.randn(s["tokens"], in_f, **kw, requires_grad=True)  # (N, in)
            g = torch.randn(s["tokens"], out_f, **kw)  # (N, out)
            B, A, V, I, scale = sl.B.detach(), sl.A.detach(), sl.values.detach(), sl.indices, sl.scale
            W = torch.zeros(out_f * in_f, **kw)  # (out·in,): the scatter's target
            G = torch.randn(out_f, in_f, **kw)  # (out, in): a weight gradient
            fwd_bwd = lambda layer: lambda: torch.autograd.grad(layer(x), [x, *layer.parameters()], g)
            parts = {"form": lambda: scaled_mm(B, A, scale),  # (out, r) @ (r, in) -> (out, in)
                     "scatter": lambda: W.index_add_(0, I, V),  # (nnz,) into (out·in,)
                     # the factor gradients: (out, r) and (r, in)
                     "factor_grads": lambda: (scaled_mm(G, A.t(), scale), scaled_mm(B.t(), G, scale)),
                     "gather": lambda: G.view(-1).index_select(0, I)}  # (out·in,)[I] -> (nnz,)
            times = interleave({"dense": fwd_bwd(dense), "sltrain": fwd_bwd(sl), "merge": lambda: sl.merged_weight(),
                                **parts}, s["rounds"], device)
            v = summary(times, "dense")
            ms = {name: row["ms"] for name, row in v.items()}
            accounted = ms["dense"] + 2 * (ms["form"] + ms["scatter"]) + ms["factor_grads"] + ms["gather"]
            floor = 1 + 4 * c.rank / (3 * s["tokens"])
            rows.append(dict(size=size, shape=f"{out_f}x{in_f}", rank=c.rank, delta=c.delta, tokens=s["tokens"],
                             floor=floor, accounted_ms=accounted, variants=v))
            del dense, sl, x, g, B, A, V, I, W, G, parts
            progress(rows)
    return rows


def train_step(size, method, optimizer, per_layer, batch_size, max_length, device, dtype, backend=None, vocab=None,
               amp=False):
    """One train step (forward, backward, update) of a fresh model, as train.py does it: bf16 parameters (amp:
    float32 ones under bf16 autocast, train.py --amp), AdamW or 8-bit Adam, per-layer updates inside backward or one
    step after it, optionally compiled as train.py --compile does it: each block (LLaMA.compile_blocks), and the
    8-bit step."""
    torch.manual_seed(0)
    model = LLaMA(config_for(size, method=method, vocab_size=vocab), device=device).to(torch.float32 if amp else dtype)
    model.autocast = torch.bfloat16 if amp else None
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    make = optim.AdamW if optimizer == "adamw" else lambda ps, **kw: optim.Adam8bit(ps, **kw, compile=bool(backend))
    opt = None
    if per_layer:
        optim.attach_per_layer(model, lambda ps: make(ps, **hyper))
    else:
        opt = make(model.parameters(), **hyper)
    if backend:
        model.compile_blocks(backend=backend)
    idx = torch.randint(model.config.vocab_size, (batch_size, max_length + 1), device=device)

    def step():
        loss = model(idx[:, :-1], idx[:, 1:].contiguous())[1]
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def suite_model(s, device, dtype, compiled):
    """Train-step tokens/s ÷ full AdamW, with AdamW and with 8-bit Adam per-layer (all the variants alive at once):
    eager, the four methods; compiled (each block and the 8-bit step, as train.py --compile), the three the
    issue's targets name (each method's block compiles once)."""
    methods = ("full", "lowrank", "sltrain") if compiled else METHODS
    variants = {f"{m}/{o}{'/per_layer' if pl else ''}":
                train_step(s["model_size"], m, o, pl, s["model_batch"], s["max_length"], device, dtype,
                           s["backend"] if compiled else None, s.get("vocab"))
                for o, pl in (("adamw", False), ("adam8bit", True)) for m in methods}
    times = interleave(variants, s["rounds"], device, warmup=2 if compiled else 1)  # compiling is warm-up
    v = summary(times, "full/adamw", invert=True)
    for row in v.values():
        row["tok_s"] = s["model_batch"] * s["max_length"] / (row["ms"] / 1e3)
    return dict(size=s["model_size"], batch_size=s["model_batch"], max_length=s["max_length"], compiled=compiled,
                variants=v)


def suite_amp(s, device, dtype):
    """train.py --amp (float32 parameters and state, bf16 autocast) beside the paper's pure bf16: train-step tokens/s
    (side by side, ratio to pure bf16) and, on CUDA, the peak memory of each setting alone beside estimate_memory's
    estimate of it (the peak less what was allocated before the model, as suite_memory), full AdamW and sltrain
    8-bit per-layer."""
    def make(method, optimizer, per_layer, amp):
        return train_step(s["model_size"], method, optimizer, per_layer, s["model_batch"], s["max_length"], device,
                          dtype, vocab=s.get("vocab"), amp=amp)

    result = {}
    for m, o, pl in (("full", "adamw", False), ("sltrain", "adam8bit", True)):
        name = f"{m}/{o}{'/per_layer' if pl else ''}"
        times = interleave({"bf16": make(m, o, pl, False), "amp": make(m, o, pl, True)}, s["rounds"], device)
        v = summary(times, "bf16", invert=True)
        gc.collect()
        for amp in (False, True):  # alone, so that the peak is this setting's
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)  # the BLAS workspaces of the steps above
            step = make(m, o, pl, amp)
            for _ in range(2):
                step()
            key = "amp" if amp else "bf16"
            v[key]["tok_s"] = s["model_batch"] * s["max_length"] / (v[key]["ms"] / 1e3)
            est = estimate(s["model_size"], m, None, None, "int32", o, pl, s["model_batch"], s["max_length"],
                           dtype=None if amp else str(dtype).removeprefix("torch."), amp=amp,
                           vocab_size=s.get("vocab"))["train_gb"]
            v[key].update(peak_gb=None, estimate_gb=est, vs_estimate=None)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
                v[key].update(peak_gb=peak / 1e9, vs_estimate=(peak - base) / 1e9 / est - 1)
            del step
            gc.collect()
        result[name] = v
    return dict(size=s["model_size"], batch_size=s["model_batch"], max_length=s["max_length"], settings=result)


def _reduction(rows, name):
    """1 - the peak of setting name ÷ full AdamW's, once both are measured."""
    full, ours = rows.get("full/adamw", {}).get("gb"), rows.get(name, {}).get("gb")
    return 1 - ours / full if full and ours else None


def suite_memory(s, device, progress=lambda partial: None):
    """Peak memory of one bf16 training step at batch 1 (CUDA: max_memory_allocated; CPU: the profiler's memory
    events, estimate_memory.cpu_peak) of each setting, beside estimate_memory's estimate of the same setting and the
    bytes counted in the same run (parameters, optimizer state, the most gradients alive, saved activations): the
    peak less what these add up to (train) is what the step's temporaries (the logits' gradient, W in backward, the
    optimizer's pieces) add. On CUDA the peak includes what the process held before the model (the BLAS
    workspaces: estimate_memory.measure), reported as base: the estimate is compared with the peak less the base,
    the reduction against full AdamW is of the whole peaks. progress gets the result after each setting."""
    result = {size: dict(settings={}, reduction=None, paper_reduction=PAPER_REDUCTION.get(size))
              for size in s["memory_sizes"]}
    # every size's settings first, then the rows at the appendix's delta, then GaLore (an SVD of every projection
    # at its first step): a command cut short loses GaLore's rows, not the paper's
    main = [(size, *setting, None) for size in s["memory_sizes"] for setting in MEMORY_SETTINGS
            if setting[0] != "galore"]
    paper_delta = [(size, "sltrain", "adam8bit", True, PAPER_MEMORY_DELTA) for size in s["memory_sizes"]
                   if config_for(size).delta != PAPER_MEMORY_DELTA]
    galore = [(size, *setting, None) for size in s["memory_sizes"] for setting in MEMORY_SETTINGS
              if setting[0] == "galore"]
    for size, method, optimizer, per_layer, delta in main + paper_delta + galore:
        rows = result[size]["settings"]
        name = f"{method}/{optimizer}{'/per_layer' if per_layer else ''}{'' if delta is None else f'/delta={delta}'}"
        est = estimate(size, method, None, delta, "int32", optimizer, per_layer, 1, s["max_length"])
        try:
            counted, _ = measure(size, method, None, delta, optimizer, per_layer, 1, s["max_length"],
                                 s["memory_steps"], device)
            gb, base_gb = counted["peak"] / 1e9, counted["base"] / 1e9
        except torch.cuda.OutOfMemoryError:
            counted, gb, base_gb = {}, None, None
        # the estimate is of the step's own memory: the peak less what the process held before the model
        rows[name] = dict(gb=gb, base_gb=base_gb, estimate_gb=est["train_gb"],
                          vs_estimate=None if gb is None else (gb - base_gb) / est["train_gb"] - 1,
                          counted_gb={k: v / 1e9 for k, v in counted.items() if k not in ("peak", "base")})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result[size]["reduction"] = _reduction(rows, "sltrain/adam8bit/per_layer")
        if delta is not None:
            result[size]["reduction_at_paper_delta"] = _reduction(rows, name)
        progress(result)
    return result


def suite_optimizer(s, device, dtype):
    """optim.Adam8bit step, eager and compiled, ÷ torch.optim.AdamW (fused on CUDA) on the 7b shapes, bf16; and the
    host's time per update of per-layer updates for the model section's size (per_layer_host_time): what
    bounds a per-layer GPU step when it exceeds the device's time."""
    torch.manual_seed(0)
    base = [torch.randn(shape, device=device, dtype=dtype) * 0.02 for shape in s["optimizer_shapes"]]
    grads = [torch.randn_like(p) * 1e-3 for p in base]

    def stepper(make):
        params = [nn.Parameter(p.clone()) for p in base]
        for p, g in zip(params, grads):
            p.grad = g
        return make(params).step

    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    reference = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
    times = interleave({"torch.optim.AdamW": stepper(lambda ps: torch.optim.AdamW(ps, **hyper, **reference)),
                        "optim.Adam8bit": stepper(lambda ps: optim.Adam8bit(ps, **hyper)),
                        "optim.Adam8bit(compile=True)": stepper(lambda ps: optim.Adam8bit(ps, **hyper, compile=True))},
                       s["rounds"], device)  # the compiled step compiles in the warm-up
    return dict(shapes=[list(x) for x in s["optimizer_shapes"]], reference=reference,
                variants=summary(times, "torch.optim.AdamW"), host_size=s["model_size"],
                host_ms_per_update={m: per_layer_host_time(device, s["model_size"], m)
                                    for m in ("full", "sltrain")})


def suite_program(s, data_dir, tokenizer, out_dir, progress=lambda partial: None):
    """The real program, train.py with 8-bit Adam per-layer: a run whose loss falls, the same run stopped by SIGTERM
    (two micro-batches per update, so the signal may come within one) and resumed (how close its end is to the
    straight run), --compile, and torchrun's NCCL (or gloo) path. Each run
    is tried on its own: progress gets the results after each, a failed run's error goes in its row, and the section
    raises at the end, naming the runs that failed."""
    import shutil, subprocess  # only this section starts processes and writes files
    p = s["program"]
    for run in ("straight", "signalled", "compiled", "eager_sync", "torchrun"):  # the suite's scratch folders, anew
        shutil.rmtree(os.path.join(out_dir, run), ignore_errors=True)
    base = [sys.executable, "train.py", "--size", p["size"], "--optimizer", "adam8bit", "--per_layer",
            "--data_dir", data_dir, "--tokenizer", tokenizer, "--total_batch_size", str(p["batch"]),
            "--batch_size", str(p["batch"]), "--eval_every", str(p["eval_every"]), "--eval_tokens",
            str(p["eval_tokens"]), "--log_every", "1", "--workers", "1"]
    rows = lambda run: [json.loads(line) for line in open(os.path.join(out_dir, run, "metrics.jsonl"))]

    def train(run, *extra, launcher=()):
        cmd = [*launcher, *base[1 if launcher else 0:], "--out_dir", os.path.join(out_dir, run), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout

    halves = ["--batch_size", str(max(1, p["batch"] // 2))]  # 2 micro-batches per update: a signal can come within one

    def straight():
        train("straight", "--num_training_steps", str(p["steps"]), *halves)
        losses = [r["loss"] for r in rows("straight") if "loss" in r]
        evals = [r["val_loss"] for r in rows("straight") if "val_loss" in r]
        return dict(first_loss=losses[0], last_loss=losses[-1], val_loss=evals,
                    loss_falls=losses[-1] < losses[0] and evals[-1] < evals[0])

    def sigterm_resume():  # SIGTERM as a scheduler sends it: to the whole process group, once the run is half way
        cmd = base + ["--out_dir", os.path.join(out_dir, "signalled"), "--num_training_steps", str(p["steps"]), *halves]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        for line in proc.stdout:  # the log line of the half-way update, as it is printed
            if line.startswith(f"step {p['steps'] // 2}/"):
                os.killpg(proc.pid, signal.SIGTERM)
                break
        said = proc.communicate()[0]
        if not os.path.exists(os.path.join(out_dir, "signalled", "metrics.jsonl")):  # it failed before training
            raise RuntimeError(f"the run to signal failed (exit {proc.returncode}): {said.strip().splitlines()[-1:]}")
        stopped_at = max(r["step"] for r in rows("signalled"))
        train("signalled", "--num_training_steps", str(p["steps"]), "--resume", *halves)
        last, straight_last = rows("signalled")[-1].get("val_loss"), result["straight"].get("val_loss", [None])[-1]
        stop = next((line for line in said.splitlines() if line.startswith("stopped by")), None)
        return dict(stopped_at=stopped_at, exit_code=proc.returncode, stop=stop, last_loss=last,
                    straight_last_loss=straight_last,
                    val_loss_diff=None if None in (last, straight_last) else abs(last - straight_last))

    short = str(p["short"])
    sync = ["--num_training_steps", short, "--log_every", str(p["short"] // 2), "--eval_every", short, "--sync_debug"]

    def compiled():
        out = train("compiled", *sync, "--compile")
        return dict(ok=True, last_loss=rows("compiled")[-1].get("val_loss"), tail=out.splitlines()[-2],
                    sync_debug=out.splitlines()[-1])  # CUDA's own check

    def torchrun():
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        return dict(ok=True, tail=train("torchrun", "--num_training_steps", short, launcher=launcher).splitlines()[-1])

    runs = dict(straight=straight, sigterm_resume=sigterm_resume, compile=compiled if p["compile"] else None,
                sync_debug=lambda: dict(line=train("eager_sync", *sync).splitlines()[-1]),  # every op, and CUDA's check
                torchrun=torchrun)
    result = {}
    for name, run in runs.items():
        if run is None:
            continue
        try:
            result[name] = run()
        except Exception as e:  # a failed run costs itself only: the others still run, and report
            result[name] = dict(error=f"{type(e).__name__}: {e}")
        progress(dict(result))
    failed = [name for name, row in result.items() if "error" in row]
    if failed:
        raise RuntimeError(f"train.py runs failed: {', '.join(failed)} (their errors are in their rows)")
    return result


def run_suite(name, device, sections=None, data_dir=None, tokenizer=None, out_dir="out/suite", result=None,
              out=None):
    """The suite's sections (default: all; program only with C4 shards and a tokenizer: data_dir, tokenizer), one
    after another, into result (a new dict by default), which is returned. After each section: its figures (or under
    "errors" what it raised) and its seconds go into result, memory is freed, the JSON file out is rewritten, and the
    section's table prints, so that a run killed part way keeps, on disk and on screen, every finished section."""
    s = SUITES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def inference(progress):
        rows = []
        for size in s["inference_sizes"]:
            rows.append(bench_inference(size, INFERENCE_BATCH.get(size, 2), s["max_length"], device, dtype,
                                        s["rounds"]))
            progress(rows)
        return rows

    # each takes progress(partial): the long ones pass it what they have finished, which is saved before they go on
    run = dict(layer=lambda p: suite_layer(s, device, dtype, p), model=lambda _: suite_model(s, device, dtype, False),
               model_compiled=lambda _: suite_model(s, device, dtype, True),
               amp=lambda _: suite_amp(s, device, dtype), memory=lambda p: suite_memory(s, device, p),
               optimizer=lambda _: suite_optimizer(s, device, dtype),
               program=lambda p: suite_program(s, data_dir, tokenizer, out_dir, p), inference=inference)
    sections = sections or [k for k in run if k != "program" or data_dir]
    if "program" in sections and not data_dir:
        raise ValueError("the program section trains on C4 shards: pass --data_dir (and --tokenizer)")
    result = {} if result is None else result
    result["suite"] = name
    result.setdefault("seconds", {})
    for k in sections:
        t0 = time.perf_counter()

        def progress(partial, k=k):  # a long section's finished part, on disk before it goes on
            result[k] = partial
            if out:
                write_json(out, result)
        try:
            result[k] = run[k](progress)
        except Exception as e:  # an OOM or a bug costs this section only; KeyboardInterrupt still stops the run
            record_error(result, k, e)
        result["seconds"][k] = time.perf_counter() - t0
        gc.collect()  # the failed section's tensors too: its traceback is gone by now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if out:
            write_json(out, result)
        if k in result:
            try:
                SUITE_REPORTS[k](result)
            except Exception as e:  # the figures are on disk already; a table that cannot print is an error too
                record_error(result, f"{k} (table)", e)
                if out:
                    write_json(out, result)
        print(f"{k}: {result['seconds'][k]:.1f} s{' (failed)' if k in result.get('errors', {}) else ''}", flush=True)
    return result


def record_error(result, section, e):
    """result["errors"][section]: the exception and the last lines of its traceback, printed as well."""
    lines = "".join(traceback.format_exception(e)).splitlines()[-15:]
    result.setdefault("errors", {})[section] = dict(error=f"{type(e).__name__}: {e}", traceback=lines)
    print(f"{section} failed:\n  " + "\n  ".join(lines), flush=True)


def write_json(path, result):
    """The results to path, atomically (checkpoint.atomic_file): a kill mid-write leaves the previous file whole."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_file(path) as f:
        f.write(json.dumps(result, indent=1, default=str).encode())  # default=str: an odd value must not cost the file


def ratio_text(v):
    """A variant's median ratio [lowest-highest round]."""
    return f"x{v['ratio']:.3f} [{v['range'][0]:.2f}-{v['range'][1]:.2f}]"


def report_layer(r):
    print("layer: SLTrain fwd+bwd ÷ nn.Linear (floor 1 + 4r/3N); merge = forming W alone ÷ nn.Linear fwd+bwd; "
          "parts in ms, accounted = dense + 2·(form + scatter) + factor grads + gather")
    for L in r["layer"]:
        v = L["variants"]
        ms = lambda k: f"{v[k]['ms']:.3f}"  # noqa: E731
        print(f"  {L['size']:>4} {L['shape']:>11} r={L['rank']:<4} floor x{L['floor']:.4f} | dense {ms('dense')} ms "
              f"| sltrain {ratio_text(v['sltrain'])} ({v['sltrain']['ratio'] / L['floor'] - 1:+.1%} of floor) | merge "
              f"{ratio_text(v['merge'])}")
        print(f"  {'':>16} form {ms('form')} | scatter {ms('scatter')} | factor grads {ms('factor_grads')} | gather "
              f"{ms('gather')} | accounted {L['accounted_ms']:.3f} of sltrain {ms('sltrain')} ms "
              f"({L['accounted_ms'] / v['sltrain']['ms']:.0%})")


def report_model(r, key="model"):
    M = r[key]
    print(f"model {M['size']} batch {M['batch_size']} x {M['max_length']}, {'compiled' if M['compiled'] else 'eager'}: "
          "tokens/s, ratio to full/adamw")
    for name, row in M["variants"].items():
        print(f"  {name:<28} {row['tok_s']:>10,.0f} tok/s {ratio_text(row)}")


def report_amp(r):
    A = r["amp"]
    for name, v in A["settings"].items():
        def peak(k):
            est = f"estimate {v[k]['estimate_gb']:.2f} GB"
            return f", {est}" if v[k]["peak_gb"] is None else \
                f", peak {v[k]['peak_gb']:.2f} GB ({est}, peak less base {v[k]['vs_estimate']:+.1%})"
        print(f"amp {A['size']} batch {A['batch_size']} x {A['max_length']}, {name}: pure bf16 "
              f"{v['bf16']['tok_s']:,.0f} tok/s{peak('bf16')} | --amp {v['amp']['tok_s']:,.0f} tok/s "
              f"{ratio_text(v['amp'])}{peak('amp')}")


def report_memory(r):
    for size, P in r.get("memory", {}).items():
        paper = "" if P["paper_reduction"] is None else f", paper -{100 * P['paper_reduction']:.0f}%"
        red = "n/a" if P["reduction"] is None else f"-{100 * P['reduction']:.1f}%"
        print(f"memory {size}, batch 1: sltrain 8-bit per-layer vs full AdamW {red}{paper}")
        if "reduction_at_paper_delta" in P:
            at = "n/a" if P["reduction_at_paper_delta"] is None else f"-{100 * P['reduction_at_paper_delta']:.1f}%"
            print(f"  sltrain at delta {PAPER_MEMORY_DELTA}, the appendix's count: {at}")
        for name, row in P["settings"].items():
            gb = "OOM" if row["gb"] is None else (f"{row['gb']:.3f} GB, base {row['base_gb']:.3f} "
                                                  f"({row['vs_estimate']:+.1%} vs estimate)")
            counted = row.get("counted_gb", {})
            parts = "" if not counted else " | counted " + ", ".join(
                f"{k} {counted[k]:.3f}" for k in ("param", "optim", "grad", "act", "train"))
            print(f"  {name:<28} {gb} | estimate {row['estimate_gb']:.3f} GB{parts}")


def report_inference(r):
    for I in r.get("inference", []):
        v = I["variants"]
        peak = lambda m: "" if v[m]["peak_gb"] is None else f", peak {v[m]['peak_gb']:.2f} GB"  # noqa: E731
        print(f"inference {I['size']}, batch {I['batch_size']} x {I['max_length']}, {I['dtype']}, forward only, "
              "throughput vs full")
        print("  " + " | ".join(f"{m} {v[m]['tok_s']:,.0f} tok/s {ratio_text(v[m])}, weights "
                                f"{v[m]['weights_gb']:.3f} GB{peak(m)}" for m in v))


def report_program(r):
    for name, row in r["program"].items():
        print(f"train.py {name}: " + ", ".join(f"{k} {v}" for k, v in row.items()))


def report_suite_optimizer(r):
    O = r["optimizer"]
    print(f"optimizer step on {O['shapes']}, ÷ torch.optim.AdamW({O['reference']}): "
          + " | ".join(f"{k} {v['ms']:.2f} ms {ratio_text(v)}" for k, v in O["variants"].items()))
    for method, host in O["host_ms_per_update"].items():
        print(f"  per-layer updates, host time per update ({O['host_size']} {method} layers at tiny width): "
              + " | ".join(f"{k} {ms:.1f} ms{'' if n is None else f' ({n} ops)'}" for k, (ms, n) in host.items()))


# each suite section's table, printed as the section ends and again, from the JSON alone, by report_suite
SUITE_REPORTS = dict(layer=report_layer, model=report_model,
                     model_compiled=lambda r: report_model(r, "model_compiled"), amp=report_amp, memory=report_memory,
                     inference=report_inference, program=report_program, optimizer=report_suite_optimizer)


def report_suite(r):
    """Every table of a suite's results (the JSON), then the sections that failed."""
    for k, table in SUITE_REPORTS.items():
        if k in r:
            table(r)
    for k, e in r.get("errors", {}).items():
        print(f"{k} failed: {e['error']}")


# the paper's inference batch sizes (Table 5): 128 sequences at 130m and 350m, 32 at 1b and 7b
INFERENCE_BATCH = {"130m": 128, "350m": 128, "1b": 32, "7b": 32}


def inference_models(size, device, dtype):
    """{variant: model} for forward-only use: full-rank, sltrain with its factors as trained, and the same sltrain
    weights merged once into dense matrices (what export.py writes), which runs at full-rank cost."""
    torch.manual_seed(0)
    full = LLaMA(config_for(size, method="full"), device=device).to(dtype)
    sl = LLaMA(config_for(size, method="sltrain"), device=device).to(dtype)
    merged = LLaMA(config_for(size, method="full"), device="meta")
    merged.load_state_dict(dense_state(sl), assign=True)
    return {"full": full.eval(), "sltrain": sl.eval(), "sltrain_merged": merged.eval()}


def bench_inference(size, batch_size, max_length, device, dtype, rounds):
    """Forward-only tokens/s (÷ full) and memory of full, sltrain (factors) and sltrain merged once, the three models
    built once and resident together. Memory: the bytes of the weights (buffers included), and on CUDA peak_gb = those
    bytes + the most that one forward allocates above what was allocated before it, i.e. the peak of a forward with
    only that model resident (up to the allocator's rounding of each block)."""
    models = inference_models(size, device, dtype)
    idx = torch.randint(32000, (batch_size, max_length), device=device)  # (B, T)
    weights_gb, peak_gb = {}, {}
    for name, model in models.items():
        tensors = list(model.parameters()) + list(model.buffers())
        weights_gb[name] = sum(t.numel() * t.element_size() for t in tensors) / 1e9
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            with torch.inference_mode():
                model(idx)
            peak_gb[name] = weights_gb[name] + (torch.cuda.max_memory_allocated(device) - before) / 1e9

    def forward(model):
        def run():
            with torch.inference_mode():
                model(idx)
        return run

    times = interleave({name: forward(m) for name, m in models.items()}, rounds, device, warmup=1)
    variants = summary(times, "full", invert=True)  # ratio of throughputs: >1 is faster than full
    for name, v in variants.items():
        v.update(tok_s=batch_size * max_length / (v["ms"] / 1e3), weights_gb=weights_gb[name],
                 peak_gb=peak_gb.get(name))
    return dict(size=size, batch_size=batch_size, max_length=max_length, dtype=str(dtype).removeprefix("torch."),
                variants=variants)


# ----------------------------------------------------------------------------- report

def machine(device):
    info = dict(platform=platform.platform(), cpus=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def report_step(r):
    S = r["step"]
    print(f"one optimizer step on a {S['size']}x{S['size']} tensor, CPU, {S['threads']} threads, median of "
          f"{S['steps']} steps after {S['warmup']} warm-up, best of {S['rounds']} rounds")
    for name, v in S["variants"].items():
        print(f"{name:>32}: {v['ms']:7.1f} ms/step  {v['ratio']:5.2f}x [{v['range'][0]:.2f}-{v['range'][1]:.2f}]")


def report_heavy(r):
    H = r["heavy"]
    print(f"{H['steps']} steps on heavy-tailed gradients (row scales exp(2.3·N(0,1))), lr {H['lr']:g}")
    for case, v in H["cases"].items():
        print(f"{case:>10}: max |update|/lr AdamW {v['adamw']:.2f}, Adam8bit {v['adam8bit']:.2f}; "
              f"||p8 - p32|| / ||p32 - p0|| {v['distance']:.3f}")


def report_host(r):
    H = r["host"]
    print(f"per-layer updates on {H['device']}: the host's time per update (a step with them minus one without, best "
          f"of {H['rounds']}) of models with the layers and trained tensors of each size at tiny width, and the aten "
          "operations")
    for row in H["rows"]:
        print(f"  {row['size']} {row['method']} ({row['tensors']} tensors): " + " | ".join(
            f"{name} {ms:.1f} ms{'' if n is None else f', {n} ops'}" for name, (ms, n) in row["host"].items()))
    if H["device"] == "cpu":
        print("  (compiled, on CPU: mostly the time of inductor's CPU kernels, slower than eager, not the host's)")


def report(r):
    if "layer" in r:
        L, v = r["layer"], r["layer"]["variants"]
        print(f"layer {L['shape']} r={L['rank']} delta={L['delta']}, {L['tokens']} tokens, {L['dtype']}, fwd+bwd "
              f"(floor x{L['floor']:.3f})")
        print("  " + " | ".join(f"{k} {v[k]['ms']:.1f} ms {ratio_text(v[k])}" for k in v))
    for M in r.get("model", []):
        v = M["variants"]
        print(f"model {M['size']}, batch {M['batch_size']} x {M['max_length']}, {M['dtype']}, optim.AdamW "
              "(galore: galore.GaLore), "
              "throughput vs full")
        print("  " + " | ".join(f"{m} {v[m]['tok_s']:,.0f} tok/s {ratio_text(v[m])}" for m in v))
    for O in r.get("optimizer", []):
        v = O["variants"]
        print(f"optimizer step, {O['size']} sltrain tensors ({O['params_m']:.2f}M, {O['dtype']}), vs torch.optim.AdamW "
              "(for-loop on CPU, foreach on CUDA)")
        print("  " + " | ".join(f"{k} {v[k]['ms']:.1f} ms {ratio_text(v[k])}" for k in v))
    report_inference(r)
    report_memory(r)
    for key, show in (("step", report_step), ("heavy", report_heavy), ("host", report_host)):
        if key in r:
            show(r)
    if r.keys() & {"layer", "model", "optimizer", "inference"}:
        print("x: median over rounds of the per-round ratio [lowest-highest round]")


OPTIMIZER_TOOLS = ("step", "heavy", "host")  # outside the default sections: run when --only names them
CPU_ONLY = ("step", "heavy")
USED_BY = {"--size": {"model", "optimizer", "inference", "host"}, "--batch_size": {"model", "inference"},
           "--max_length": {"model", "inference"}, "--quick": {"model", "optimizer", "inference"},
           "--rounds": {"layer", "model", "optimizer", "inference", "step", "host"}}


def check_args(parser, args):
    """Every flag honored or refused, in one line that names the fix, before any work; returns the device. A suite
    has its own sizes and rounds (SUITES), so the flags that set them for the single sections are refused with it."""
    only = set(args.only or ())
    if only & set(CPU_ONLY) and args.device not in (None, "cpu"):
        parser.error(f"--only {' '.join(sorted(only & set(CPU_ONLY)))} times the optimizers on CPU: drop --device "
                     f"{args.device}, or run the other sections in a command of their own")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = device_from_flag(parser.error, args.device)
    cuda = device.type == "cuda"
    if cuda and device.index is not None:  # CUDA events record on the current device's stream: make it this one
        torch.cuda.set_device(device)
    if args.suite:
        flags = {"--size": args.size, "--batch_size": args.batch_size, "--max_length": args.max_length,
                 "--rounds": args.rounds, "--quick": args.quick or None}
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            parser.error(f"{', '.join(given)}: a suite has its own sizes and rounds (SUITES in bench.py); drop "
                         f"{'them' if len(given) > 1 else 'it'}, or drop --suite")
        if args.suite == "gpu" and not cuda:
            parser.error("--suite gpu measures bf16 on a GPU; run it on a CUDA machine, or use --suite tiny on CPU")
        if only & set(OPTIMIZER_TOOLS):
            parser.error(f"--only {' '.join(sorted(only & set(OPTIMIZER_TOOLS)))}: not sections of a suite; drop "
                         "--suite (the suite's optimizer section has the host time)")
        if (args.tokenizer or "program" in only) and not args.data_dir:
            parser.error("the program section trains on C4 shards: pass --data_dir (and --tokenizer)")
        if args.data_dir and not os.path.isdir(args.data_dir):
            parser.error(f"--data_dir {args.data_dir}: no such folder; pass the folder of C4 shards (train.py's)")
        tokenizer = args.tokenizer or "data/t5_spiece.model"
        if args.data_dir and not os.path.isfile(tokenizer):
            parser.error(f"--tokenizer {tokenizer}: no such file; pass the sentencepiece model")
    else:
        if args.data_dir or args.tokenizer:
            parser.error("--data_dir and --tokenizer are for a suite's program section: add --suite or drop them")
        if only & {"amp", "program", "model_compiled"}:
            parser.error("--only amp, program and model_compiled are sections of a suite: add --suite gpu (or --suite "
                         "tiny on CPU)")
        if "memory" in only and not cuda:
            parser.error("the memory section measures CUDA's peak allocation; run on a GPU or drop it from --only (on "
                         "CPU, python estimate_memory.py --measure counts memory instead)")
        if any(value is not None and value < 1 for value in (args.batch_size, args.max_length, args.rounds)):
            parser.error("--batch_size, --max_length and --rounds must be >= 1")
        if args.quick and args.size:
            parser.error("--quick picks the tiny model and --size the sizes: pass one of them")
        for flag, users in USED_BY.items():
            if only and getattr(args, flag[2:]) not in (None, False) and not only & users:
                parser.error(f"{flag} is for the {', '.join(sorted(users))} sections, and --only has none of them: "
                             f"drop {flag}")
    args.tokenizer = args.tokenizer or "data/t5_spiece.model"
    args.max_length, args.rounds = args.max_length or 256, args.rounds or 7
    return device


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--suite", choices=list(SUITES),
                        help="gpu: every GPU figure of the paper in one run (one H100); tiny: the same at toy sizes (a "
                             "CPU check of the suite's code)")
    parser.add_argument("--data_dir", help="--suite: C4 shards for the train.py section (skipped without them)")
    parser.add_argument("--tokenizer", default=None,
                        help="--suite: the tokenizer for train.py (default: data/t5_spiece.model)")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny model for the model, optimizer and inference sections")
    parser.add_argument("--only", nargs="+",
                        choices=["layer", "model", "model_compiled", "amp", "optimizer", "memory", "inference",
                                 "program", *OPTIMIZER_TOOLS],
                        help="run only these sections (default: all that apply to the device, without step, heavy "
                             "and host; model_compiled, amp, program: --suite only)")
    parser.add_argument("--size", nargs="+", default=None, choices=list(SIZES),
                        help="sizes for the model, optimizer and inference sections (default: 60m on CPU, tiny with "
                             "--quick, 350m 1b on CUDA) and host (default: 60m 350m 7b)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="sequences per train step (default: 4, 8 with --quick, CUDA 16)")
    parser.add_argument("--max_length", type=int, default=None, help="tokens per sequence (default: 256)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per section (default: 7; step 3, host 5)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch.set_num_threads); 1 gives steadier ratios on a shared machine")
    parser.add_argument("--json", action="store_true", help="print the results as JSON after the table")
    parser.add_argument("--out", default=None, help="also write the JSON results to this file")
    args = parser.parse_args()
    rounds_given = args.rounds
    device = check_args(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    sections = args.only or ["layer", "model", "optimizer", "inference"] + (["memory"] if cuda else [])
    sizes = args.size or (["tiny"] if args.quick else ["350m", "1b"] if cuda else ["60m"])
    batch_size = args.batch_size or (16 if cuda else 8 if args.quick else 4)
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 as trained on GPUs; CPUs are fastest in float32
    result = dict(command="python " + " ".join(sys.argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=str(device), machine=machine(device))
    print(f"{result['command']} | {result['date']} | {device} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__}")
    if args.suite:  # each section's table prints, and --out is written, as the section ends
        run_suite(args.suite, device, args.only, args.data_dir, args.tokenizer, result=result, out=args.out)
        sections = []
    run = {
        "layer": lambda: bench_layer(device, 65536 if cuda else 4096, dtype, args.rounds),
        "model": lambda: [bench_model(s, batch_size, args.max_length, device, dtype, args.rounds) for s in sizes],
        "optimizer": lambda: [bench_optimizer(s, device, dtype, args.rounds) for s in sizes],
        "memory": lambda: suite_memory(SUITES["gpu"], device),
        "inference": lambda: [bench_inference(s, args.batch_size or (INFERENCE_BATCH.get(s, 32) if cuda else
                                                                     batch_size), args.max_length, device, dtype,
                                              args.rounds) for s in sizes],
        "step": lambda: bench_step(rounds=rounds_given or 3),
        "heavy": lambda: bench_heavy(),
        "host": lambda: bench_host(device, args.size or ("60m", "350m", "7b"), rounds_given or 5)}
    for section in [k for k in run if k in sections]:
        try:  # as in a suite: a failed section is recorded, the others still run, and --out holds what is done
            result[section] = run[section]()
        except Exception as e:
            record_error(result, section, e)
        gc.collect()
        if args.out:
            write_json(args.out, result)
    if not args.suite:
        report(result)
    if args.json:
        print(json.dumps(result, indent=1))
    if args.out:  # written after each section (run_suite's too): the file holds this result already
        print(f"wrote {args.out}")
    if result.get("errors"):
        raise SystemExit(f"failed: {', '.join(result['errors'])} (each error and its traceback are under \"errors\" in "
                         f"the JSON{' ' + args.out if args.out else ''})")


if __name__ == "__main__":
    main()
