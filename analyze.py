"""
The paper's analyses of trained weights (§3.1, Table 1, Figures 2, 4 and 11), on a checkpoint that train.py wrote.

    python analyze.py spectrum out/ckpt.pt --figures figs/          # singular values per projection, SVG per kind
    python analyze.py spectrum out/ckpt.pt --json                    # the same numbers as JSON
    python analyze.py prune out/full/ckpt.pt --rank 128 --delta 0.03   # Table 1: full, L0, L0 + top / random δ
    python analyze.py curves run_a/metrics.jsonl run_b/metrics.jsonl --out figs/curves.svg   # Figure 4

spectrum: σ of each projection's (merged) weight W. For an SLTrain weight W = s·BA + S with SVD W = UΣVᵀ, Σ splits
into the parts the low-rank and the sparse factor carry (Appendix D): Σ = diag(Uᵀ(s·BA)V) + diag(UᵀSV), exactly.
For a full-rank weight (full, ReLoRA's merged W0 + s·BA, or SLTrain-FT's W0 + s·BA + S): the residual W - L0
after the best rank-r approximation L0 and the share of its entries below a threshold (§3.1: 97% below 0.04 at
60m), the paper's argument that the residual is small and spread out. prune needs a full-rank checkpoint
(export.py --merged makes one from any other).

Training from a dense checkpoint (Table 1's last rows, and the appendix's fine-tuning) lives here too, called by
train.py:
    python train.py --method sltrain --init_from out/full/ckpt.pt --freeze lowrank --support top
    python train.py --method sltrain_ft --init_from out/full/ckpt.pt     # fine-tuning: W = W0 + s·BA + S, W0 frozen
"""

import argparse
import atexit
import colorsys
import gc
import json
import math
import os
import sys

import torch
import torch.nn as nn

from checkpoint import (OTHER_VERSION, atomic_file, atomic_files, check_tokenizer, checkpoint_file, load_model,
                        make_folder, other_model, peek, remove_empty)
from data import Unbroken, empty_path_refusal, find_shards, load_tokenizer, validation_batches
from estimate_memory import estimate, memory_there
from model import SIZES, LLaMA, LLaMAConfig, RMSNorm, freeze_all_but_values
from sllinear import SLLinear, merge, uniform_support

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projections(model):
    """(name, kind, layer index, module) of every attention and MLP projection, in model order."""
    out = []
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in KINDS:
            out.append((name, kind, int(name.split(".")[1]), module))
    return out


def dense_weight(module):
    """The (out, in) weight of a projection: merged for the layers that have factors (SLLinear, ReLoRALinear)."""
    return module.merged_weight() if hasattr(module, "merged_weight") else module.weight.detach()


def check_finite(name, W):
    # a diverged run's NaN would otherwise surface as the SVD's "failed to converge" traceback
    if not torch.isfinite(W).all():
        raise ValueError(f"{name} has non-finite weights (the run diverged); analyze an earlier checkpoint")


def check_finite_parts(model):
    """check_finite on the parts of every projection (W, or B, A, V and W0), before the first SVD or evaluation: a NaN
    in the last layer is refused at once, not after the SVDs of all before it (at 7b, hours of them). The parts, not
    the merged W: forming every W once more would cost minutes at 7b."""
    for name, _, _, module in projections(model):
        for t in (*module.parameters(), *module.buffers()):
            if t.is_floating_point():  # (a support's positions are integers)
                check_finite(name, t)


def best_rank(W, r):
    """L0, the best rank-r approximation of W (Eckart-Young), and the factors U_r (out, r), σ_r (r,), Vh_r (r, in)."""
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    U, S, Vh = U[:, :r], S[:r], Vh[:r]
    return (U * S) @ Vh, U, S, Vh  # (out, r) @ (r, in) -> (out, in)


# ----------------------------------------------------------------------------- spectrum

def is_full_rank(module):
    """Whether a projection's weight is full-rank by construction: nn.Linear, ReLoRA's W0 + s·BA, SLTrain-FT's
    W0 + s·BA + S. Its spectrum is read as W's, against its best rank-r part."""
    return not isinstance(module, SLLinear) or module.W0 is not None


