"""
Memory of pretraining LLaMA with each method: the paper's estimate (Table 2's Mem column, Appendix F), computed
from the models of model.py without allocating them (on the meta device, activations on fake tensors), and measured
on a few real training steps.

    python estimate_memory.py                                              # Table 2 + Appendix F, all sizes
    python estimate_memory.py --size 60m --method sltrain --rank 128 --delta 0.01   # an ablation (Table 6): 43.02M
    python estimate_memory.py --size 7b --method sltrain --optimizer adam8bit --per_layer --batch_size 1
    python estimate_memory.py --size 7b --method sltrain --optimizer adam8bit --per_layer --batch_size 8 \
        --activation_checkpointing                                         # as train.py --activation_checkpointing
    python estimate_memory.py --size 7b --method sltrain --optimizer adam8bit --per_layer --batch_size 1 --amp
                                                                           # as train.py --amp: float32 + autocast
    python estimate_memory.py --size 7b --method sltrain --optimizer adam8bit --per_layer --batch_size 1 \
        --gradient_accumulation 4                                          # the gradients kept between micro-batches
    python estimate_memory.py --size 7b --method sltrain --optimizer adam8bit --per_layer --batch_size 1 \
        --delta 0.03 --index_dtype packed                                  # as train.py --packed_support
    python estimate_memory.py --size 7b --method sltrain_ft --optimizer adam8bit --per_layer --batch_size 1
                                                                           # fine-tuning (the paper's appendix)
    python estimate_memory.py --json                                       # machine-readable rows
    python estimate_memory.py --size tiny --measure                        # estimate beside measurement

The paper's convention (Appendix F): parameters and Adam's two moments in bf16 (2 bytes each), sparse indices in
int64 (8 bytes), 1G = 10⁹ bytes, total = parameters + optimizer state, added as printed (the paper's 130m full-rank
total .27 + .54 = .81 although 0.8047 rounds to .80). Gradients and activations are not in the paper's total; we
print them beside it, and `train` adds them. Per method:
    full      all parameters, and the moments of all of them
    lowrank   W = s·BA for every projection; embeddings, norms and head stay dense
    sltrain   W = s·BA + S: as lowrank, plus nnz values (bf16) and nnz indices (int64 by default; --index_dtype
              int32 as sllinear.py stores them, or packed: nnz + out·in/255 bytes a layer, train.py --packed_support)
    relora    the full-rank weights plus the low-rank model (adapters and the other parameters); moments of the latter
    galore    the full-rank weights; per projection (m, n) the moments of the projected gradient, r·max(m, n)
              elements each, and the projection, r·min(m, n); moments of all other parameters as usual
    sltrain_ft  fine-tuning, named alone: the pretrained projections kept frozen (W0) under sltrain's factors;
              only B, A and V have gradients and moments (embeddings, norms and head frozen too)
"""

import argparse
import atexit
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import signal
import tempfile
import textwrap
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import galore
import optim
from devices import device_from_flag
from model import (LLaMA, LLaMAConfig, SIZES, SPARSE, loss_chunk_rows, config_for, freeze_all_but_values,
                   is_projection, length_refusal)
from per_layer import attach_per_layer
from sllinear import SLLinear

ALL_METHODS = ("full", "lowrank", "relora", "galore", "sltrain")  # the paper's table
METHODS = ALL_METHODS + ("sltrain_ft",)  # and fine-tuning (the paper's appendix), on request
PAPER_SIZES = ("60m", "130m", "350m", "1b", "7b")
BF16 = 2  # bytes of a parameter, a gradient and (for AdamW) a moment, as the paper counts
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # the same under train.py --dtype float32 (CPU's default) or --amp
INDEX_BYTES = {"int64": 8, "int32": 4}
INDEX_FORMATS = (*INDEX_BYTES, "packed")  # packed: as SLLinear(packed=True) stores a support (sllinear.pack_support)
BLOCK_SIZE, MIN_8BIT_SIZE = 256, 4096  # optim.Adam8bit's defaults: one float32 absmax per block of 256 codes
GB = 1e9

# Cells where the paper's printed figure disagrees with its own configuration; we print the correct value.
SLIPS = {
    ("60m", "lowrank"): "paper prints 0.08 + 0.16 = 0.24, but its own 42.78M parameters take 0.0856G and 0.171G",
    ("60m", "relora"): "paper's Table prints optim 0.16 (total 0.36), but its Appendix F text gives 85.54M moments "
                       "= 0.17G; its 102.77M stored parameters are 58.07M + 42.77M = 100.84M (still 0.20G)",
    ("350m", "galore"): "paper prints optim 0.85 (total 1.59) from a projection of 144.04M; the configuration "
                        "gives 7·24·256·1024 = 44.04M (its 60m/130m/1b projections are right)",
    ("130m", "sltrain", 224, 0.03): "paper's Appendix F and Table 6 print total 0.58 for r=224, but its own "
                                    "cells add to 0.20 + 0.36 = 0.56",
}


def slip(size, method, rank, delta):
    """The footnote of a cell the paper printed differently, if this is one of them."""
    default_rank, default_delta = SIZES[size][4], SIZES[size][6]
    if rank == default_rank and (method != "sltrain" or delta == default_delta):
        return SLIPS.get((size, method))
    return SLIPS.get((size, method, rank, delta))


def moment_bytes(numel, optimizer, width=BF16, block_size=BLOCK_SIZE):
    """Bytes of Adam's two moments of one tensor whose parameter has `width` bytes (AdamW keeps its dtype)."""
    if optimizer == "adamw":
        return 2 * width * numel
    if numel < MIN_8BIT_SIZE:  # small tensors (norms) keep float32 moments: quantizing them saves nothing
        return 2 * 4 * numel
    blocks = math.ceil(numel / block_size)
    return 2 * blocks * (block_size + 4)  # per block: a 1-byte code per element (last block padded) + a float32 absmax


