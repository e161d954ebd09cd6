"""
Speed (and, on a GPU, memory) of SLTrain against dense training, always as ratios measured side by side in one run.

    python bench.py --quick                  # a couple of minutes on a 2-core CPU
    python bench.py                          # CPU: layer at 4096 tokens, 60m train steps, optimizer steps on 60m
    python bench.py --size 350m 1b --batch_size 16 --json --out bench.json   # choose the models; write the figures

Sections (--only picks some):
    layer      forward+backward of the SLTrain layer and of the low-rank layer ÷ nn.Linear of the same shape,
               2048x2048, r=128, delta=0.03: 4096 tokens in float32 on CPU (floor 1 + 4r/(3·tokens) = 1.042,
               target <= 1.05), 65536 tokens in bf16 on CUDA (target <= 1.01)
    model      train-step tokens/s of full, lowrank, relora, sltrain (optim.AdamW) and galore (optim.GaLore, the
               steps between its SVDs) (CUDA default: 350m and 1b; paper: sltrain/full = 0.945 at 350m)
    optimizer  step time of optim.AdamW and optim.Adam8bit ÷ torch.optim.AdamW on the same tensors
    memory     CUDA only: peak memory of full-rank AdamW vs 8-bit GaLore and 8-bit SLTrain with per-layer updates
               at 350m, 1b and 7b (batch 1 x 256, bf16; paper: SLTrain -51%, -58%, -73%; Figure 3 for GaLore)

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
import statistics
import sys
import time

import torch
import torch.nn as nn

import optim
from estimate_memory import estimate, measure
from model import LLaMA, METHODS, config_for, is_projection
from sllinear import SLLinear


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
            groups = optim.galore_param_groups(model.named_parameters(), model.config.rank,
                                               lambda name, p: is_projection(name))
            opt = optim.GaLore(groups, **hyper)
        idx = torch.randint(model.config.vocab_size, (batch_size, max_length + 1), device=device)

        def step(model=model, opt=opt, idx=idx):
            _, loss = model(idx[:, :-1], idx[:, 1:].contiguous())
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


def bench_memory(sizes, device, steps=3):
    """Peak CUDA memory (max_memory_allocated) of full-rank AdamW vs 8-bit SLTrain with per-layer updates."""
    result = {}
    for size in sizes:
        peaks = {}
        for name, method, optimizer, per_layer in (("full_adamw", "full", "adamw", False),
                                                   ("galore_8bit_per_layer", "galore", "adam8bit", True),
                                                   ("sltrain_8bit_per_layer", "sltrain", "adam8bit", True)):
            est = estimate(size, method, None, None, "int32", optimizer, per_layer, 1, 256)
            peaks[name + "_estimate"] = est["train_gb"]  # params + optimizer + gradients + activations
            try:
                counted, _ = measure(size, method, None, None, optimizer, per_layer, 1, 256, steps, device)
                peaks[name] = counted["cuda_peak"] / 1e9
            except torch.cuda.OutOfMemoryError:
                peaks[name] = None  # reported as OOM: 7b full-rank may not fit
            gc.collect()
            torch.cuda.empty_cache()
        full, ours = peaks["full_adamw"], peaks["sltrain_8bit_per_layer"]
        peaks["reduction"] = 1 - ours / full if full and ours else None
        result[size] = peaks
    return result


# ----------------------------------------------------------------------------- report

def machine(device):
    info = dict(platform=platform.platform(), cpus=os.cpu_count(), threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version())
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def report(r):
    x = lambda v: f"x{v['ratio']:.3f} [{v['range'][0]:.2f}-{v['range'][1]:.2f}]"  # median ratio [range over rounds]
    if "layer" in r:
        L, v = r["layer"], r["layer"]["variants"]
        print(f"layer {L['shape']} r={L['rank']} delta={L['delta']}, {L['tokens']} tokens, {L['dtype']}, fwd+bwd "
              f"(floor x{L['floor']:.3f})")
        print("  " + " | ".join(f"{k} {v[k]['ms']:.1f} ms {x(v[k])}" for k in v))
    for M in r.get("model", []):
        v = M["variants"]
        print(f"model {M['size']}, batch {M['batch_size']} x {M['max_length']}, {M['dtype']}, optim.AdamW "
              "(galore: optim.GaLore), "
              "throughput vs full")
        print("  " + " | ".join(f"{m} {v[m]['tok_s']:,.0f} tok/s {x(v[m])}" for m in v))
    if "optimizer" in r:
        O, v = r["optimizer"], r["optimizer"]["variants"]
        print(f"optimizer step, {O['size']} sltrain tensors ({O['params_m']:.2f}M, {O['dtype']}), vs torch.optim.AdamW "
              "(for-loop on CPU, foreach on CUDA)")
        print("  " + " | ".join(f"{k} {v[k]['ms']:.1f} ms {x(v[k])}" for k in v))
    for size, P in r.get("memory", {}).items():
        cell = lambda gb: "OOM" if gb is None else f"{gb:.2f} GB"
        reduction = "" if P["reduction"] is None else f" ({-100 * P['reduction']:+.0f}%)"
        print(f"peak memory {size}, batch 1 x 256, bf16: full-rank AdamW {cell(P['full_adamw'])} (estimate "
              f"{P['full_adamw_estimate']:.2f}) | 8-bit GaLore per-layer {cell(P['galore_8bit_per_layer'])} "
              f"(estimate {P['galore_8bit_per_layer_estimate']:.2f}) | "
              f"8-bit SLTrain per-layer {cell(P['sltrain_8bit_per_layer'])} "
              f"(estimate {P['sltrain_8bit_per_layer_estimate']:.2f}){reduction}")
    print("x: median over rounds of the per-round ratio [lowest-highest round]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model for the model and optimizer sections")
    parser.add_argument("--only", nargs="+", choices=["layer", "model", "optimizer", "memory"],
                        help="run only these sections (default: all that apply to the device)")
    parser.add_argument("--size", nargs="+", default=None,
                        help="sizes for the model section (default: 60m on CPU, tiny with --quick, 350m 1b on CUDA)")
    parser.add_argument("--batch_size", type=int, default=None, help="sequences per train step (default: 4, CUDA 16)")
    parser.add_argument("--max_length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per section")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch.set_num_threads); 1 gives steadier ratios on a shared machine")
    parser.add_argument("--json", action="store_true", help="print the results as JSON after the table")
    parser.add_argument("--out", default=None, help="also write the JSON results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    sections = args.only or ["layer", "model", "optimizer"] + (["memory"] if cuda else [])
    if "memory" in sections and not cuda:
        raise ValueError("the memory section measures CUDA's peak allocation; run on a GPU or drop it from --only "
                         "(on CPU, python estimate_memory.py --measure counts memory instead)")
    sizes = args.size or (["350m", "1b"] if cuda else ["tiny"] if args.quick else ["60m"])
    for size in sizes:
        config_for(size)  # an unknown size fails now, naming the valid ones, not after minutes of benchmarks
    batch_size = args.batch_size or (16 if cuda else 8 if args.quick else 4)
    if batch_size < 1 or args.max_length < 1 or args.rounds < 1:
        raise ValueError("--batch_size, --max_length and --rounds must be >= 1")
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 as trained on GPUs; CPUs are fastest in float32

    result = dict(command="python " + " ".join(sys.argv), date=datetime.datetime.now().isoformat(timespec="seconds"),
                  device=str(device), machine=machine(device))
    print(f"{result['command']} | {result['date']} | {device} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__}")
    if "layer" in sections:
        result["layer"] = bench_layer(device, 65536 if cuda else 4096, dtype, args.rounds)
    if "model" in sections:
        result["model"] = [bench_model(s, batch_size, args.max_length, device, dtype, args.rounds) for s in sizes]
    if "optimizer" in sections:
        result["optimizer"] = bench_optimizer("tiny" if args.quick else sizes[0], device, dtype, args.rounds)
    if "memory" in sections:
        result["memory"] = bench_memory(["350m", "1b", "7b"], device)
    report(result)
    if args.json:
        print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