@torch.no_grad()
def spectrum(model, rank=None, threshold=0.04):
    """One row per projection: its σ (float64), and the low-rank/sparse split (sltrain) or the rank-r residual
    (full)."""
    rows = []
    rank = model.config.rank if rank is None else rank  # `is None`: an explicit 0 is refused, not replaced
    limit = min(model.config.dim, model.config.ffn_dim)  # the smaller side of every projection
    full_rank = any(is_full_rank(m) for *_, m in projections(model))  # only these take the rank
    if full_rank and not 0 < rank < limit:
        raise ValueError(f"rank must be in [1, {limit}), got {rank}")
    check_finite_parts(model)
    for name, kind, layer, module in projections(model):
        W = dense_weight(module).double()
        check_finite(name, W)  # (finite parts can still overflow as they merge)
        split = not is_full_rank(module) and module.values is not None and module.rank > 0
        if split:  # the two parts and W in float64, so that they add up to the rounding of the SVD alone
            low = (module.B.double() * module.scale) @ module.A.double()  # s·BA
            empty = W.new_empty(0)  # float64, on W's device
            sparse = merge(empty.view(W.shape[0], 0), empty.view(0, W.shape[1]), module.values.double(),
                           module.support().long(), 0.0)  # S alone
            W = low + sparse
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)  # (out, k), (k,), (k, in)
        row = dict(name=name, kind=kind, layer=layer, sigma=S.tolist())
        if split:
            # diag(Uᵀ M V) without forming the k x k product: row i of UᵀM times row i of Vᵀ
            row["sigma_lowrank"] = ((U.t() @ low) * Vh).sum(1).tolist()
            row["sigma_sparse"] = ((U.t() @ sparse) * Vh).sum(1).tolist()
        elif is_full_rank(module):
            residual = W - (U[:, :rank] * S[:rank]) @ Vh[:rank]  # (out, r) @ (r, in) -> (out, in)
            row.update(rank=rank, residual_max=residual.abs().max().item(), threshold=threshold,
                       residual_below=(residual.abs() < threshold).double().mean().item(),
                       energy_top_r=(S[:rank].square().sum() / S.square().sum()).item())
        rows.append(row)
    return rows


def spectrum_table(rows):
    """A table per layer kind, one line per layer."""
    lines = []
    for kind in KINDS:
        group = [r for r in rows if r["kind"] == kind]
        if not group:
            continue
        full = "residual_below" in group[0]
        split = "sigma_lowrank" in group[0]
        head = f"{kind:>9} | layer |  σ_max  | σ_min   "
        if full:
            energy, below = f"energy top-{group[0]['rank']}", f"residual < {group[0]['threshold']:g}"
            head += f"| {energy:>14} | residual max | {below:>15}"  # as wide as the numbers below them
        if split:
            head += "| σ_max low-rank part | σ_max sparse part | sparse share of Σσ"
        lines += [head, "-" * len(head)]
        for r in group:
            line = f"{'':>9} | {r['layer']:>5} | {r['sigma'][0]:7.3f} | {r['sigma'][-1]:7.4f} "
            if full:
                line += f"| {100 * r['energy_top_r']:13.1f}% | {r['residual_max']:12.4f} | " \
                        f"{100 * r['residual_below']:14.1f}%"
            if split:
                share = sum(r["sigma_sparse"]) / sum(r["sigma"])
                line += f"| {r['sigma_lowrank'][0]:19.3f} | {r['sigma_sparse'][0]:17.3f} | {100 * share:17.1f}%"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def spectrum_figures(rows, folder, title):
    """One SVG per layer kind: σ against its index, one line per layer; for SLTrain the mean over layers of Σ and
    of its low-rank and sparse parts (Figure 11)."""
    os.makedirs(folder, exist_ok=True)
    figures = []
    for kind in KINDS:
        group = [r for r in rows if r["kind"] == kind]
        if not group:
            continue
        if "sigma_lowrank" in group[0]:
            mean = lambda key: [sum(v) / len(group) for v in zip(*(r[key] for r in group))]  # noqa: E731
            series = [("Σ (merged W)", mean("sigma")), ("diag(Uᵀ s·BA V): low-rank part", mean("sigma_lowrank")),
                      ("diag(Uᵀ S V): sparse part", mean("sigma_sparse"))]
            sub = f"mean over {len(group)} layers"
        else:
            series = [(f"layer {r['layer']}", r["sigma"]) for r in group]
            sub = "one line per layer"
        path = os.path.join(folder, f"spectrum_{kind}.svg")
        figures.append((path, svg_text([(label, list(range(1, len(ys) + 1)), ys) for label, ys in series],
                                       title=f"{title}: singular values of {kind} ({sub})", xlabel="index i",
                                       ylabel="σ_i")))
    # all or none (atomic_files): a write that fails (a full disk) leaves the folder's earlier set as it was, not some
    # kinds of this checkpoint beside others of the one before
    with atomic_files([path for path, _ in figures]) as files:
        for f, (_, text) in zip(files, figures):
            f.write(text)
    return [path for path, _ in figures]


# ----------------------------------------------------------------------------- SVG, written directly

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")


def line_colors(n):
    """n colours, one per line: the palette, or past its 10 (the layers of 130m and up) hues from red to violet in
    order, so that no two lines (layer 0 and layer 10) share one."""
    if n <= len(PALETTE):
        return PALETTE[:n]
    rgb = [colorsys.hsv_to_rgb(0.8 * i / (n - 1), 0.85, 0.8) for i in range(n)]
    return ["#" + "".join(f"{round(255 * c):02x}" for c in color) for color in rgb]


def nice_ticks(lo, hi, n=5):
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
    first = math.floor(lo / step) * step  # the axes start and end on round values
    return [first + i * step for i in range(math.ceil((hi - first) / step - 1e-9) + 1)]