class SavedTensors:
    """Counts the bytes autograd saves for backward (the activations), once per storage, parameters excluded."""

    def __init__(self, model):
        self.skip = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self.seen = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        storage = t.untyped_storage()
        if storage._cdata not in self.skip:
            self.seen[storage._cdata] = storage.nbytes()
        # detached: an operation's output, packed as itself, would hold its own grad_fn, a cycle through C++ that
        # keeps a forward's whole graph alive until a backward runs (and forever when none does)
        return t.detach()

    @property
    def nbytes(self):
        return sum(self.seen.values())

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def activation_bytes(size, method, rank, delta, batch_size, max_length, activation_checkpointing=False,
                     dtype="bfloat16", amp=False, vocab_size=None, freeze=None, ffn_dim=None):
    """Saved activations of one forward of the model in dtype (amp: float32 parameters under bf16 autocast), counted
    on fake CPU tensors: they run CPU's kernels and autocast's rules (SDPA's flash kernel, which saves q, k, v, the
    output and a float32 logsumexp; the bf16 casts autocast makes) without allocating memory, so any size is free.
    With activation checkpointing a block saves only its input, for the recomputation in backward. freeze="lowrank":
    only V requires grad, so what is saved for the frozen weights' gradients alone is not.

    The blocks are alike, so a model of one block and one of two are counted, and each further block adds what the
    second did: the same bytes as counting all of them (test_estimate_memory.py checks it), in seconds fewer at 7b.
    So are the sequences of a batch: batches of one and two are counted, and each further sequence adds what the
    second did (the rotary tables are the batch's, once), so that any batch is counted at once, never traced at a
    size past torch's int64 sizes."""
    config = config_for(size, method=method, rank=rank, delta=delta, vocab_size=vocab_size, ffn_dim=ffn_dim)
    if batch_size > 2:
        one, two = (activation_bytes(size, method, rank, delta, b, max_length, activation_checkpointing, dtype, amp,
                                     vocab_size, freeze, ffn_dim) for b in (1, 2))
        return one + (batch_size - 1) * (two - one)
    options = (batch_size, max_length, activation_checkpointing, dtype, amp, freeze)
    if config.n_layers <= 2:
        return saved_bytes(config, *options)
    one, two = (saved_bytes(dataclasses.replace(config, n_layers=n), *options) for n in (1, 2))
    return one + (config.n_layers - 1) * (two - one)


def saved_bytes(config, batch_size, max_length, activation_checkpointing, dtype, amp, freeze):
    """What one forward of the model of this config saves for backward, counted (activation_bytes). Counted once a
    process for each config and options, of which it is a function: a memory check that names a fix, the table and
    the suite ask for the same counts again."""
    return counted_saved_bytes(dataclasses.astuple(config), batch_size, max_length, activation_checkpointing, dtype,
                               amp, freeze)


@functools.lru_cache(maxsize=None)
def counted_saved_bytes(config_fields, batch_size, max_length, activation_checkpointing, dtype, amp, freeze):
    # as train.py builds it: under --amp W0 in bf16, so that LoRA's F.linear saves no bf16 copy of W0
    model = LLaMA(LLaMAConfig(*config_fields), device="meta", dtype=getattr(torch, dtype),
                  base_dtype=torch.bfloat16 if amp else None)
    model.activation_checkpointing = activation_checkpointing
    model.autocast = torch.bfloat16 if amp else None
    with FakeTensorMode(allow_non_fake_inputs=True):  # the meta parameters become fake ones
        model.to_empty(device="cpu")
        if freeze:
            freeze_all_but_values(model)
        idx, targets = (torch.zeros(batch_size, max_length, dtype=torch.long) for _ in range(2))
        with SavedTensors(model) as saved:
            model(idx, targets)
    return saved.nbytes


def recomputed_block(whole, checkpointed, n_layers):
    """What a checkpointed backward adds while it recomputes a block: the block's activations less its input, which
    the forward saved. From the bytes a forward saves without checkpointing (whole) and with it: a block saves
    (whole - checkpointed) / n_layers more than its input, the blocks being alike."""
    return (whole - checkpointed) // n_layers


def autocast_copies(module):
    """Bytes of the bf16 copies autocast keeps of the module's nn.Linear weights (float32 leaves that require grad):
    its cache holds each from its first use to the end of the outermost autocast, the model's whole forward. Without
    checkpointing they are saved for backward too, and so counted among the activations; a checkpointed block saves
    none of them, nor does a forward without gradients, which holds them all at once (train.py --amp, full rank and
    GaLore: 13 GB at 7b). None for SLTrain's layers, which cast inside their Function, ReLoRA's factors, which enter
    through a view (A.t()) that autocast does not cache, or frozen weights."""
    return BF16 * sum(m.weight.numel() for m in module.modules()
                      if isinstance(m, torch.nn.Linear) and m.weight.requires_grad)


def formed_weight(model):
    """(entries, gradient entries) of the largest dense weight an SLTrain call forms, s·BA ⊕_I V of a layer or of a
    group of layers that share one call (sllinear._weights), and of the trainable parameters of that call, whose
    gradients it returns beside the weight. The weight lives through the call's GEMMs: beside a block's activations
    in a forward without gradients, and again in backward (which then writes the weight's gradient over it) beside
    nearly every activation. A forward of few tokens at wide layers is mostly this matrix (at 7b the MLP's gate and
    up: 180 MB in bf16). (0, 0) where no layer forms one: full-rank layers are nn.Linear, low-rank ones multiply by
    A and B in turn."""
    calls = [[m] for m in model.modules()] + model.shared_calls()
    return max(((sum(m.out_features for m in ms) * ms[0].in_features,
                 sum(p.numel() for m in ms for p in m.parameters() if p.requires_grad)) for ms in calls
                if all(isinstance(m, SLLinear) and m.values is not None for m in ms)), default=(0, 0))


def layer_grad_numel(model, trainable):
    """Gradient elements of the largest layer, or group of layers sharing a call (model.shared_calls), whose
    gradients appear together: with per-layer updates a layer's gradients are freed after its step."""
    def numel(modules):
        return sum(p.numel() for m in modules for p in m.parameters(recurse=False) if trainable(p))
    return max(numel(modules) for modules in [[m] for m in model.modules()] + model.shared_calls())


def loss_backward_bytes(batch_size, max_length, vocab_size, logit_bytes=BF16):
    """What the loss's backward holds beside every activation: the logits' gradient (bf16, also under autocast;
    float32 in a float32 model) and one float32 chunk (model.CrossEntropySum)."""
    n = batch_size * max_length
    return n * vocab_size * logit_bytes + min(n, loss_chunk_rows(n, vocab_size)) * vocab_size * 4


def at_most(grad, act, start, kept=False):
    """The most of gradients and activations alive at once, beside the parameters and optimizer state. Backward
    starts with every activation saved and adds `start`: the largest of the loss's backward (loss_backward_bytes),
    the first layer's gradient (the head's, the largest layer) and, with activation checkpointing, a recomputed
    block (recomputed_block; it comes later, with less saved, so this bounds it). `start` bounds the forward's end
    too, where under --amp a checkpointed forward also holds autocast's copies of the blocks' weights
    (autocast_copies). Without per-layer updates backward ends with every gradient and few activations left. In
    between, each block frees its activations as its gradients appear, so the larger end bounds it. With per-layer
    updates grad is one layer's and the first term is the larger. kept: the gradients outlive a backward
    (grads_kept), so the next forward saves its activations beside them, and all three add up. The step's other
    temporaries come on top (estimate_memory.py --measure)."""
    return grad + act + start if kept else max(act + start, grad)


