"""
Speed of SLTrain against dense training, always as ratios measured side by side in one run; the paper's GPU figures,
memory included, are suite.py's.

    python bench.py --quick                  # a couple of minutes on a 2-core CPU
    python bench.py                          # CPU: layer at 4096 tokens, 60m train steps, optimizer steps on 60m
    python bench.py --size 350m 1b --batch_size 16 --json --out bench.json   # choose the models; write the figures
    python bench.py --only inference --size 130m 350m 1b                      # Table 5 on a GPU: forward only
    python bench.py --only step heavy host                                    # the optimizers alone
    python bench.py --only generate                                           # sample.py's speed

Sections (--only picks some):
    layer      forward+backward of the SLTrain layer, of it with its support packed (train.py --packed_support)
               and of the low-rank layer ÷ nn.Linear of the same shape, 2048x2048, r=128, delta=0.03: 4096 tokens in
               float32 on CPU (floor 1 + 4r/(3·tokens) = 1.042, target <= 1.05), 65536 tokens in bf16 on CUDA
               (target <= 1.01)
    model      train-step tokens/s of full, lowrank, relora, sltrain (optim.AdamW) and galore (galore.GaLore, the
               steps between its SVDs) (CUDA default: 350m and 1b; paper: sltrain/full = 0.945 at 350m)
    optimizer  step time of optim.AdamW and optim.Adam8bit ÷ torch.optim.AdamW on the same tensors
    inference  forward-only tokens/s and memory of full, sltrain (factors as trained) and sltrain merged once into
               dense weights (the paper's Table 5); CUDA batch 128 at 130m/350m, 32 at 1b/7b
  run only when --only names them:
    generate   sample.py's tokens/s from an sltrain model (--size; --batch_size samples, default 4; 16-token prompt,
               128 new tokens, greedy), ÷ as trained without cache: as trained with the KV cache, merged once,
               merged with the cache
    step       one step of optim.AdamW, Adam8bit and Adam8bit(compile=True) ÷ torch's foreach AdamW on a 4096x4096
               float32 tensor, on CPU; bitsandbytes' Adam8bit beside them where that is installed
    heavy      Adam8bit beside float32 AdamW on heavy-tailed gradients (200 steps, three cases), on CPU: the largest
               update ÷ lr of each, and how far the 8-bit run ends from the float32 one; bitsandbytes' Adam8bit
               beside it where that is installed
    host       the host time per update of per-layer updates (AdamW, Adam8bit, compiled) for models with the layers
               and trained tensors of each --size (default 60m 350m 7b) at toy width, and the aten operations

A section that raises is recorded under "errors" (in a section of sizes, the size that raised: "model 1b"), --out
keeps what is done (rewritten after each section and size), the next one runs, and the command exits non-zero if any
failed. One that cannot fit in memory (its models' weights and optimizer states, by estimate_memory.py) is refused
before any section runs.

How we time: every variant runs in its own timed block (CUDA events on a GPU) after warm-up, a call shorter than
10 ms repeated back to back within it (time per call = the block's ÷ the calls), and the rounds interleave the
variants, alternating their order, so that a shared, noisy machine slows them all alike; a ratio is the median over
rounds of the per-round ratio. suite.py times the same way, with these functions.
"""

import argparse
import atexit
import collections
import copy
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn

import adam8bit_kernel
import galore
import optim
import sample
from checkpoint import atomic_file, make_folder
from data import Unbroken, empty_path_refusal
from devices import device_from_flag
from estimate_memory import BLOCK_SIZE, estimate, memory_there
from model import LLaMA, PRETRAINING, SIZES, config_for, is_projection, length_refusal
from per_layer import attach_per_layer
from sllinear import SLLinear


# ----------------------------------------------------------------------------- timing

def synchronizer(device):
    """A call that waits until the device has run what was issued to it (CUDA); on CPU, which runs it at once, none."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else lambda: None


def timed(fn, device, issued=None):
    """Seconds of one call of fn. On CUDA, issued (a list) gets the seconds the host took to issue its work: when
    they are most of the device's, the GPU was waiting for the host's launches (launch-bound), not computing."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # nothing of the previous variant may run inside this block
        start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize(device)
        if issued is not None:
            issued.append(host)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