def svg_lines(path, series, title, xlabel, ylabel):
    """svg_text's chart written to path."""
    with atomic_file(path) as f:  # whole or not at all: a full disk leaves an earlier figure as it was
        f.write(svg_text(series, title, xlabel, ylabel))


def svg_text(series, title, xlabel, ylabel, width=720, height=440):
    """A line chart of series [(label, xs, ys)] with axes, ticks, grid and a legend: an SVG file's bytes."""
    # a name from the command line or a folder is kept by Python as bytes that are not UTF-8 where it is not: shown
    # with U+FFFD there, as a file browser does, since an SVG is UTF-8 text
    esc = lambda s: (str(s).encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # noqa: E731
                     .replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))
    left, right, top, bottom = 70, 20, 40, 50
    height = max(height, top + 18 * len(series) + 10)  # tall enough for every legend entry (24 layers at 350m)
    legend_w = 10 + 7 * max(len(label) for label, _, _ in series) + 30
    width = max(width, left + right + legend_w + 360)  # long labels (runs' folder names) widen it, never squeeze the
    # plot to nothing or to a negative width, which SVG does not draw
    plot_w, plot_h = width - left - right - legend_w, height - top - bottom
    xs_all = [x for _, xs, _ in series for x in xs]
    ys_all = [y for _, _, ys in series for y in ys]
    x_ticks, y_ticks = nice_ticks(min(xs_all), max(xs_all)), nice_ticks(min(ys_all), max(ys_all))
    x0, x1 = min(x_ticks[0], min(xs_all)), max(x_ticks[-1], max(xs_all))
    y0, y1 = min(y_ticks[0], min(ys_all)), max(y_ticks[-1], max(ys_all))
    sx = lambda x: left + (x - x0) / ((x1 - x0) or 1) * plot_w  # noqa: E731
    sy = lambda y: top + plot_h - (y - y0) / ((y1 - y0) or 1) * plot_h  # noqa: E731
    fmt = lambda v: f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{esc(title)}</text>']
    for t in x_ticks:
        out.append(f'<line x1="{sx(t):.1f}" y1="{top}" x2="{sx(t):.1f}" y2="{top + plot_h}" stroke="#eee"/>')
        out.append(f'<text x="{sx(t):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{fmt(t)}</text>')
    for t in y_ticks:
        out.append(f'<line x1="{left}" y1="{sy(t):.1f}" x2="{left + plot_w}" y2="{sy(t):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 12}" text-anchor="middle">{esc(xlabel)}</text>')
    out.append(f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2})">{esc(ylabel)}</text>')
    colors = line_colors(len(series))
    for i, (label, xs, ys) in enumerate(series):
        color = colors[i]
        points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(xs) == 1:  # a line of one point draws nothing: a run evaluated once gets a dot
            out.append(f'<circle cx="{sx(xs[0]):.1f}" cy="{sy(ys[0]):.1f}" r="3" fill="{color}"/>')
        ly = top + 10 + 18 * i
        lx = left + plot_w + 12
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 20}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{lx + 26}" y="{ly + 4}">{esc(label)}</text>')
    out.append("</svg>")
    return ("\n".join(out) + "\n").encode()


# ----------------------------------------------------------------------------- Table 1: pruning a dense model

@torch.no_grad()
def prune_weights(model, rank, delta, seed=0):
    """{variant: {projection name: weight}} for L0 (best rank-r), L0 + top-δ and L0 + random-δ of the residual."""
    g = torch.Generator().manual_seed(seed)
    variants = {"L0": {}, "L0 + top": {}, "L0 + random": {}}
    for name, kind, layer, module in projections(model):
        assert isinstance(module, nn.Linear), f"{name} is not dense"
        W = module.weight.detach().double()
        check_finite(name, W)
        L0 = best_rank(W, rank)[0]
        R = (W - L0).view(-1)
        nnz = int(delta * R.numel())
        top = R.abs().topk(nnz).indices
        rand = uniform_support(R.numel(), nnz, generator=g)
        for key, support in (("L0", top[:0]), ("L0 + top", top), ("L0 + random", rand)):
            w = L0.clone()
            w.view(-1)[support] += R[support]
            variants[key][name] = w.to(module.weight.dtype)
    return variants