def grads_kept(per_layer, accumulation=1, ddp=False, cuda_graph=False):
    """What keeps a run's gradients, every parameter's, after its backward, to be alive beside the next forward's
    activations, in words; None where nothing does. Gradient accumulation (a micro-batch's backward adds into the
    gradients of those before it, also under per-layer updates, which update after the last), DDP (its buckets, which
    hold the gradients, are never freed) and train.py --cuda_graph (the graph's gradients are allocated once, for
    good), but with per-layer updates and no accumulation, where the replayed update frees each layer's as it goes."""
    why = [f"{accumulation} micro-batches an update"] * (accumulation > 1) + ["DDP's buckets"] * ddp + \
        ["--cuda_graph"] * (cuda_graph and not per_layer)
    return " and ".join(why) or None


def adds_up(row):
    """Whether an estimate row's gradients, activations and backward's start add up (at_most's kept): its gradients
    are kept between backwards, and it counts activations."""
    return bool(row["grads_kept"]) and row["batch_size"] > 0


def check_freeze(freeze, method):
    """freeze: None, or "lowrank" (train only SLTrain's sparse values, as train.py --freeze lowrank)."""
    if freeze not in (None, "lowrank") or (freeze and method != "sltrain"):
        raise ValueError(f"freeze must be None, or 'lowrank' with method sltrain; got {freeze!r} with {method}")


def memory_there(device, world=1):
    """(bytes a run may use, the share of them it may fill, words for the message), or None where unknown. On a GPU
    its free memory (other processes' and CUDA's context taken out), of which 95%: the rest is the allocator's. On CPU
    the machine's memory shared by its ranks (torchrun's LOCAL_WORLD_SIZE of the job's `world`), of which 80%: beyond
    it the kernel kills the process with one word, 'Killed'."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free, 0.95, f"the {free / 1e9:.1f} GB free on {device}"
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # a multi-node job's other ranks have their own
        machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / min(world, here)  # ranks share it
        return machine, 0.8, f"this machine's {machine / 1e9:.1f} GB"
    return None


def check_dtype(dtype, amp):
    """The dtype of parameters, gradients and AdamW moments: the given one, else bf16, or float32 under amp."""
    dtype = dtype or ("float32" if amp else "bfloat16")
    if dtype not in DTYPE_BYTES or (amp and dtype != "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32 (float32 under amp), got {dtype!r}")
    return dtype


def support_bytes(model, index_dtype):
    """Bytes of the model's supports: an index of index_dtype per sparse value, or packed, as the model (built with
    packed_support) stores them: a byte per value and a byte per block of 255 entries of each weight."""
    if index_dtype == "packed":
        return sum(m.indices.numel() for m in model.modules() if isinstance(m, SLLinear) and m.indices is not None)
    return INDEX_BYTES[index_dtype] * model.num_params()["sparse"]


def estimate(size, method, rank=None, delta=None, index_dtype="int64", optimizer="adamw", per_layer=False,
             batch_size=0, max_length=256, activation_checkpointing=False, dtype=None, amp=False, vocab_size=None,
             freeze=None, block_size=BLOCK_SIZE, accumulation=1, ddp=False, cuda_graph=False, ffn_dim=None):
    """One row of the memory table: parameter counts (millions) and memory (G) of parameters, optimizer state,
    gradients and activations of one method at one size. dtype and amp as train.py's --dtype and --amp: the paper's
    bf16 by default; float32 parameters, gradients and state (and under amp, activations as bf16 autocast keeps
    them). vocab_size: another tokenizer's (default: T5's 32000); ffn_dim: another MLP width (train.py --ffn_dim).
    freeze="lowrank" as train.py's --freeze: only SLTrain's sparse values have gradients and moments. block_size:
    8-bit Adam's, train.py's --block_size.
    accumulation (micro-batches per update), ddp (more than one process) and cuda_graph (train.py --cuda_graph) say
    whether the gradients are kept between backwards (grads_kept): then they are every parameter's, also with
    per-layer updates, and alive beside the activations."""
    dtype = check_dtype(dtype, amp)
    check_freeze(freeze, method)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if index_dtype not in INDEX_FORMATS:
        raise ValueError(f"index_dtype must be one of {', '.join(INDEX_FORMATS)}, got {index_dtype!r}")
    if optimizer not in ("adamw", "adam8bit"):
        raise ValueError(f"optimizer must be adamw or adam8bit, got {optimizer!r}")
    ours = {"full": "full", "galore": "full", "lowrank": "lowrank", "relora": "lowrank", "sltrain": "sltrain",
            "sltrain_ft": "sltrain_ft"}[method]
    config = config_for(size, method=ours, rank=rank, delta=delta, vocab_size=vocab_size, ffn_dim=ffn_dim)
    rank, delta = config.rank, config.delta if method in SPARSE else 0.0
    model = LLaMA(dataclasses.replace(config, delta=delta, packed_support=index_dtype == "packed"), device="meta")
    if freeze:
        freeze_all_but_values(model)
    n = model.num_params()
    kept = grads_kept(per_layer, accumulation, ddp, cuda_graph)
    row = dict(size=size, method=method, rank=rank, delta=delta, ffn_dim=config.ffn_dim, freeze=freeze,
               optimizer=optimizer, index_dtype=index_dtype, per_layer=per_layer, batch_size=batch_size,
               max_length=max_length, activation_checkpointing=activation_checkpointing, dtype=dtype, amp=amp,
               accumulation=accumulation, ddp=ddp, cuda_graph=cuda_graph, grads_kept=kept,
               params_m=n["total"] / 1e6,
               dense_m=n["dense"] / 1e6, lowrank_m=n["lowrank"] / 1e6, sparse_m=n["sparse"] / 1e6)
    width = DTYPE_BYTES[dtype]  # bytes of a parameter, a gradient and an AdamW moment
    stored = n["total"]
    index_bytes = support_bytes(model, index_dtype)
    param_bytes = width * n["total"] + index_bytes
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    optim_bytes = sum(moment_bytes(k, optimizer, width, block_size) for k in trained)
    state_numel = 2 * sum(trained)
    layer_numel = layer_grad_numel(model, lambda p: p.requires_grad)
    grad_numel = layer_numel if per_layer and not kept else sum(trained)

    held = param_bytes  # what the model as built holds: the paper's count, but for relora
    if method == "relora":  # <-- not ours: frozen full-rank weights + a trainable low-rank model
        full = LLaMA(config_for(size, method="full", vocab_size=vocab_size, ffn_dim=ffn_dim), device="meta")
        stored = full.num_params()["total"] + n["total"]
        param_bytes = width * stored
        # the model as built holds the frozen projections (W0) beside the low-rank model, whose embeddings, norms
        # and head are the only ones: the paper's count (Appendix F) has those twice
        held = width * (full.num_params()["total"] - n["dense"] + n["total"])
        row["params_m"] = full.num_params()["total"] / 1e6  # Table 2's Param column: the merged model

    if method == "sltrain_ft":  # fine-tuning: the pretrained projections kept, frozen, as W0 under the factors
        frozen = sum(b.numel() for name, b in model.named_buffers() if name.endswith("W0"))
        stored = n["total"] + frozen  # W0 in bf16 also under amp (LLaMA's base_dtype)
        param_bytes = width * n["total"] + (BF16 if amp else width) * frozen + index_bytes
        held = param_bytes  # W0 included: train.py's memory check counts it

    if method == "galore":  # <-- not ours: full-rank weights, moments of projected gradients
        weights = [p.shape for name, p in model.named_parameters() if is_projection(name)]
        bound = min(min(shape) for shape in weights)  # the shortest side of a projection
        if not 0 < rank <= bound:
            raise ValueError(f"GaLore's rank must be in [1, {bound}] at {size}, got {rank}")
        dense = [p for name, p in model.named_parameters() if not is_projection(name)]
        projected = [rank * max(shape) for shape in weights]
        projection_numel = sum(rank * min(shape) for shape in weights)
        moments = projected + [p.numel() for p in dense]
        optim_bytes = (sum(moment_bytes(k, optimizer, width, block_size) for k in moments)
                       + width * projection_numel)  # the projection keeps the parameters' dtype, even with 8-bit Adam
        state_numel = 2 * (sum(projected) + sum(p.numel() for p in dense)) + projection_numel
        row["projection_m"] = projection_numel / 1e6

    row.update(stored_m=stored / 1e6, state_m=state_numel / 1e6, param_gb=param_bytes / GB, held_gb=held / GB,
               optim_gb=optim_bytes / GB,
               grad_gb=width * grad_numel / GB, act_gb=0.0, start_gb=width * layer_numel / GB)
    if batch_size:
        shape = (size, "relora" if method == "relora" else ours, rank, delta, batch_size, max_length)  # as trained
        options = dict(dtype=dtype, amp=amp, vocab_size=vocab_size, freeze=freeze, ffn_dim=ffn_dim)
        act = whole = activation_bytes(*shape, **options)
        logit_bytes = BF16 if amp else width
        entries, call_grads = formed_weight(model)
        formed = (BF16 if amp else width) * entries  # in the compute dtype
        # beside the activations as backward starts: the loss's backward, the first layer's gradient (the head's),
        # or an SLTrain call's formed weight and the gradients it returns, with the head's where they are kept
        head = 0 if per_layer and not kept else row["start_gb"] * GB
        adds = [row["start_gb"] * GB, loss_backward_bytes(batch_size, max_length, config.vocab_size, logit_bytes),
                formed and formed + width * call_grads + head]
        row["formed_gb"] = formed / GB
        copies = autocast_copies(model) if amp else 0
        if activation_checkpointing:
            act = activation_bytes(*shape, activation_checkpointing=True, **options)
            adds.append(recomputed_block(whole, act, config.n_layers))
            adds.append(autocast_copies(model.layers) if amp else 0)  # the forward's end (the head's copy is saved)
        row["act_gb"], row["start_gb"] = act / GB, max(adds) / GB
        # train.py --eval_only: the parameters and a forward without gradients, which holds one block's activations at
        # a time (of those saved for backward, less the logits the loss saves and autocast's copies, held all along)
        # and, in an SLTrain call, the weight it forms; then the logits and the loss's float32 chunk (the two that
        # loss_backward_bytes counts)
        logits = batch_size * max_length * config.vocab_size * logit_bytes
        row["eval_gb"] = (held + copies + (whole - logits - copies) / config.n_layers + max(adds[1], formed)) / GB
    row["total_gb"] = row["param_gb"] + row["optim_gb"]  # the paper's total
    row["train_gb"] = row["held_gb"] + row["optim_gb"] + at_most(row["grad_gb"], row["act_gb"], row["start_gb"],
                                                                 adds_up(row))
    paper = (optimizer, index_dtype, dtype, vocab_size, freeze, ffn_dim) == ("adamw", "int64", "bfloat16", *[None] * 3)
    row["footnote"] = slip(size, method, rank, delta) if paper else None
    return row


def printed(row):
    """The paper's three cells as it prints them: param and optim rounded to .01 G, total their sum."""
    param, optim = round(row["param_gb"], 2), round(row["optim_gb"], 2)
    return f"{param:.2f}", f"{optim:.2f}", f"{param + optim:.2f}"