MAX_CALLS = 10_000  # calls per block at most: no torch call takes under 1 µs, so only a timer that read 0 s reaches it


def interleave(variants, rounds, device, warmup=2, min_block=0.01, after_round=lambda times: None, issued=None):
    """{name: [seconds per call, one per round]}: warm-up calls of each variant, then rounds that run each in its
    own block, order alternating. A call shorter than min_block seconds runs back to back in its block, as many
    times (at most MAX_CALLS) as one timed call after the warm-up says make min_block, and the block's time is
    divided by them: a short GPU call timed alone would count the host's launch of its kernels in front of them,
    where a real run overlaps the two. after_round(times) sees the rounds so far (a suite saves them). On CUDA,
    issued (a dict) gets {name: [the host's seconds to issue a call, one per round]} (timed)."""
    calls = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        calls[name] = max(1, min(MAX_CALLS, math.ceil(min_block / max(timed(fn, device), 1e-9))))

    def block(fn, n):
        def run():
            for _ in range(n):
                fn()
        return run

    times = {name: [] for name in variants}
    for i in range(rounds):
        for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            host = []
            times[name].append(timed(block(variants[name], calls[name]), device, host) / calls[name])
            if issued is not None and host:
                issued.setdefault(name, []).append(host[0] / calls[name])
        after_round(times)
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
    """Forward+backward (input and weight gradients) of one layer, SLTrain (its support flat and packed) and
    low-rank ÷ dense."""
    torch.manual_seed(0)
    kw = dict(device=device, dtype=dtype)
    layers = {"dense": nn.Linear(dim, dim, bias=False, **kw), "sltrain": SLLinear(dim, dim, rank, delta, 32.0, **kw),
              "lowrank": SLLinear(dim, dim, rank, 0.0, 32.0, **kw),
              "sltrain_packed": SLLinear(dim, dim, rank, delta, 32.0, **kw, packed=True)}
    x = torch.randn(tokens, dim, **kw, requires_grad=True)  # (N, in): an inner layer also needs dL/dx
    g = torch.randn(tokens, dim, **kw)  # (N, out)

    def fwd_bwd(layer):
        params = [x, *layer.parameters()]
        return lambda: torch.autograd.grad(layer(x), params, g)  # returned, not accumulated: no .grad traffic

    times = interleave({name: fwd_bwd(layer) for name, layer in layers.items()}, rounds, device)
    return dict(shape=f"{dim}x{dim}", rank=rank, delta=delta, tokens=tokens, dtype=str(dtype).removeprefix("torch."),
                floor=1 + 4 * rank / (3 * tokens), variants=summary(times, "dense"))


# the model section's variants, each a model of its own with its optimizer state, all held at once: the method each
# builds (sltrain/separate: each projection its own call)
MODEL_VARIANTS = {**{m: m for m in PRETRAINING}, "sltrain/separate": "sltrain", "galore": "full"}


def bench_model(size, batch_size, max_length, device, dtype, rounds):
    """Train-step tokens/s of each method (forward, backward, optim.AdamW step; GaLore's own step), and ÷ full;
    sltrain also with each projection its own call ("sltrain/separate"; by default q, k, v and gate, up share one,
    sllinear.projections). Each step's aten operations too, views included: on a GPU, what the host issues."""
    variants, steps = {}, {}
    for method, ours in MODEL_VARIANTS.items():
        torch.manual_seed(0)
        model = LLaMA(config_for(size, method=ours), device=device).to(dtype)
        model.fuse_projections(method != "sltrain/separate")
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

        steps[method] = step
    times = interleave(steps, rounds, device, warmup=1)
    variants = summary(times, "full", invert=True)  # ratio of throughputs: >1 is faster than full
    for method, v in variants.items():
        v["tok_s"] = batch_size * max_length / (v["ms"] / 1e3)
        v["ops"] = count_ops(steps[method])
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

def _bitsandbytes():
    """bitsandbytes (the authors' 8-bit Adam) where installed, for comparison; None elsewhere, as in CI."""
    try:
        import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes


def bench_step(size=4096, steps=10, warmup=3, rounds=3):
    """One step on a size x size float32 tensor on CPU for each optimizer, each in its own block of steps after a
    warm-up (interleaving single steps would time the allocator), as ratios to torch's foreach AdamW. Each round keeps
    the median step of each block, the variants' order alternating from round to round; ratio is the median over
    rounds of each round's ratio, range its lowest and highest round, ms the median round's time."""
    makers = {
        "torch.optim.AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, foreach=True),
        "AdamW": lambda ps: optim.AdamW(ps, weight_decay=0.1),
        "Adam8bit": lambda ps: optim.Adam8bit(ps, weight_decay=0.1),
        "Adam8bit(compile=True)": lambda ps: optim.Adam8bit(ps, weight_decay=0.1, compile=True),  # compiles in warm-up
    }
    bnb = _bitsandbytes()
    if bnb is not None:  # the authors' 8-bit optimizer, where installed: its CPU kernels beside ours
        makers["bitsandbytes Adam8bit"] = lambda ps: bnb.optim.Adam8bit(ps, weight_decay=0.1)
    medians = {name: [] for name in makers}
    for i in range(rounds):
        for name, make in (list(makers.items()) if i % 2 == 0 else list(makers.items())[::-1]):
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
        variants[name] = dict(ms=statistics.median(seconds) * 1e3, ratio=statistics.median(ratios),
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
    """heavy_tailed for each case: {case: dict(adamw=..., adam8bit=..., distance=...)}, and where bitsandbytes is
    installed its Adam8bit's figures beside ours (bnb_adam8bit, bnb_distance; it stores v where ours stores √v)."""
    bnb = _bitsandbytes()
    rows = {}
    for case in HEAVY_CASES:
        adamw, adam8bit, distance = heavy_tailed(case, steps, lr)
        rows[case] = dict(adamw=adamw, adam8bit=adam8bit, distance=distance)
        if bnb is not None:
            _, rows[case]["bnb_adam8bit"], rows[case]["bnb_distance"] = heavy_tailed(
                case, steps, lr, make=lambda ps: bnb.optim.Adam8bit(ps, lr=lr))
    return dict(steps=steps, lr=lr, cases=rows, bitsandbytes=None if bnb is None else bnb.__version__)


def per_layer_host_time(device="cpu", size="350m", method="sltrain", rounds=5, spread=None):
    """Host time of per-layer updates: a training step of a model with the layers and trained tensors of `size`
    (a 350m SLTrain model: 24 blocks, 555 tensors) at the tiny size's width, with per-layer updates, less the same
    step without them in the same round, for AdamW, Adam8bit and Adam8bit(compile=True), and on a CUDA GPU the
    one-kernel step Adam8bit(fused=True) (every tensor a projection has takes the 8-bit path, as at full width). At
    that width the arithmetic is negligible and what remains is what the host issues for every tensor of every
    update: Python, dispatch and, on a GPU, kernel launches, whatever the tensors' sizes. On CPU the 8-bit step takes
    the path it takes on a GPU without the kernel (whole tensors, small ones together), not the chunked one.
    Every variant's model is built and warmed up first; then each round times one step of each, their order
    alternating (as interleave's), so that a machine that slows midway slows them all alike.
    Returns {name: (ms per update, operations per update)}: the median over rounds of the per-round difference, and
    the aten calls, views included (None for compiled code, whose kernels run below the dispatcher); spread (a dict)
    gets {name: (lowest, highest) round's ms}."""
    device = torch.device(device)
    small = 65  # the norms (64 wide here) keep float32 moments, as they do at full width; the rest is 8-bit
    makers = {"none": None, "AdamW": lambda ps: optim.AdamW(ps, lr=1e-3),
              "Adam8bit": lambda ps: optim.Adam8bit(ps, lr=1e-3, min_8bit_size=small, fused=False),
              "Adam8bit(compile=True)": lambda ps: optim.Adam8bit(ps, lr=1e-3, min_8bit_size=small, compile=True,
                                                                 fused=False)}
    if adam8bit_kernel.why_not(device, torch.float32, BLOCK_SIZE) is None:  # a CUDA GPU with Triton
        makers["Adam8bit(fused=True)"] = lambda ps: optim.Adam8bit(ps, lr=1e-3, min_8bit_size=small, fused=True)
    config = config_for("tiny", method=method, n_layers=config_for(size).n_layers, vocab_size=256)
    idx = torch.randint(256, (1, 17), device=device)
    sync, chunked = synchronizer(device), set(optim.CHUNKED_DEVICES)
    optim.CHUNKED_DEVICES.discard(device.type)
    try:
        steps = {}
        for name, make in makers.items():
            torch.manual_seed(0)
            steps[name] = _host_step(LLaMA(config, device=device), make, idx)
            for _ in range(3):  # the state appears, and compiled code compiles, here
                steps[name]()
        times = {name: [] for name in steps}
        for i in range(rounds):
            for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
                sync()
                t0 = time.perf_counter()
                steps[name]()
                sync()
                times[name].append(time.perf_counter() - t0)
        ops = {name: None if "compile" in name else count_ops(step) for name, step in steps.items()}
    finally:
        optim.CHUNKED_DEVICES.update(chunked)
    none, none_ops = times.pop("none"), ops.pop("none")
    result = {}
    for name, seconds in times.items():
        ms = sorted(1e3 * (t - plain) for t, plain in zip(seconds, none))
        result[name] = (statistics.median(ms), None if ops[name] is None else ops[name] - none_ops)
        if spread is not None:
            spread[name] = (ms[0], ms[-1])
    return result


def ops_by_name(fn):
    """The aten operations fn() issues, views included, counted by name (mm, addmm_, view, ...): on a GPU, about the
    kernel launches and what else the host must do for each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts


def count_ops(fn):
    """The number of aten operations fn() issues (ops_by_name, summed)."""
    return sum(ops_by_name(fn).values())


def _host_step(model, make, idx):
    """A training step of model with per-layer updates by make (none if make is None)."""
    per_layer = attach_per_layer(model, make) if make else None

    def step():
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        if per_layer is None:
            model.zero_grad(set_to_none=True)
    return step


def bench_host(device, sizes, rounds=5):
    """per_layer_host_time at each size for full and sltrain, with each model's count of trained tensors and the
    lowest and highest round of each variant ("range")."""
    rows = []
    for size in sizes:
        for method in ("full", "sltrain"):
            model, spread = LLaMA(config_for(size, method=method), device="meta"), {}
            host = per_layer_host_time(device, size, method, rounds, spread)
            rows.append(dict(size=size, method=method, tensors=sum(p.requires_grad for p in model.parameters()),
                             host=host, range=spread))
    return dict(device=str(device), rounds=rounds, rows=rows)


# the paper's inference batch sizes (Table 5): 128 sequences at 130m and 350m, 32 at 1b and 7b
INFERENCE_BATCH = {"130m": 128, "350m": 128, "1b": 32, "7b": 32}


def inference_models(size, device, dtype):
    """{variant: model} for forward-only use: full-rank, sltrain with its factors as trained, and the same sltrain
    weights merged once into dense matrices (what export.py writes), which runs at full-rank cost."""
    torch.manual_seed(0)
    full = LLaMA(config_for(size, method="full"), device=device).to(dtype)
    sl = LLaMA(config_for(size, method="sltrain"), device=device).to(dtype)
    return {"full": full.eval(), "sltrain": sl.eval(), "sltrain_merged": sample.merged(copy.deepcopy(sl))}


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


GENERATE_CONTEXT = 255  # the positions generate's window and KV cache hold: the paper's max_length 256, less one
GENERATE_PROMPT, GENERATE_NEW_TOKENS = 16, 128


def bench_generate(size, samples, new_tokens, device, dtype, rounds, prompt=GENERATE_PROMPT):
    """sample.generate's tokens/s, greedy, from an sltrain model of size: as trained with no cache (each new token
    forms every W and runs the whole window, as sample.py did), as trained with the KV cache (each token still forms
    every W), merged once with no cache, and merged with the cache (sample.py now). The context is the paper's 255
    positions; the prompt and new tokens fit in it."""
    torch.manual_seed(0)
    model = LLaMA(config_for(size, method="sltrain"), device=device).to(dtype).eval()
    dense = sample.merged(copy.deepcopy(model))  # in place: the model as trained is timed too
    idx = torch.randint(32000, (samples, prompt), device=device)  # (B, T)
    variants = {"trained": (model, False), "trained_cached": (model, True), "merged": (dense, False),
                "merged_cached": (dense, True)}

    def run(model, cache):
        return lambda: sample.generate(model, idx, new_tokens, temperature=0, context=GENERATE_CONTEXT,
                                      cache=cache)

    times = interleave({name: run(*v) for name, v in variants.items()}, rounds, device, warmup=1)
    out = summary(times, "trained", invert=True)  # >1: faster than the model as trained
    for v in out.values():
        v["tok_s"] = samples * new_tokens / (v["ms"] / 1e3)
    return dict(size=size, samples=samples, prompt=prompt, new_tokens=new_tokens,
                dtype=str(dtype).removeprefix("torch."), variants=out)


# ----------------------------------------------------------------------------- report

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


def rounds_text(variants):
    """How many rounds a table's figures are of (its variants all ran in each)."""
    return f"{max((len(v['rounds_ms']) for v in variants.values()), default=0)} rounds"