def prune_memory_refusal(model, run, batch_size):
    """Why prune at batch_size would not fit in this machine's memory (estimate_memory.memory_there), naming a batch
    that would; None where it fits, or where the checkpoint names no size to estimate. What it holds: the float32
    model, four copies of its projections (the original and the three variants) and an evaluation forward."""
    there, size = memory_there(torch.device("cpu")), run.get("size")
    if there is None or size not in SIZES:
        return None
    available, share, where = there
    copies = 4 * sum(m.weight.nbytes for _, _, _, m in projections(model))
    config = model.config

    def need(b):  # affine in the batch, as estimate's activations are
        return copies + 1e9 * estimate(size, "full", batch_size=b, max_length=run.get("max_length", 256),
                                       dtype="float32", vocab_size=config.vocab_size, ffn_dim=config.ffn_dim)["eval_gb"]
    room, asked = share * available, need(batch_size)
    if asked <= room:
        return None
    one, two = need(1), need(2)
    fits = int((room - one) // (two - one)) + 1 if one <= room else 0
    fix = f"pass --batch_size {fits}" if fits else "use a machine with more memory"
    return (f"--batch_size {batch_size} needs about {asked / 1e9:.1f} GB (the model, four copies of its projections "
            f"and an evaluation forward), more than {share:.0%} of {where}; {fix}")


def prune(model, batches, rank, delta, seed=0):
    """Table 1: validation (loss, perplexity) of the full model and of its three pruned variants."""
    from train import evaluate  # the evaluation of training itself
    if model.config.method != "full":
        raise ValueError(f"prune needs a full-rank checkpoint, not {model.config.method}: train with --method full, "
                         "or merge one with export.py --merged")
    device = next(model.parameters()).device
    modules = {name: module for name, _, _, module in projections(model)}
    check_finite_parts(model)  # before any evaluation, which a NaN would only waste
    original = {name: m.weight.detach().clone() for name, m in modules.items()}
    no_signal = {"signal": None}  # train.py's evaluate stops early on a signal; here nothing sets one
    results = {"full": evaluate(model, batches, device, 0, 1, no_signal)[:2]}
    try:
        for key, weights in prune_weights(model, rank, delta, seed).items():
            with torch.no_grad():
                for name, w in weights.items():
                    modules[name].weight.copy_(w)
            results[key] = evaluate(model, batches, device, 0, 1, no_signal)[:2]
    finally:  # also after an error or Ctrl-C mid-evaluation: the caller's model is never left a pruned variant
        with torch.no_grad():
            for name, w in original.items():
                modules[name].weight.copy_(w)
    return results


# ----------------------------------------------------------------------------- training from a dense checkpoint

def init_refusal(path, ckpt, config, tokenizer_sha256=None):
    """Why the checkpoint at path (ckpt: it loaded, or checkpoint.peek's look at it) cannot start a model of config,
    or None: it must be full-rank, of the model's shape, and trained with the run's tokenizer where it says."""
    full = "a full-rank checkpoint (train.py --method full, or export.py --merged of any run)"
    if not isinstance(ckpt, dict) or not {"model", "model_config"} <= set(ckpt):
        return f"--init_from {path}: holds no model (not written by train.py or export.py --merged); pass {full}"
    source = ckpt["model_config"]
    if source.get("method") != "full":
        return f"--init_from {path}: a {source.get('method')} checkpoint; pass {full}"
    if other := other_model(source):  # weights trained at another rope_theta, say, are another model's
        return f"--init_from {path}: {other}; {OTHER_VERSION}"
    for field in ("vocab_size", "dim", "ffn_dim", "n_heads", "n_layers"):
        if source.get(field) != getattr(config, field):
            fix = {"vocab_size": "pass the --tokenizer it was trained with",
                   "ffn_dim": f"pass --ffn_dim {source.get(field)}"}.get(field, "pass the --size it was trained at")
            return (f"--init_from {path}: {field} {source.get(field)} differs from this model's "
                    f"{getattr(config, field)}; {fix}")
    trained_with = ckpt.get("args", {}).get("tokenizer_sha256")
    if tokenizer_sha256 and trained_with and trained_with != tokenizer_sha256:
        return (f"--init_from {path}: trained with another tokenizer (sha256 {trained_with[:12]}...) than "
                f"--tokenizer ({tokenizer_sha256[:12]}...); pass the one it was trained with")
    return None


@torch.no_grad()
def init_from_dense(model, path, support="random", tokenizer_sha256=None):
    """Start a lowrank or sltrain model at a full-rank checkpoint: s·BA = L0, its best rank-r approximation
    (B = U√Σ/√s, A = √ΣVᵀ/√s), and V = the residual W0 - L0 on the support: the layer's own random one, or
    with support="top" the δ·in·out largest entries of the residual. An sltrain_ft model (fine-tuning) takes W0 as
    its frozen base and keeps its start, B = 0 and V = 0. Everything else (embeddings, norms, head; a full model's
    every weight, for full-rank fine-tuning) is copied. tokenizer_sha256: the run's tokenizer, which must be the one
    the checkpoint was trained with where it says (the same number of pieces is not the same pieces)."""
    if model.config.method == "relora":
        raise ValueError("--init_from starts a full, lowrank, sltrain or sltrain_ft model, not relora; pass --method "
                         "sltrain")
    dense, ckpt = load_model(path)
    if refusal := init_refusal(path, ckpt, model.config, tokenizer_sha256):
        raise ValueError(refusal)
    source = dict(dense.named_modules())
    for name, module in model.named_modules():
        if isinstance(module, SLLinear) and module.W0 is not None:  # <-- SLTrain-FT: W = W0 + s·BA + S
            module.W0.copy_(source[name].weight)
        elif isinstance(module, SLLinear):
            W0 = source[name].weight.double()
            L0 = torch.zeros_like(W0)
            if module.rank > 0:
                L0, U, S, Vh = best_rank(W0, module.rank)
                root = S.sqrt() / math.sqrt(module.scale)  # the layer multiplies B A by s: split 1/s evenly
                module.B.copy_(U * root)  # (out, r)
                module.A.copy_(root[:, None] * Vh)  # (r, in)
            if module.values is not None:
                R = (W0 - L0).view(-1)
                if support == "top":
                    module.set_support(R.abs().topk(module.values.numel()).indices.sort().values)
                if module.rank > 0:  # V from the factors as rounded to the model's dtype (bf16: 2⁻⁹ off each), so
                    # that s·BA + V is W0 on the support to V's one rounding, not to the factors' rounding beside it
                    R = (W0 - module.scale * (module.B.double() @ module.A.double()).cpu()).view(-1)
                module.values.copy_(R[module.support().long().cpu()])  # R is on the CPU, the model maybe not
        elif isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            module.weight.copy_(source[name].weight)
    return ckpt


def prepare_for_training(model, args, resuming):
    """train.py's --support_seed, --init_from, --support and --freeze, applied to a fresh model (a resumed one has
    its support and weights in its checkpoint, but is frozen again: requires_grad is not saved)."""
    if not resuming and args.support_seed is not None:
        g = torch.Generator().manual_seed(args.support_seed)
        for module in model.modules():  # model order, so a seed gives the same supports on every run
            if isinstance(module, SLLinear) and module.values is not None:
                n = module.in_features * module.out_features
                module.set_support(uniform_support(n, module.values.numel(), generator=g))
    if not resuming and args.init_from:
        init_from_dense(model, args.init_from, support=args.support,
                        tokenizer_sha256=getattr(args, "tokenizer_sha256", None))
    if args.freeze == "lowrank":  # Table 1's sparse training: L0 and every dense weight stay, only V learns
        freeze_all_but_values(model)


# ----------------------------------------------------------------------------- Figure 4: eval curves

def read_curve(path, key, sets=None):
    """(steps, values) of the eval rows of a metrics.jsonl; a resumed run's repeated steps keep the last row.
    A file that is not one train.py wrote raises ValueError naming the file, and the line where there is one.
    sets, a dict, gets each step's val_tokens, the size of the validation set it was scored on (None in a row from
    before train.py recorded it)."""
    path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path  # a run's folder: its metrics
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file at {path}; pass the metrics.jsonl in a train.py --out_dir, or "
                                "the folder")
    points = {}
    fix = "fix or delete that line (train.py writes one JSON object per line)"
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: not a JSON object; {fix}")
                if key in row:
                    step, value = row.get("step"), row[key]
                    if type(step) is not int or type(value) not in (int, float):  # `type`: bools are ints too
                        raise ValueError(f"{path}:{n}: a {key} row needs an integer step and a number; {fix}")
                    points[step] = value
                    if sets is not None:
                        sets[step] = row.get("val_tokens")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text, so not a metrics.jsonl; pass the one in a train.py --out_dir") from None
    if not points:
        raise ValueError(f"{path} has no {key!r} rows; the run never evaluated (lower --eval_every)")
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def get_args(argv=None):
    """The command line, every number checked before any checkpoint or data is read: a bad one is one line naming
    the fix, and a value given is never replaced by a default."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("spectrum", allow_abbrev=False, help="singular values of every projection")
    s.add_argument("ckpt", help="a checkpoint written by train.py")
    s.add_argument("--rank", type=int, help="r of the residual analysis of full-rank weights (full, relora and "
                   "sltrain_ft checkpoints; default: the checkpoint's rank)")
    s.add_argument("--threshold", type=float, help="count residual entries below this (§3.1; full, relora and "
                   "sltrain_ft checkpoints; default 0.04)")
    s.add_argument("--json", action="store_true", help="print the numbers as JSON instead of the tables")
    s.add_argument("--figures", help="write one SVG per layer kind into this folder")
    q = sub.add_parser("prune", help="Table 1: perplexity of a full-rank model pruned to L0 (+ δ of the residual)",
                       allow_abbrev=False)
    q.add_argument("ckpt", help="a full-rank checkpoint written by train.py (or export.py --merged)")
    q.add_argument("--rank", type=int, help="r of L0 (default: the checkpoint's rank)")
    q.add_argument("--delta", type=float, default=0.03, help="fraction of residual entries kept, in [0, 1)")
    q.add_argument("--seed", type=int, default=0, help="seed of the random support")
    q.add_argument("--data_dir", help="validation shards (default: the checkpoint's --data_dir)")
    q.add_argument("--tokenizer", help="sentencepiece model (default: the checkpoint's)")
    q.add_argument("--eval_tokens", type=int, help="validation tokens (default: the checkpoint's)")
    q.add_argument("--batch_size", type=int, default=8, help="sequences per evaluation batch")
    q.add_argument("--json", action="store_true", help="print the results as JSON")
    c = sub.add_parser("curves", allow_abbrev=False, help="Figure 4: eval curves of several runs in one SVG")
    c.add_argument("metrics", nargs="+", help="metrics.jsonl files written by train.py, or the runs' folders")
    c.add_argument("--labels", nargs="+", help="one legend label per file (default: the runs' folder names, "
                   "with the parent folders that tell apart two of one name)")
    c.add_argument("--key", default="val_ppl", choices=["val_ppl", "val_loss"], help="what to plot")
    c.add_argument("--out", default="curves.svg", help="the SVG file to write (its folder is created)")
    args = p.parse_args(argv)
    if refusal := empty_path_refusal(args, ("ckpt", "metrics", "--figures", "--data_dir", "--tokenizer", "--out")):
        p.error(refusal)  # (each command's own: the others are absent)

    positive = {"spectrum": ("rank",), "prune": ("rank", "eval_tokens", "batch_size"), "curves": ()}[args.command]
    for name in positive:  # counts become int64 sizes
        if getattr(args, name) is not None and not 0 < getattr(args, name) < 2 ** 63:
            p.error(f"--{name} must be positive and at most 2^63 - 1, got {getattr(args, name)}")
    if args.command == "spectrum" and args.threshold is not None and not 0 < args.threshold < math.inf:
        p.error(f"--threshold must be a positive number, got {args.threshold}")  # `not <`: NaN is refused too
    if args.command == "spectrum" and args.figures and os.path.exists(args.figures) and not os.path.isdir(args.figures):
        p.error(f"--figures {args.figures} is a file; pass a folder (it is created if missing)")
    if args.command == "prune" and args.tokenizer:
        try:
            load_tokenizer(args.tokenizer)
        except (OSError, ValueError) as e:
            p.error(f"--tokenizer: {e}")
    if args.command == "prune":
        if not 0 <= args.delta < 1:
            p.error(f"--delta must be in [0, 1), got {args.delta}")
        if not -2**63 <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
            p.error(f"--seed must fit in 64 bits, got {args.seed}")
    if args.command in ("spectrum", "prune"):
        refuse_at_a_look(args)
    if args.command == "curves":
        if args.labels is not None and len(args.labels) != len(args.metrics):
            p.error(f"{len(args.labels)} --labels for {len(args.metrics)} files; give one per file")
        # one run named twice (its folder and its file, or through a link) would be two curves that coincide: in
        # Figure 4, two supports that agree exactly
        files = [os.path.realpath(os.path.join(m, "metrics.jsonl") if os.path.isdir(m) else m) for m in args.metrics]
        for i, path in enumerate(files):
            if path in files[:i]:
                p.error(f"{args.metrics[i]} is the run of {args.metrics[files.index(path)]} again: its curve would be "
                        "drawn twice, as if two runs agreed; give each run once")
        if os.path.isdir(args.out):
            p.error(f"--out {args.out} is a folder; pass a file in it, such as {os.path.join(args.out, 'curves.svg')}")
        if not args.out.lower().endswith(".svg"):  # an earlier figure is replaced; a run's metrics.jsonl or ckpt.pt not
            p.error(f"--out {args.out}: the figure is an SVG, written over any file of that name; pass a name ending "
                    "in .svg")
    # the folder written into, made now: one that cannot be is refused before any SVD or file is read
    folder = {"spectrum": getattr(args, "figures", None), "curves": os.path.dirname(getattr(args, "out", "") or "")}
    args.made_folders = []  # removed again if the command fails and leaves them empty
    if folder.get(args.command):
        try:
            args.made_folders = make_folder(folder[args.command])
        except OSError as e:
            flag = "--figures" if args.command == "spectrum" else "--out"
            p.error(f"{flag} {getattr(args, flag[2:])}: cannot make or write into {folder[args.command]} "
                    f"({e.strerror or e}); pass a folder you can write to")
    return args


def refuse_at_a_look(args):
    """spectrum's and prune's flags against the checkpoint at checkpoint.peek's quick look, before the full read
    (minutes at 7b, and prune's float32 copy): the model's method and sizes, and for prune the tokenizer, the
    validation shards and the memory. Where the look cannot tell, weights() asks after the read."""
    look = peek(checkpoint_file(args.ckpt))
    config = look.get("model_config") if isinstance(look, dict) else None
    if isinstance(config, dict) and {"method", "dim", "ffn_dim", "rank"} <= set(config):
        if refusal := config_refusal(args, config):
            raise SystemExit(refusal)
    if args.command != "prune":
        return
    try:  # the tokenizer, after the flags
        check_tokenizer(args.ckpt, args.tokenizer)
    except (OSError, ValueError) as e:
        raise SystemExit(f"analyze.py prune: {e}") from None
    # the validation shards, the checkpoint's own folder where --data_dir names none (a run from another machine)
    run = look.get("args") if isinstance(look, dict) and isinstance(look.get("args"), dict) else {}
    data_dir = run.get("data_dir") if args.data_dir is None else args.data_dir
    try:
        if data_dir is not None:  # (none recorded: weights() says to pass --data_dir)
            find_shards(data_dir, "validation")
    except (OSError, ValueError) as e:
        raise SystemExit(f"analyze.py prune: validation data: {e}") from None
    # the memory, from the model's sizes alone: a model this machine cannot prune is refused before it is read whole
    # and cast to float32, which is what the OS would kill the process for
    try:
        shape = LLaMA(LLaMAConfig(**config), device="meta") if isinstance(config, dict) else None
    except (TypeError, ValueError):  # not this model.py's fields: load_model says so after the read
        shape = None
    if shape is not None and (refusal := prune_memory_refusal(shape, run, args.batch_size)):
        raise SystemExit(f"analyze.py prune: {refusal}")


def run_labels(paths):
    """Each run's folder name (a metrics.jsonl's folder, or the folder given); where two runs' names coincide
    (out/60m/sltrain and out/130m/sltrain), with as many of its parent folders as tell it apart."""
    folders = [os.path.abspath(m) if os.path.isdir(m) else os.path.dirname(os.path.abspath(m)) for m in paths]
    tail = lambda folder, n: os.path.join(*folder.split(os.sep)[-n:])  # noqa: E731  (its last n names)
    labels = []
    for folder in folders:
        others, n = [f for f in folders if f != folder], 1  # (two files of one folder share its name)
        while n < len(folder.split(os.sep)) and any(tail(f, n) == tail(folder, n) for f in others):
            n += 1
        labels.append(tail(folder, n))
    return labels


def set_parts(label, path, points, sets):
    """A run's curve as one series per validation set, [(label, steps, values)]: a resume with another --eval_tokens
    scores its later rows on another set (train.py's val_tokens), and one line through both would draw the change of
    set as the model's (said, and drawn as a part for each set). A row that does not say (from before train.py
    recorded it) counts as of the set beside it."""
    parts = []  # [size, steps, values]
    for step, value in points:
        size = sets.get(step)
        known = parts[-1][0] if parts else None
        if not parts or None not in (size, known) and size != known:  # another set than the part's
            parts.append([size, [], []])
        parts[-1][0] = parts[-1][0] or size  # rows before that did not say: of this set
        parts[-1][1].append(step)
        parts[-1][2].append(value)
    if len(parts) == 1:
        return [(label, parts[0][1], parts[0][2])]
    changes = ", ".join(f"at step {b[1][0]} ({a[0]} -> {b[0]} tokens)" for a, b in zip(parts, parts[1:]))
    print(f"analyze.py curves: {path}: the validation set changes {changes}, another --eval_tokens on a resume; "
          "drawn as a part for each set", file=sys.stderr)
    return [(f"{label} ({size} val tokens)", steps, values) for size, steps, values in parts]


def curves(args):
    """Figure 4 from the command line: read every file, then write one SVG."""
    labels = args.labels or run_labels(args.metrics)
    series = []
    for label, path in zip(labels, args.metrics):
        try:
            sets = {}
            steps, values = read_curve(path, args.key, sets)
        except (OSError, ValueError) as e:
            raise SystemExit(f"analyze.py curves: {e}") from None
        # a diverged run logs NaN or inf: said and left out, as a plot cannot place them
        bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
        if len(bad) == len(steps):
            raise SystemExit(f"analyze.py curves: {path}: every {args.key} is non-finite (the run diverged); "
                             "drop that file")
        if bad:
            print(f"analyze.py curves: {path}: {args.key} is non-finite at step(s) {', '.join(map(str, bad))}; "
                  "left out of the plot", file=sys.stderr)
        finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
        series += set_parts(label, path, finite, sets)
    try:
        svg_lines(args.out, series, title=f"validation {args.key.split('_')[1]} during training",
                  xlabel="update", ylabel=args.key)
    except OSError as e:
        raise SystemExit(f"analyze.py curves: cannot write --out {args.out} ({e.strerror or e}); "
                         "pass a file in a folder you can write to") from None
    print(f"wrote {args.out}")


def main(argv=None):
    args = get_args(argv)
    try:
        return (curves if args.command == "curves" else weights)(args)
    except BaseException as e:  # an error, a refusal or Ctrl-C: no empty folder made for this command stays behind
        remove_empty(args.made_folders)
        if isinstance(e, KeyboardInterrupt):
            raise SystemExit(f"analyze.py {args.command}: interrupted; a file it was writing is removed") from None
        raise


def config_refusal(args, config):
    """Why the flags do not fit the checkpoint's model (config: its model_config), or None: what it is, then its
    sizes. get_args asks it on checkpoint.peek's quick look, so that a refusal comes before the full read (at 350m
    half a minute, at 7b minutes)."""
    method, limit = config["method"], min(config["dim"], config["ffn_dim"])
    if args.command == "prune" and method != "full":
        return (f"analyze.py prune: {args.ckpt} is {method}; prune needs a full-rank checkpoint: train with --method "
                "full, or merge this one with export.py --merged")
    if method in ("lowrank", "sltrain") and (args.rank is not None or getattr(args, "threshold", None) is not None):
        # an sltrain run of --rank 0 or --delta 0 has one part, so no split: its σ alone, as a lowrank run's
        split = method == "sltrain" and config["rank"] > 0 and config.get("delta", 0) > 0
        how = "Σ split into its low-rank and sparse parts" if split else "its σ alone"
        return (f"analyze.py spectrum: --rank and --threshold set the residual analysis of full-rank weights (full, "
                f"relora and sltrain_ft checkpoints); {args.ckpt} is {method}, shown as {how}: drop them")
    rank = config["rank"] if args.rank is None else args.rank
    if method in ("full", "relora", "sltrain_ft") and not 0 < rank < limit:
        default = "" if args.rank is not None else " (the checkpoint's rank, the default); pass --rank"
        return f"analyze.py {args.command}: --rank must be in [1, {limit}) for this model, got {rank}{default}"
    return None


def weights(args):
    """spectrum or prune: the analyses of a checkpoint's weights, from the command line."""
    try:
        model, ckpt = load_model(args.ckpt)
    except (OSError, ValueError) as e:
        raise SystemExit(f"analyze.py {args.command}: {e}") from None
    # only the run's args and model_config are needed: the optimizer's state (twice the parameters with AdamW) and the
    # tensors as stored (bf16 ones outlive model.float()) would stay in memory through the SVDs and evaluations,
    # beside what prune_memory_refusal counts
    ckpt = {k: ckpt[k] for k in ("args", "model_config") if k in ckpt}
    model.float()
    if refusal := config_refusal(args, ckpt["model_config"]):  # a file the quick look could not read: now
        raise SystemExit(refusal)
    method = model.config.method
    rank = model.config.rank if args.rank is None else args.rank
    if args.command == "spectrum":
        threshold = 0.04 if args.threshold is None else args.threshold
        try:
            rows = spectrum(model, rank, threshold)
        except ValueError as e:
            raise SystemExit(f"analyze.py spectrum: {e}") from None
        print(json.dumps(rows) if args.json else spectrum_table(rows))
        if args.figures:
            title = f"{ckpt.get('args', {}).get('size', '')} {method}".strip()
            try:
                paths = spectrum_figures(rows, args.figures, title)
            except OSError as e:
                raise SystemExit(f"analyze.py spectrum: cannot write into --figures {args.figures} "
                                 f"({e.strerror or e}); pass a folder you can write to") from None
            for path in paths:
                print(f"wrote {path}", file=sys.stderr)
        return

    run = ckpt.get("args", {})
    data_dir = run.get("data_dir") if args.data_dir is None else args.data_dir
    tokenizer = run.get("tokenizer") if args.tokenizer is None else args.tokenizer
    if data_dir is None or tokenizer is None:
        raise SystemExit(f"analyze.py prune: {args.ckpt} does not record its validation data; pass --data_dir and "
                         "--tokenizer")
    eval_tokens = run.get("eval_tokens", 10_000_000) if args.eval_tokens is None else args.eval_tokens
    if refusal := prune_memory_refusal(model, run, args.batch_size):
        raise SystemExit(f"analyze.py prune: {refusal}")
    try:  # before the validation data is read: prune would refuse the weights after it
        check_finite_parts(model)
    except ValueError as e:
        raise SystemExit(f"analyze.py prune: {e}") from None
    try:
        load_tokenizer(tokenizer, pieces=model.config.vocab_size, sha256=run.get("tokenizer_sha256"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"analyze.py prune: {e}") from None
    try:
        batches = validation_batches(data_dir, tokenizer, args.batch_size, max_length=run.get("max_length", 256),
                                     eval_tokens=eval_tokens, pack=run.get("pack", False))
    except (OSError, ValueError) as e:
        raise SystemExit(f"analyze.py prune: validation data: {e}") from None  # data.py's errors name the fix
    if batches.short:  # honored as far as the shards go, and said
        print(f"analyze.py prune: note: the validation shards in {data_dir} hold {batches.tokens:,} tokens, fewer "
              f"than --eval_tokens {eval_tokens:,}: every evaluation covers those {batches.tokens:,}", file=sys.stderr)
    try:
        results = prune(model, batches, rank, args.delta, args.seed)
    except ValueError as e:
        raise SystemExit(f"analyze.py prune: {e}") from None
    if args.json:
        print(json.dumps({k: {"val_loss": v[0], "val_ppl": v[1]} for k, v in results.items()}))
        return
    print(f"{'model':<24} | val loss | val ppl   (rank {rank}, delta {args.delta})")
    for key, (loss, ppl) in results.items():
        label = {"L0 + top": f"L0 + top {args.delta:g}", "L0 + random": f"L0 + random {args.delta:g}"}.get(key, key)
        print(f"{label:<24} | {loss:8.4f} | {ppl:.2f}")


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    # its figures are written after its table, and its notes (on stderr) come before the work: a reader's end
    # (| head, 2>&1 | tee) must stop neither
    sys.stdout, sys.stderr = Unbroken(sys.stdout), Unbroken(sys.stderr)
    main()