def values_dtype(row):
    """How the row's parameters, gradients and AdamW moments are kept: "bf16", "float32", "float32 (bf16 autocast)"."""
    name = "bf16" if row["dtype"] == "bfloat16" else row["dtype"]
    return name + (" (bf16 autocast)" if row["amp"] else "")


def print_table(rows):
    r0 = rows[0]
    acts, kept = bool(r0["batch_size"]), values_dtype(r0)
    print(textwrap.fill(f"Memory in G (1G = 1e9 bytes): {kept} parameters and gradients, {r0['index_dtype']} indices, "
                        + ("8-bit Adam" if r0["optimizer"] == "adam8bit" else f"AdamW (2 {r0['dtype']} moments)")
                        + (", gradients of one layer (per-layer updates)" if r0["per_layer"] and not r0["grads_kept"]
                           else f", every gradient kept between backwards ({r0['grads_kept']})" if r0["grads_kept"]
                           else "")
                        + (", only the sparse values train (--freeze lowrank)" if r0["freeze"] else "")
                        + (f", activations of {r0['batch_size']} x {r0['max_length']} tokens" if acts else "")
                        + (" (activation checkpointing)" if acts and r0["activation_checkpointing"] else ""), 118))
    print(f"{'size':>5} {'method':<8} {'params':>9}   {'param':>5} + {'optim':>5} = {'total':>5}      "
          f"{'grads':>6} {'acts':>6} {'train':>6}")
    notes = []
    for r in rows:
        param, optim, total = printed(r)
        mark = ""
        if r["footnote"]:
            notes.append(r["footnote"])
            mark = f"[{len(notes)}]"
        grads, act = round(r["grad_gb"], 2), round(r["act_gb"], 2)
        held = round(r["held_gb"], 2) + round(r["optim_gb"], 2)  # the total, but for relora (its model as built)
        train = held + at_most(grads, act, round(r["start_gb"], 2), adds_up(r))  # added as printed, as the paper
        act_cell = f"{act:6.2f}" if acts else "     -"
        print(f"{r['size']:>5} {r['method']:<8} {r['params_m']:8.2f}M   {param:>5} + {optim:>5} = {total:>5}{mark:<4} "
              f"  {grads:6.2f} {act_cell} {train:6.2f}")
    print("total = param + optim, the paper's Mem column; train adds the most gradients and activations alive at\n"
          "once: grads, or with --batch_size the larger of grads and acts + backward's start (the largest layer's\n"
          "gradient, or the loss's backward if more); their sum where the gradients are kept between backwards")
    if any(r["held_gb"] != r["param_gb"] for r in rows):
        print("relora's train counts its model as built: the frozen W0 beside the low-rank model, whose embeddings,\n"
              "norms and head param counts a second time, as the paper does")
    for i, note in enumerate(notes, 1):
        print(textwrap.fill(note, 118, initial_indent=f"[{i}] ", subsequent_indent="    "))