def report_inference(r):
    for I in r.get("inference", []):
        v = I["variants"]
        peak = lambda m: "" if v[m]["peak_gb"] is None else f", peak {v[m]['peak_gb']:.2f} GB"  # noqa: E731
        print(f"inference {I['size']}, batch {I['batch_size']} x {I['max_length']}, {I['dtype']}, forward only, "
              f"throughput vs full, {rounds_text(v)}")
        print("  " + " | ".join(f"{m} {v[m]['tok_s']:,.0f} tok/s {ratio_text(v[m])}, weights "
                                f"{v[m]['weights_gb']:.3f} GB{peak(m)}" for m in v))


def machine(device):
    info = dict(platform=platform.platform(), cpus=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def report_step(r):
    S = r["step"]
    print(f"one optimizer step on a {S['size']}x{S['size']} tensor, CPU, {S['threads']} threads, median of "
          f"{S['steps']} steps after {S['warmup']} warm-up; the median of {S['rounds']} rounds' ratios "
          "[lowest-highest]")
    for name, v in S["variants"].items():
        print(f"{name:>32}: {v['ms']:7.1f} ms/step  {v['ratio']:5.2f}x [{v['range'][0]:.2f}-{v['range'][1]:.2f}]")


def report_heavy(r):
    H = r["heavy"]
    print(f"{H['steps']} steps on heavy-tailed gradients (row scales exp(2.3·N(0,1))), lr {H['lr']:g}")
    for case, v in H["cases"].items():
        print(f"{case:>10}: max |update|/lr AdamW {v['adamw']:.2f}, Adam8bit {v['adam8bit']:.2f}; "
              f"||p8 - p32|| / ||p32 - p0|| {v['distance']:.3f}" + ("" if H["bitsandbytes"] is None else
              f" | bitsandbytes: {v['bnb_adam8bit']:.2f}, {v['bnb_distance']:.3f}"))
    if H["bitsandbytes"] is not None:
        print(f"  (bitsandbytes {H['bitsandbytes']}'s Adam8bit on the same gradients: its largest update ÷ lr, "
              "its distance)")


def report_host(r):
    H = r["host"]
    print(f"per-layer updates on {H['device']}: the host's time per update (a step with them less one without in the "
          f"same round: the median of {H['rounds']} rounds [lowest-highest]) of models with the layers and trained "
          "tensors of each size at tiny width, and the aten operations")
    for row in H["rows"]:
        print(f"  {row['size']} {row['method']} ({row['tensors']} tensors): " + " | ".join(
            f"{name} {ms:.1f} ms [{row['range'][name][0]:.1f}-{row['range'][name][1]:.1f}]"
            f"{'' if n is None else f', {n} ops'}" for name, (ms, n) in row["host"].items()))
    if H["device"] == "cpu":
        print("  (compiled, on CPU: mostly the time of inductor's CPU kernels, slower than eager, not the host's)")


def report_generate(r):
    for G in r.get("generate", []):
        v = G["variants"]
        print(f"generate {G['size']} sltrain, {G['samples']} samples, prompt {G['prompt']} + {G['new_tokens']} new "
              f"tokens, greedy, {G['dtype']}, tokens/s vs the model as trained without cache, {rounds_text(v)}")
        print("  " + " | ".join(f"{m} {v[m]['tok_s']:,.1f} tok/s {ratio_text(v[m])}" for m in v))


def report(r):
    if "layer" in r:
        L, v = r["layer"], r["layer"]["variants"]
        print(f"layer {L['shape']} r={L['rank']} delta={L['delta']}, {L['tokens']} tokens, {L['dtype']}, fwd+bwd "
              f"(floor x{L['floor']:.3f}), {rounds_text(v)}")
        print("  " + " | ".join(f"{k} {v[k]['ms']:.1f} ms {ratio_text(v[k])}" for k in v))
    for M in r.get("model", []):
        v = M["variants"]
        print(f"model {M['size']}, batch {M['batch_size']} x {M['max_length']}, {M['dtype']}, optim.AdamW "
              f"(galore: galore.GaLore), throughput vs full, {rounds_text(v)}")
        print("  " + " | ".join(f"{m} {v[m]['tok_s']:,.0f} tok/s {ratio_text(v[m])}, {v[m]['ops']} ops" for m in v))
    for O in r.get("optimizer", []):
        v = O["variants"]
        print(f"optimizer step, {O['size']} sltrain tensors ({O['params_m']:.2f}M, {O['dtype']}), vs torch.optim.AdamW "
              f"(for-loop on CPU, foreach on CUDA), {rounds_text(v)}")
        print("  " + " | ".join(f"{k} {v[k]['ms']:.1f} ms {ratio_text(v[k])}" for k in v))
    report_inference(r)
    report_generate(r)
    for key, show in (("step", report_step), ("heavy", report_heavy), ("host", report_host)):
        if key in r:
            show(r)
    if r.keys() & {"layer", "model", "optimizer", "inference", "generate"}:
        print("x: median over rounds of the per-round ratio [lowest-highest round]")


EXTRA = ("generate", "step", "heavy", "host")  # outside the default sections: run when --only names them
CPU_ONLY = ("step", "heavy")
USED_BY = {"--size": {"model", "optimizer", "inference", "generate", "host"},
           "--batch_size": {"model", "inference", "generate"}, "--max_length": {"model", "inference"},
           "--quick": {"model", "optimizer", "inference", "generate"},
           "--rounds": {"layer", "model", "optimizer", "inference", "generate", "step", "host"}}


def pick_device(error, flag):
    """The device of --device (default: cuda if present), made current if it is a GPU named by index: CUDA events
    record on the current device's stream, so a cuda:1 left idle would time nothing. suite.py's too."""
    device = device_from_flag(error, flag or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def check_args(parser, args):
    """Every flag honored or refused, in one line that names the fix, before any work; returns the device. --out is
    checked last, in main (check_out makes its folder)."""
    if refusal := empty_path_refusal(args, ("--out",)):
        parser.error(refusal)
    only = set(args.only or ())
    if only & set(CPU_ONLY) and args.device not in (None, "cpu"):
        parser.error(f"--only {' '.join(sorted(only & set(CPU_ONLY)))} times the optimizers on CPU: drop --device "
                     f"{args.device}, or run the other sections in a command of their own")
    device = pick_device(parser.error, args.device)
    if any(value is not None and value < 1 for value in (args.batch_size, args.max_length, args.rounds)):
        parser.error("--batch_size, --max_length and --rounds must be >= 1")
    if args.max_length is not None and (refusal := length_refusal(args.max_length)):
        parser.error(refusal)
    if args.quick and args.size:
        parser.error("--quick picks the tiny model and --size the sizes: pass one of them")
    for flag, users in USED_BY.items():
        if only and getattr(args, flag[2:]) not in (None, False) and not only & users:
            parser.error(f"{flag} is for the {', '.join(sorted(users))} sections, and --only has none of them: "
                         f"drop {flag}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    args.max_length, args.rounds = args.max_length or 256, args.rounds or 7
    return device


def memory_needed(section, size, dtype, batch_size=0, max_length=256):
    """The least a section holds at its peak, in bytes, by estimate_memory's rows: `model` keeps its six models
    (MODEL_VARIANTS) and their AdamW states at once and steps one at a time, with one set of gradients and one step's
    activations of batch_size x max_length tokens; `optimizer` three copies of sltrain's tensors with their states,
    beside the originals and one set of gradients; `inference` full, sltrain and the merged model, and one
    forward's; `generate` sltrain and its merged copy, and batch_size samples' KV cache and logits."""
    def row(method, batch=batch_size, **kw):
        return estimate(size, method, index_dtype="int32", dtype=dtype, batch_size=batch, max_length=max_length, **kw)
    if section == "model":
        rows = [row("galore" if m == "galore" else built) for m, built in MODEL_VARIANTS.items()]
        return (sum(r["held_gb"] + r["optim_gb"] for r in rows) + max(r["grad_gb"] + r["act_gb"] for r in rows)) * 1e9
    if section == "optimizer":
        plain, eight_bit = row("sltrain", batch=0), row("sltrain", batch=0, optimizer="adam8bit")
        return (5 * plain["held_gb"] + 2 * plain["optim_gb"] + eight_bit["optim_gb"]) * 1e9
    if section == "generate":  # the merged copy is dense: a full model's weights
        config, width = config_for(size, method="sltrain"), torch.finfo(getattr(torch, dtype)).bits // 8
        # the cache is made for the whole context; the longest window (run without the cache) is the prompt and all
        # new tokens but the last, whose logits are every position's, and the last position's again in float32
        window = min(GENERATE_CONTEXT, GENERATE_PROMPT + GENERATE_NEW_TOKENS - 1)
        cache = 2 * config.n_layers * GENERATE_CONTEXT * config.dim * width
        logits = window * config.vocab_size * width + config.vocab_size * 4
        weights = row("sltrain", batch=0)["held_gb"] + row("full", batch=0)["held_gb"]
        return weights * 1e9 + batch_size * (cache + logits)
    full, sltrain = row("full"), row("sltrain")  # inference: a forward without gradients beside the three models
    forward = max(r["eval_gb"] - r["held_gb"] for r in (full, sltrain)) if batch_size else 0
    return (2 * full["held_gb"] + sltrain["held_gb"] + forward) * 1e9


def refuse_what_would_not_fit(error, sections, sizes, dtype, device, batch=lambda section, size: 0, max_length=256):
    """A section that cannot fit is refused before any runs: on CPU the kernel's out-of-memory killer would end the
    command without a word, and on a GPU the section would fail after the ones before it. batch(section, size): the
    sequences of its steps (of max_length tokens), whose activations count too."""
    guarded = [s for s in ("model", "optimizer", "inference", "generate") if s in sections]
    there = memory_there(device) if guarded else None
    if there is None:
        return
    available, share, where = there
    name = str(dtype).removeprefix("torch.")
    for section in guarded:
        for size in sizes:
            b = 0 if section == "optimizer" else batch(section, size)
            need = memory_needed(section, size, name, b, max_length)
            if need > share * available:
                acts = f", and {b} x {max_length} tokens' activations" if b else ""
                what = f"weights, gradients and optimizer states{acts}"
                if section == "generate":
                    what = f"weights as trained and merged, and {b} samples' KV cache and logits"
                error(f"--size {size}: the {section} section needs at least {need / 1e9:.1f} GB by the estimate (its "
                      f"{what}), more than {share:.0%} of {where}; pass a smaller --size{' or --batch_size' * bool(b)}"
                      ", or drop the section (--only)")


def check_out(error, out):
    """--out, the JSON file written after each section: a folder, or a file in a folder that cannot be written, is
    refused now, not after the first section's minutes."""
    if out is None:
        return
    if os.path.isdir(out):
        error(f"--out {out} is a folder; pass a file in it, such as {os.path.join(out, 'results.json')}")
    if not out.lower().endswith(".json"):  # earlier results are replaced; a run's ckpt.pt or metrics.jsonl must not be
        error(f"--out {out}: the results are JSON, written over any file of that name; pass a name ending in .json")
    folder = os.path.dirname(os.path.abspath(out))
    try:
        make_folder(folder)  # and a file tried in it (what it made is removed, if it fails)
    except OSError as e:
        error(f"--out {out}: cannot write in {folder} ({e.strerror or e}); pass a file in a folder you can write")


def start(device):
    """The result's header (command, date, machine: the GPU's name on one), printed in one line."""
    result = dict(command="python " + " ".join(sys.argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=str(device), machine=machine(device))
    gpu = f" ({result['machine']['gpu']})" if "gpu" in result["machine"] else ""
    print(f"{result['command']} | {result['date']} | {device}{gpu} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__}")
    return result


def finish(result, out, as_json):
    """The JSON printed if asked, and the command failed (non-zero) if a section did, naming them."""
    if as_json:
        print(json.dumps(result, indent=1))
    if out:  # written after each section: the file holds this result already
        print(f"wrote {out}")
    if result.get("errors"):
        raise SystemExit(f"failed: {', '.join(result['errors'])} (each error and its traceback are under \"errors\" in "
                         f"the JSON{' ' + out if out else ''})")


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the tiny model for the model, optimizer and inference sections")
    parser.add_argument("--only", nargs="+", choices=["layer", "model", "optimizer", "inference", *EXTRA],
                        help="run only these sections (default: layer, model, optimizer, inference)")
    parser.add_argument("--size", nargs="+", default=None, choices=list(SIZES),
                        help="sizes for the model, optimizer and inference sections (default: 60m on CPU, tiny with "
                             "--quick, 350m 1b on CUDA) and host (default: 60m 350m 7b)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="sequences per train step (default: 4, 8 with --quick, CUDA 16)")
    parser.add_argument("--max_length", type=int, default=None, help="tokens per sequence (default: 256)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per section (default: 7; generate and step 3, host 5)")
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
    sections = args.only or ["layer", "model", "optimizer", "inference"]
    sizes = args.size or (["tiny"] if args.quick else ["350m", "1b"] if cuda else ["60m"])
    batch_size = args.batch_size or (16 if cuda else 8 if args.quick else 4)
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 as trained on GPUs; CPUs are fastest in float32
    inference_batch = lambda s: args.batch_size or (INFERENCE_BATCH.get(s, 32) if cuda else batch_size)  # noqa: E731
    samples = args.batch_size or 4  # generate's
    batches = dict(inference=inference_batch, generate=lambda s: samples)
    refuse_what_would_not_fit(parser.error, sections, sizes, dtype, device,
                              lambda section, s: batches[section](s) if section in batches else batch_size,
                              args.max_length)
    check_out(parser.error, args.out)  # last: the folder it makes would stay behind a command refused after it
    result = start(device)
    # the sections that time each --size: a size that fails costs only itself, and each is kept as it ends
    sized = {
        "model": lambda s: bench_model(s, batch_size, args.max_length, device, dtype, args.rounds),
        "optimizer": lambda s: bench_optimizer(s, device, dtype, args.rounds),
        "inference": lambda s: bench_inference(s, inference_batch(s), args.max_length, device, dtype, args.rounds),
        "generate": lambda s: bench_generate(s, samples, GENERATE_NEW_TOKENS, device, dtype, rounds_given or 3)}
    run = {
        "layer": lambda: bench_layer(device, 65536 if cuda else 4096, dtype, args.rounds),
        **sized,
        "step": lambda: bench_step(rounds=rounds_given or 3),
        "heavy": lambda: bench_heavy(),
        "host": lambda: bench_host(device, args.size or ("60m", "350m", "7b"), rounds_given or 5)}
    for section in [k for k in run if k in sections]:
        for size in sizes if section in sized else [None]:
            try:  # a failed section (or size) is recorded, the others still run, and --out holds what is done
                if size is None:
                    result[section] = run[section]()
                else:
                    result.setdefault(section, []).append(run[section](size))
            except Exception as e:
                record_error(result, section if size is None else f"{section} {size}", e)
            gc.collect()
            if args.out:
                write_json(args.out, result)
    report(result)
    finish(result, args.out, args.json)


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    sys.stdout = Unbroken(sys.stdout)  # a reader's end must not fail the sections, or stop --out's rewrites
    main()