def print_breakdown(r):
    """Appendix F's paragraph for one row, with the parts the paper leaves out."""
    m, kept = r["method"], values_dtype(r)
    print(f"{r['size']} {m}: r={r['rank']}" + (f", delta={r['delta']}" if m in SPARSE else "")
          + ("" if r["ffn_dim"] == config_for(r["size"]).ffn_dim else f", ffn_dim={r['ffn_dim']}")
          + ("" if kept == "bf16" else f", {kept}")
          + (", 8-bit Adam" if r["optimizer"] == "adam8bit" else ", AdamW")
          + (", per-layer updates" if r["per_layer"] else "")
          + (", only the sparse values train (--freeze lowrank)" if r["freeze"] else "")
          + (f", batch {r['batch_size']} x {r['max_length']} tokens" if r["batch_size"] else "")
          + (", activation checkpointing" if r["batch_size"] and r["activation_checkpointing"] else ""))

    def line(name, value, unit, why):
        print(textwrap.fill(why, 118, initial_indent=f"  {name:<12} {value:8.2f}{unit}  ", subsequent_indent=" " * 26))

    parts = f"= {r['dense_m']:.2f}M dense + {r['lowrank_m']:.2f}M low-rank + {r['sparse_m']:.2f}M sparse"
    line("parameters", r["params_m"], "M", "(full-rank)" if m in ("relora", "galore") else parts)
    if m == "relora":
        line("stored", r["stored_m"], "M", f"= {r['params_m']:.2f}M full-rank + {r['stored_m'] - r['params_m']:.2f}M "
             "low-rank model")
    if m == "sltrain_ft":
        line("stored", r["stored_m"], "M", f"= {r['params_m']:.2f}M parameters + {r['stored_m'] - r['params_m']:.2f}M "
             "frozen W0; only the low-rank and sparse ones train")
    sparse = f" + {r['sparse_m']:.2f}M {r['index_dtype']} indices" if r["sparse_m"] else ""
    frozen = " (W0 in bf16)" if m == "sltrain_ft" and r["amp"] else ""
    line("param", r["param_gb"], "G", f"{r['stored_m']:.2f}M {r['dtype']} values{frozen}{sparse}")
    state = r["dtype"] if r["optimizer"] == "adamw" else \
        "8-bit, + a float32 absmax per 256, float32 under 4096 elements"
    if m == "galore":
        line("optim", r["optim_gb"], "G", f"{r['state_m'] - r['projection_m']:.2f}M moments of projected gradients "
             f"and dense parameters ({state}) + {r['projection_m']:.2f}M projection ({r['dtype']})")
    else:
        line("optim", r["optim_gb"], "G", f"{r['state_m']:.2f}M moments, {state}")
    which = "every parameter's" if m == "galore" else "every trained parameter's"
    if r["per_layer"] and not r["grads_kept"]:
        which = "the largest layer (or projections sharing a call) only (per-layer updates)"
    if r["grads_kept"]:
        which += f", kept between backwards ({r['grads_kept']})"
    line("grads", r["grad_gb"], "G", f"{r['dtype']}, {which}")
    if r["batch_size"]:
        line("activations", r["act_gb"], "G", f"saved for backward by one {kept} forward, counted on fake tensors"
             + ("; a block saves only its input" if r["activation_checkpointing"] else ""))
    total = float(printed(r)[2])  # added as printed, like the paper's total
    line("total", total, "G", "param + optim, the paper's convention" + (" (see the note)" if r["footnote"] else ""))
    if r["held_gb"] != r["param_gb"]:
        line("held", r["held_gb"], "G", "the parameters and W0 as our model holds them: the embeddings, norms and "
             "head once, where the paper's param has them twice; train counts these")
    held = round(r["held_gb"], 2) + round(r["optim_gb"], 2)  # the total, but for relora (its model as built)
    train = held + at_most(round(r["grad_gb"], 2), round(r["act_gb"], 2), round(r["start_gb"], 2), adds_up(r))
    start = "the largest layer's gradient, the loss's backward" + (", a recomputed block"
                                                                   if r["activation_checkpointing"] else "") \
        + (", an SLTrain call's formed weight" if r.get("formed_gb") else "") \
        + (", the forward's autocast copies" if r["activation_checkpointing"] and r["amp"] else "")
    base = "held + optim" if r["held_gb"] != r["param_gb"] else "total"
    line("train", train, "G", f"{base} + " + ("grads + activations + backward's start (the gradients kept: the "
                                              f"most of {start}: at_most)" if adds_up(r) else
                                              f"the larger of grads and activations + backward's start (the most of "
                                              f"{start}: at_most)" if r["batch_size"] else "grads")
         + "; the step's temporaries come on top")
    if r["footnote"]:
        print(textwrap.fill(r["footnote"], 118, initial_indent="  note: ", subsequent_indent="        "))


# ----------------------------------------------------------------------------- measured

def fmt_bytes(b):
    return f"{b / GB:.2f}G" if b >= GB else f"{b / 1e6:.1f}M"


STEPS_RANGE = "estimate_memory.measure: the training steps"  # the profiler's name for the measured window


def cpu_peak(prof):
    """The most bytes of CPU memory allocated at once during STEPS_RANGE by what ran since the profiler started (see
    peak_of_events). Read from the profiler's exported trace, its public form; not from the events' running total,
    which carries over between profilers."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return peak_of_events(json.load(f)["traceEvents"])


def peak_of_events(events):
    """The profiler's CPU memory events, one per allocation and free, added up in time order: their most inside
    STEPS_RANGE. A free of memory allocated before the profiler started is not counted, so start it before anything
    the window frees is made. The profiler sees only the threads that run torch's ops (ours and autograd's), not a
    process group's workers: a block whose last reference such a thread drops is freed unseen. Where the allocator
    hands its address out again, the block was freed before: it is dropped then, not counted twice."""
    window = next(e for e in events if e.get("name") == STEPS_RANGE and e.get("ph") == "X")
    start, end = window["ts"], window["ts"] + window["dur"]
    alive, total, peak = {}, 0, 0
    for e in sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: e["ts"]):
        address, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        total -= alive.pop(address, 0)  # a free; or, before an allocation, a block freed out of sight
        if nbytes > 0:
            alive[address] = nbytes
            total += nbytes
        if start <= e["ts"] <= end:
            peak = max(peak, total)
    return peak


def measure(size, method, rank, delta, optimizer, per_layer, batch_size, max_length, steps, device,
            activation_checkpointing=False, dtype=None, amp=False, freeze=None, accumulation=1, ddp=False,
            packed=False, ffn_dim=None):
    """A few real training steps of our model, in dtype as estimate's (the paper's bf16 by default; float32 under
    amp, with bf16 autocast; freeze as estimate's), each of `accumulation` micro-batches; ddp: the model under
    DistributedDataParallel as train.py's, in a process group of one made here where there is none. Returns the
    bytes of
    parameters, gradients (the most alive at once), optimizer state and saved activations (the most of one forward),
    counted; the real peak of the steps (CUDA: the allocator's max_memory_allocated; CPU: cpu_peak, from the
    profiler's memory events); "base", what the process held before the model was built, which the peak includes;
    and how the model stores its supports ("int32", "int64", or "packed": packed=True builds it so). ffn_dim: another
    MLP width, as estimate's.

    On CUDA the base is chiefly the BLAS libraries' workspaces: cuBLAS and cuBLASLt each take one per thread and
    stream (32 MiB on Hopper, through the caching allocator), and backward runs on a thread of its own, so a first
    step would allocate up to four inside its peak. One tiny step of the same kind allocates them before the base
    is read. On CPU the base is 0: the profiler counts from its start."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--measure runs on cpu or cuda, not {device.type}")
    dtype = check_dtype(dtype, amp)
    check_freeze(freeze, method)
    base = 0
    if device.type == "cuda":
        _measure("tiny", method, None, None, optimizer, per_layer, 1, 8, 1, device, activation_checkpointing, dtype,
                 amp, freeze)
        gc.collect()
        base = torch.cuda.memory_allocated(device)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) \
        if device.type == "cpu" else contextlib.nullcontext()
    group = ddp and not torch.distributed.is_initialized()
    if group:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                             store=torch.distributed.HashStore())  # in this process: it is alone
    try:
        with profiler:  # from before the model exists, so that every byte the steps free was seen being allocated
            counted, index_dtype = _measure(size, method, rank, delta, optimizer, per_layer, batch_size, max_length,
                                            steps, device, activation_checkpointing, dtype, amp, freeze, accumulation,
                                            ddp, packed, ffn_dim)
    finally:
        if group:
            torch.distributed.destroy_process_group()
    if device.type == "cpu":
        counted["peak"] = cpu_peak(profiler)
    counted["base"] = base
    return counted, index_dtype


def _measure(size, method, rank, delta, optimizer, per_layer, batch_size, max_length, steps, device,
             activation_checkpointing, dtype, amp, freeze, accumulation=1, ddp=False, packed=False, ffn_dim=None):
    torch.manual_seed(0)
    config = config_for(size, method="full" if method == "galore" else method, rank=rank, delta=delta,
                        packed_support=packed, ffn_dim=ffn_dim)
    model = raw = LLaMA(config, device=device, dtype=getattr(torch, dtype),  # built as train.py builds it
                        base_dtype=torch.bfloat16 if amp else None)
    model.autocast = torch.bfloat16 if amp else None
    if freeze:
        freeze_all_but_values(model)
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    # AdamW as train.py makes it: its multi-tensor calls take optim.FOREACH_BYTES of tensors each (or one larger
    # one), so the step's temporary is that small, not a copy of every moment
    make = (lambda ps: optim.Adam8bit(ps, **hyper)) if optimizer == "adam8bit" else \
        (lambda ps: optim.AdamW(ps, **hyper))
    if method == "galore":  # full-rank weights, the projections' moments in the projected space
        names = {p: name for name, p in model.named_parameters()}
        make = lambda ps: galore.GaLore(galore.galore_param_groups(  # noqa: E731
            [(names[p], p) for p in ps], config.rank, lambda name, p: is_projection(name)), **hyper, inner=optimizer)
    peak = dict(grads=0, acts=0)

    weak = [weakref.ref(p) for p in params]  # not params: hooks are held in C++, where Python's garbage collector
    # cannot see a cycle through them (parameter -> hook -> params -> parameter), which would keep the model forever

    # layers sharing a call (model.shared_calls) get their gradients at once: while one is accumulated, the others
    # wait in autograd's engine, alive but not yet anyone's .grad, and are counted as such (by id: a parameter held
    # here would keep the model alive, as above)
    groups = [{id(p): p.numel() * p.element_size() for m in modules for p in m.parameters(recurse=False)
               if p.requires_grad} for modules in model.shared_calls()]
    group_of = {key: group for group in groups for key in group}
    waiting = {}  # id of a group -> ids of its parameters whose gradient of this backward is not accumulated yet

    def track_grads(p):  # registered before the per-layer hooks, so it runs while this gradient is still alive
        alive = [q for q in (ref() for ref in weak) if q is not None and q.grad is not None]
        pending = 0
        if id(p) in group_of:
            group = group_of[id(p)]
            rest = waiting.get(id(group)) or set(group)  # the group's first gradient: all of them are made
            rest.discard(id(p))
            waiting[id(group)] = rest
            pending = sum(group[key] for key in rest)
        peak["grads"] = max(peak["grads"], sum(q.grad.nbytes for q in alive) + pending)

    for p in params:
        p.register_post_accumulate_grad_hook(track_grads)
    if ddp:  # as train.py's (its buckets hold the gradients), in the caller's process group
        with warnings.catch_warnings():  # newer torch deprecates broadcast_buffers (train.py says why it stays)
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            # init_sync=False: no broadcast of the weights, which need not be equal across ranks to be measured,
            # and whose flat copy gloo's worker thread frees at times, out of the profiler's sight (peak_of_events)
            model = torch.nn.parallel.DistributedDataParallel(raw, broadcast_buffers=False,
                                                              gradient_as_bucket_view=True, init_sync=False)
    per = attach_per_layer(model, make) if per_layer else None
    opt = None if per_layer else make(params)
    whole = None
    if activation_checkpointing:  # one forward without, before the steps: what a block saves when recomputed
        idx = torch.randint(config.vocab_size, (batch_size, max_length + 1), device=device)
        with SavedTensors(raw) as saved:
            model(idx[:, :-1], idx[:, 1:].contiguous())
        whole = saved.nbytes
        del idx, saved
        raw.activation_checkpointing = True
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.profiler.record_function(STEPS_RANGE):
        for _ in range(steps):
            for micro in range(accumulation):  # the micro-batches of an update, as train.py's
                idx = torch.randint(config.vocab_size, (batch_size, max_length + 1), device=device)
                with SavedTensors(raw) as saved:
                    loss = model(idx[:, :-1], idx[:, 1:].contiguous())[1]
                peak["acts"] = max(peak["acts"], saved.nbytes)
                last = micro == accumulation - 1
                with contextlib.nullcontext() if last or per is None else per.accumulating():
                    loss.backward()  # with per-layer updates each parameter steps here and drops its gradient
                del idx, loss
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    optimizers = [opt] if opt is not None else per.optimizers.values()
    state = [t for o in optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    if ddp:  # its buckets: every gradient, for good (per-layer updates free only the views of them)
        peak["grads"] = max(peak["grads"], sum(p.nbytes for p in params))
    counted = dict(param=sum(t.nbytes for t in [*raw.parameters(), *raw.buffers()]),
                   optim=sum(t.nbytes for t in state),
                   grad=peak["grads"], act=peak["acts"])
    layer_grad = layer_grad_numel(raw, lambda p: p.requires_grad) * params[0].element_size()
    logit_bytes = BF16 if amp else params[0].element_size()
    start = max(layer_grad, loss_backward_bytes(batch_size, max_length, config.vocab_size, logit_bytes),
                0 if whole is None else recomputed_block(whole, peak["acts"], config.n_layers),
                autocast_copies(raw.layers) if amp and whole is not None else 0)
    kept = grads_kept(per_layer, accumulation, ddp)
    counted["train"] = counted["param"] + counted["optim"] + at_most(counted["grad"], counted["act"], start, kept)
    if device.type == "cuda":
        counted["peak"] = torch.cuda.max_memory_allocated(device)
    index_dtype = next(("packed" if m.packed else str(m.indices.dtype).removeprefix("torch.") for m in raw.modules()
                        if isinstance(m, SLLinear) and m.indices is not None), "int64")  # int32 below 2³¹ entries
    return counted, index_dtype


def print_measured(results, device, args):
    peak_name = "CUDA max_memory_allocated" if device.type == "cuda" else "CPU peak (profiler)"
    kept = values_dtype(dict(dtype=args.dtype, amp=args.amp))
    print(f"measured on {device}: {args.size}, {kept}, batch {args.batch_size} x {args.max_length}, "
          f"{args.steps} steps"
          f"{f' of {args.gradient_accumulation} micro-batches' if args.gradient_accumulation > 1 else ''}"
          f"{', DDP (a process group of one)' if args.ddp else ''}, {args.optimizer}"
          f"{', per-layer' if args.per_layer else ''}"
          f"{', activation checkpointing' if args.activation_checkpointing else ''} -- estimate / counted; {peak_name}")
    print(f"{'method':<8} " + " ".join(f"{k:^17}" for k in ("param", "optim", "grads", "acts", "train"))
          + "    peak    base  (peak-base)/est")
    for method, (est, counted) in results.items():
        pairs = (("held", "param"), ("optim", "optim"), ("grad", "grad"), ("act", "act"), ("train", "train"))
        cells = [f"{fmt_bytes(est[e + '_gb'] * GB):>8}/{fmt_bytes(counted[k]):<8}" for e, k in pairs]  # param: held
        own = (counted["peak"] - counted["base"]) / (est["train_gb"] * GB)
        print(f"{method:<8} " + " ".join(cells) + f"{fmt_bytes(counted['peak']):>8}{fmt_bytes(counted['base']):>8}"
              f"{own:10.3f}")
    print("counted: bytes of parameters and buffers, optimizer state, the most gradient bytes alive at once and the\n"
          "saved activations of one forward; train = param + optim + at_most(grads, acts, backward's start: the\n"
          "largest layer's gradient, the loss's backward, a recomputed block or an SLTrain call's formed weight); the\n"
          "peak is what was alive at the step's worst moment, base what the process held before the model (on CUDA\n"
          "the BLAS workspaces)")


# ----------------------------------------------------------------------------- command line

def estimate_for(args, size, method, index_dtype):
    """estimate() of one size and method at the command line's settings."""
    return estimate(size, method, args.rank, args.delta, index_dtype, args.optimizer, args.per_layer, args.batch_size,
                    args.max_length, args.activation_checkpointing, args.dtype, args.amp, freeze=args.freeze,
                    accumulation=args.gradient_accumulation, ddp=args.ddp, cuda_graph=args.cuda_graph,
                    ffn_dim=args.ffn_dim)


def measured_format(args):
    """How the model --measure builds stores its supports: int32 (below 2³¹ entries), or packed if asked."""
    return "packed" if args.index_dtype == "packed" else "int32"


def refuse_what_would_not_fit(parser, args, methods, device):
    """--measure builds and trains the model for real: one that would not fit is refused now, in one line, not
    killed part way (on CPU the kernel's out-of-memory killer, which may take other processes with it). What each
    needs is its estimated step, which holds its build: the model in its dtype and a block in float32 at a time
    (model.LLaMA), where it held the whole float32 model first (at 7b 27 GB for full rank and SLTrain-FT)."""
    there = memory_there(device)
    if there is None:
        return
    available, share, where = there
    for method in methods:
        need = estimate_for(args, args.size, method, measured_format(args))["train_gb"] * GB
        if need > share * available:
            parser.error(f"--measure {method} at {args.size} needs about {need / GB:.1f} GB by the estimate, more "
                         f"than {share:.0%} of {where}: pass a smaller --size, --batch_size or --max_length (the "
                         "estimate alone, without --measure, needs no memory)")


def check_args(parser, args):
    """Every flag honored or refused, in one line that names the fix; then the defaults that depend on --measure."""
    if ((args.batch_size is not None and args.batch_size < (1 if args.measure else 0))
            or (args.max_length is not None and args.max_length < 1) or (args.steps is not None and args.steps < 1)):
        parser.error("--batch_size must be >= 0 (>= 1 with --measure, which runs training steps), --max_length and "
                     "--steps >= 1")
    if args.max_length is not None and (refusal := length_refusal(args.max_length)):
        parser.error(refusal)
    if args.ffn_dim is not None and (args.size == "all" or args.ffn_dim < 1):
        parser.error("--ffn_dim is one size's MLP width, at least 1: pass it with a --size" if args.size == "all"
                     else f"--ffn_dim must be at least 1, got {args.ffn_dim}")
    if not args.measure and (args.steps is not None or args.device is not None):
        parser.error("--steps and --device say how --measure runs: add --measure or drop them")
    if args.measure and args.index_dtype not in (None, "packed"):
        parser.error(f"--measure counts the indices the model stores (int32 below 2^31 entries, or packed with "
                     f"--index_dtype packed): drop --index_dtype {args.index_dtype}")
    for flag, given in (("--activation_checkpointing", args.activation_checkpointing),
                        ("--max_length", args.max_length is not None)):
        if given and not (args.batch_size or args.measure):
            parser.error(f"{flag} changes the activations, which --batch_size 0 (the default) leaves out: pass "
                         "--batch_size")
    if args.gradient_accumulation < 1:
        parser.error("--gradient_accumulation must be >= 1")
    if args.measure and args.cuda_graph:
        parser.error("--measure runs its steps without CUDA graphs: drop --cuda_graph (the estimate alone counts it)")
    if args.measure and args.per_layer and args.steps == 1:  # its peak came out 8% to 23% under the estimate
        parser.error("--measure --per_layer --steps 1: per-layer updates make the optimizer's state during the first "
                     "backward, so one step never holds it all at once; pass --steps 2 or more")
    if args.amp and args.dtype == "bfloat16":
        parser.error("--amp keeps float32 parameters and computes in bf16 under autocast: drop --dtype bfloat16")
    args.dtype = args.dtype or ("float32" if args.amp else "bfloat16")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device_from_flag(parser.error, args.device, "cpu, cuda or cuda:N, where --measure runs")
    check_model_flags(parser, args)
    args.index_dtype, args.steps = args.index_dtype or "int64", args.steps or 3
    args.batch_size = (2 if args.measure else 0) if args.batch_size is None else args.batch_size
    args.max_length = args.max_length or 256


def check_model_flags(parser, args):
    """--rank and --delta: refused for methods without factors or a sparse part, checked against every layer shape
    of the sizes that will run (a rank past a layer's side, a delta outside [0, 1))."""
    methods = ALL_METHODS if args.method == "all" else (args.method,)
    if args.rank is not None and methods == ("full",):
        parser.error("--rank is the rank of the factors, which --method full has none of: drop it, or pass "
                     "--method lowrank, relora, galore or sltrain")
    if args.freeze and methods != ("sltrain",):
        parser.error("--freeze lowrank trains only SLTrain's sparse values: pass --method sltrain")
    for flag, given in (("--delta", args.delta is not None), ("--index_dtype", args.index_dtype is not None)):
        if given and not set(SPARSE) & {*methods}:
            parser.error(f"{flag} is of SLTrain's sparse part, which --method {args.method} has none of: drop it, or "
                         "pass --method sltrain")
    if args.freeze and args.delta == 0:
        parser.error("--freeze lowrank trains only the sparse values, which --delta 0 removes: pass a --delta above "
                     "0, or drop --freeze")
    if args.index_dtype is not None and args.delta == 0:  # as train.py refuses --packed_support there
        parser.error(f"--index_dtype is of the sparse supports, which --delta 0 removes: pass a --delta above 0, or "
                     f"drop --index_dtype {args.index_dtype}")
    sizes = ("tiny",) if args.measure and args.size == "all" else PAPER_SIZES if args.size == "all" else (args.size,)
    # the models the estimate builds: sltrain's and sltrain_ft's, a low-rank one for lowrank and relora; galore's
    # rank is its own
    checked = [m for m in methods if m in SPARSE] + ["lowrank"] * bool({"lowrank", "relora"} & {*methods})
    for size in sizes if {args.rank, args.delta, args.ffn_dim} != {None} else ():
        try:
            for method in checked:
                LLaMA(config_for(size, method=method, rank=args.rank, delta=args.delta, ffn_dim=args.ffn_dim),
                      device="meta")
            if "galore" in methods:
                estimate(size, "galore", args.rank, ffn_dim=args.ffn_dim)
        except ValueError as e:
            parser.error(f"--size {size}: {e}")


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--size", default="all", choices=["all", *SIZES],
                        help="model size; all = the paper's 60m..7b (--measure defaults to tiny)")
    parser.add_argument("--method", default="all", choices=["all", *METHODS],
                        help="training method (all: the paper's table; sltrain_ft, fine-tuning, only when named)")
    parser.add_argument("--rank", type=int, default=None, help="r of the low-rank factors (default: the size's)")
    parser.add_argument("--delta", type=float, default=None, help="sltrain's sparse fraction (default: the size's)")
    parser.add_argument("--ffn_dim", type=int, default=None,
                        help="width of each MLP's hidden layer, as train.py --ffn_dim (default: the size's)")
    parser.add_argument("--index_dtype", default=None, choices=list(INDEX_FORMATS),
                        help="bytes per sparse index: the paper counts int64 (the default); sllinear.py stores int32, "
                             "which --measure counts, or packed, about 1.1 bytes an index (train.py --packed_support)")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam8bit"],
                        help="adamw: 2 bf16 moments; adam8bit: 8-bit moments, ~2.03 bytes per parameter")
    parser.add_argument("--per_layer", action="store_true",
                        help="per-layer updates: only one layer's gradients are alive at a time")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="sequences per step for the activation estimate; 0 leaves activations out "
                             "(--measure: default 2)")
    parser.add_argument("--max_length", type=int, default=None,
                        help="tokens per sequence, with --batch_size (default: the paper's 256)")
    parser.add_argument("--activation_checkpointing", action="store_true",
                        help="activations as train.py --activation_checkpointing keeps them: each block's input, "
                             "one block recomputed")
    parser.add_argument("--dtype", default=None, choices=list(DTYPE_BYTES),
                        help="of parameters, gradients and AdamW moments, as train.py --dtype (default: the paper's "
                             "bfloat16; float32 with --amp)")
    parser.add_argument("--amp", action="store_true",
                        help="as train.py --amp: float32 parameters and state, activations as bf16 autocast keeps them")
    parser.add_argument("--freeze", choices=["lowrank"],
                        help="as train.py --freeze lowrank (--method sltrain): only the sparse values V train")
    parser.add_argument("--gradient_accumulation", type=int, default=1,
                        help="micro-batches per update, as train.py's: from 2 on the gradients are kept between "
                             "backwards, every parameter's also with --per_layer, beside the activations (default 1)")
    parser.add_argument("--ddp", action="store_true",
                        help="under torchrun with more than one process: DDP's buckets keep every gradient, also with "
                             "--per_layer (--measure: DDP in a process group of one)")
    parser.add_argument("--cuda_graph", action="store_true",
                        help="as train.py --cuda_graph: its gradients are allocated for good (but with --per_layer "
                             "and one micro-batch an update); not with --measure")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--measure", action="store_true",
                        help="run a few training steps of each method; print measured beside estimated")
    parser.add_argument("--steps", type=int, default=None, help="--measure: training steps (default 3)")
    parser.add_argument("--device", default=None, help="--measure: cpu or cuda (default: cuda if present)")
    args = parser.parse_args()
    check_args(parser, args)

    if args.measure:
        if args.size == "all":
            args.size = "tiny"
        methods = ALL_METHODS if args.method == "all" else (args.method,)
        device = torch.device(args.device)
        refuse_what_would_not_fit(parser, args, methods, device)
        results = {}
        for method in methods:
            counted, index_dtype = measure(args.size, method, args.rank, args.delta, args.optimizer, args.per_layer,
                                           args.batch_size, args.max_length, args.steps, device,
                                           args.activation_checkpointing, args.dtype, args.amp, args.freeze,
                                           args.gradient_accumulation, args.ddp, measured_format(args) == "packed",
                                           args.ffn_dim)
            est = estimate_for(args, args.size, method, index_dtype)
            results[method] = (est, counted)
        if args.json:
            print(json.dumps([dict(est, measured=counted, device=str(device), steps=args.steps)
                              for est, counted in results.values()], indent=1))
        else:
            print_measured(results, device, args)
        return

    sizes = PAPER_SIZES if args.size == "all" else (args.size,)
    methods = ALL_METHODS if args.method == "all" else (args.method,)
    rows = [estimate_for(args, size, method, args.index_dtype) for size in sizes for method in methods]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif len(rows) == 1:
        print_breakdown(rows[0])
    else:
        print_table(rows)


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a reader that stops (| head) ends the table, not a traceback
    main()
