"""
Pretrain a LLaMA on C4 with SLTrain (W = s·BA + S), low-rank, or full-rank weights, on one device or many.

    python train.py --size 60m                                      # one device: CUDA if present, else CPU
    torchrun --standalone --nproc_per_node=8 train.py --size 1b     # DDP (NCCL on GPUs, gloo on CPU)
    python train.py --size 60m --optimizer adam8bit --per_layer     # the paper's memory-frugal setting
    python train.py --size 60m --resume                             # continue exactly from out/ckpt.pt
    python train.py --size 60m --method full --optimizer galore_adamw   # the baselines: GaLore, and ReLoRA
    python train.py --size 60m --method relora

Defaults are the paper's recipe for each size (§4.1 and the authors' scripts); every flag has a help line.
The authors' flag names (--model_config, --peft_model, --sp_ratio, --lora_alpha, ...) are accepted too.
"""

import argparse
import gc
import json
import math
import os
import re
import resource
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import TrainLoader, download, find_shards, load_tokenizer, shard_names, validation_batches
from model import LLaMA, SIZES, config_for, describe, is_projection, relora_merge
from optim import AdamW, Adam8bit, GaLore, attach_per_layer, galore_param_groups, prune_state_

# size -> (training steps, peak lr, micro-batch per device on a GPU): §4.1 and the authors' scripts
RECIPES = {"tiny": (1000, 3e-3, 16), "60m": (11_000, 3e-3, 128), "130m": (22_000, 3e-3, 128),
           "350m": (65_000, 3e-3, 64), "1b": (140_000, 3e-3, 32), "7b": (150_000, 5e-4, 8)}
MODEL_FIELDS = ("method", "rank", "alpha", "delta")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--size", default="60m", choices=list(SIZES), help="model size (the paper's LLaMA configs)")
    a("--method", "--peft_model", choices=["full", "lowrank", "relora", "sltrain"], default="sltrain",
      help="weights: dense, W = s·BA, W = W0 + s·BA with W0 frozen and merged into (ReLoRA), or W = s·BA + S")
    a("--rank", type=int, help="rank r of the factors (default: the paper's for the size)")
    a("--delta", "--sp_ratio", type=float, help="sparsity: fraction of entries in S (default 0.03; 7b 0.05)")
    a("--alpha", "--lora_alpha", type=float, help="low-rank scale s = alpha/r (default: the paper's for the size)")
    a("--optimizer", default="adamw", choices=["adamw", "adam8bit", "adamw_per_layer", "adam8bit_per_layer",
                                                "galore_adamw", "galore_adam8bit", "galore_adamw_per_layer",
                                                "galore_adam8bit_per_layer"],
      help="optimizer (written from scratch in optim.py); *_per_layer is --per_layer; galore_* needs --method full")
    a("--per_layer", action="store_true", help="update each parameter inside backward and free its gradient")
    a("--grad_clipping", type=float, default=0.0, help="clip the global gradient norm to this (0: off)")
    a("--activation_checkpointing", action="store_true", help="recompute each block in backward")
    a("--dtype", choices=["float32", "bfloat16"], help="parameter dtype (default bfloat16 on GPU, float32 on CPU)")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    a("--lr", type=float, help="peak learning rate (default 3e-3; 7b 5e-4)")
    a("--batch_size", type=int, help="sequences per device per micro-batch")
    a("--total_batch_size", type=int, default=512, help="sequences per update, over all devices and micro-batches")
    a("--gradient_accumulation", type=int, help="micro-batches per update (default: derived)")
    a("--max_length", type=int, default=256, help="tokens per sequence")
    a("--num_training_steps", type=int, help="optimizer updates (default: the paper's for the size)")
    a("--warmup_steps", type=int, help="linear warmup updates (default: 10%% of the steps)")
    a("--min_lr_ratio", type=float, default=0.1, help="the cosine schedule ends at this fraction of --lr")
    a("--scheduler", default="cosine", choices=["cosine"], help="learning-rate schedule (warmup, then cosine)")
    a("--weight_decay", type=float, default=0.0, help="decoupled weight decay")
    a("--beta1", type=float, default=0.9, help="Adam beta1")
    a("--beta2", type=float, default=0.999, help="Adam beta2")
    a("--eval_every", type=int, default=1000, help="evaluate validation perplexity every this many updates")
    a("--eval_tokens", type=int, default=10_000_000, help="validation tokens (the first N of the validation shards)")
    a("--save_every", type=int, default=1000, help="write a checkpoint every this many updates")
    a("--out_dir", "--save_dir", default="out", help="checkpoint and metrics.jsonl folder")
    a("--resume", "--continue_from", nargs="?", const="auto", help="continue from a checkpoint (default out_dir/ckpt.pt)")
    a("--stop_after", type=int, help="end this run after this many updates, with a checkpoint (job time limits)")
    a("--data_dir", default="data/c4", help="folder of C4 shards (c4-train.*.json.gz, c4-validation.*.json.gz)")
    a("--tokenizer", default="data/t5_spiece.model", help="sentencepiece model (T5's: 32000 pieces)")
    a("--download", action="store_true", help="fetch missing C4 shards and the T5 tokenizer first")
    a("--pack", action="store_true", help="pack documents into full windows (default: the paper's padding)")
    a("--workers", type=int, default=1, help="data loader worker processes")
    a("--log_every", type=int, default=10, help="print and record a log line every this many updates")
    a("--seed", type=int, default=42, help="seed for initialization, support and data order")
    a("--model_config", help="the authors' configs/llama_<size>.json; sets --size")
    a("--galore_rank", type=int, help="GaLore: rank of the gradient projection (default: --rank, the size's)")
    a("--galore_update_gap", type=int, default=200, help="GaLore: recompute each projection every this many updates")
    a("--galore_scale", type=float, default=0.25, help="GaLore: scale of the update projected back")
    a("--relora_reset", type=int, default=2000, help="ReLoRA: merge BA into W0 and restart every this many updates")
    a("--relora_warmup", type=int, default=50, help="ReLoRA: updates of linear lr warmup after each restart")
    a("--relora_prune", type=float, default=0.99,
      help="ReLoRA: fraction of the restarted factors' Adam moments zeroed, smallest magnitudes first")
    args = p.parse_args(argv)

    # ---- resolve defaults and refuse what cannot work, before any expensive step
    if args.model_config:
        m = re.search(r"llama_(\w+)\.json$", args.model_config)
        if not m or m.group(1) not in SIZES:
            p.error(f"--model_config {args.model_config}: expected configs/llama_<size>.json with size in {list(SIZES)}")
        args.size = m.group(1)
    if args.optimizer.endswith("_per_layer"):
        args.optimizer, args.per_layer = args.optimizer[: -len("_per_layer")], True
    steps, lr, micro = RECIPES[args.size]
    args.num_training_steps = args.num_training_steps or steps
    galore = args.optimizer.startswith("galore")
    args.lr = args.lr or (1e-2 if galore else lr)  # GaLore's paper trains with lr 0.01
    args.warmup_steps = int(0.1 * args.num_training_steps) if args.warmup_steps is None else args.warmup_steps
    if args.per_layer and args.grad_clipping > 0:
        p.error("--per_layer updates each parameter during backward, before the global gradient norm exists: "
                "drop --grad_clipping or drop --per_layer")
    for name in ("num_training_steps", "eval_every", "save_every", "log_every", "max_length", "total_batch_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if not 0 <= args.warmup_steps <= args.num_training_steps:
        p.error(f"--warmup_steps must be in [0, {args.num_training_steps}], got {args.warmup_steps}")
    try:
        model_config = config_for(args.size, method=args.method, rank=args.rank, alpha=args.alpha, delta=args.delta)
        LLaMA(model_config, device="meta")  # checks rank and delta against every layer shape, for free
    except ValueError as e:
        p.error(str(e))
    args.rank, args.alpha, args.delta = model_config.rank, model_config.alpha, model_config.delta
    args.galore_rank = args.galore_rank or args.rank
    if galore and args.method != "full":
        p.error(f"--optimizer {args.optimizer} projects the gradients of full-rank weights: pass --method full")
    if galore and not 0 < args.galore_rank <= min(model_config.dim, model_config.ffn_dim):
        p.error(f"--galore_rank must be in [1, {min(model_config.dim, model_config.ffn_dim)}], got {args.galore_rank}")
    if args.galore_update_gap <= 0 or args.relora_reset <= 0 or args.relora_warmup < 0:
        p.error("--galore_update_gap and --relora_reset must be positive, --relora_warmup >= 0")
    if not 0 <= args.relora_prune <= 1:
        p.error(f"--relora_prune must be in [0, 1], got {args.relora_prune}")
    return args, micro


def lr_lambda_for(args):
    """Linear warmup to the peak, then cosine down to min_lr_ratio of it (the authors' schedule); for ReLoRA the same
    cosine, cut into jags by a short warmup after every restart (ReLoRA's jagged schedule)."""
    warmup, total, floor = args.warmup_steps, args.num_training_steps, args.min_lr_ratio

    def lr_lambda(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def jagged(step):  # ReLoRA: the cosine, with a linear warmup from 0 again after every restart
        since = step % args.relora_reset
        if step >= args.relora_reset and since < args.relora_warmup:
            return lr_lambda(step) * since / args.relora_warmup
        return lr_lambda(step)
    return jagged if args.method == "relora" else lr_lambda


def galore_maker(args, model):
    """make_optimizer for GaLore: the attention and MLP projections projected at --galore_rank, the rest plain."""
    names = {p: name for name, p in model.named_parameters()}

    def make(params):
        groups = galore_param_groups([(names[p], p) for p in params], args.galore_rank,
                                     lambda name, p: is_projection(name))
        return GaLore(groups, lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay,
                      update_gap=args.galore_update_gap, scale=args.galore_scale,
                      inner=args.optimizer.removeprefix("galore_"))
    return make


def relora_restart(args, model, optimizers, done):
    """ReLoRA, after every --relora_reset updates but the last: merge s·BA into W0, restart the factors (the new A
    drawn from a generator seeded by the step, the same on every rank) and prune 99% of their Adam moments."""
    if args.method == "relora" and done % args.relora_reset == 0 and done < args.num_training_steps:
        restarted = relora_merge(model, torch.Generator().manual_seed(args.seed + done))
        prune_state_(optimizers, restarted, args.relora_prune)  # <-- ReLoRA: the optimizer state of A, B reset


def save_checkpoint(path, state):
    """Atomic: write a temporary file, fsync it, rename it over the old one. A kill leaves one good file."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@torch.no_grad()
def evaluate(model, batches, device, rank, world):
    """Token-weighted mean loss over the fixed validation set (each rank takes every world-th batch)."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of losses, targets)
    for x, y in batches[rank::world]:
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        n = (y != -1).sum()
        total += torch.stack([loss.double() * n, n.double()])
    if world > 1:
        dist.all_reduce(total)
    model.train()
    val_loss = (total[0] / total[1]).item()
    return val_loss, math.exp(min(val_loss, 50.0))


def fmt_rate(tokens_per_s):
    return f"{tokens_per_s / 1e3:.0f}k" if tokens_per_s >= 1e4 else f"{tokens_per_s / 1e3:.1f}k"


def fmt_time(seconds):
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h}h{m:02d}m"


def main(argv=None):
    args, micro_default = get_args(argv)

    # ---- devices and DDP: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, local_rank, world = (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                               int(os.environ["WORLD_SIZE"])) if ddp else (0, 0, 1)

    # ---- batch arithmetic: total = batch_size x accumulation x world, exactly
    if args.batch_size is None:
        args.batch_size = args.total_batch_size // (world * (args.gradient_accumulation or 1))
        if args.gradient_accumulation is None:  # the size's usual micro-batch, accumulating the rest
            args.batch_size = min(args.batch_size, micro_default)
    per_micro = args.batch_size * world
    if args.batch_size <= 0 or args.total_batch_size % per_micro:
        raise SystemExit(f"--total_batch_size {args.total_batch_size} is not a multiple of --batch_size "
                         f"{args.batch_size} x {world} devices; pick sizes that divide")
    accum = args.total_batch_size // per_micro
    if args.gradient_accumulation not in (None, accum):
        raise SystemExit(f"--gradient_accumulation {args.gradient_accumulation} x --batch_size {args.batch_size} x "
                         f"{world} devices != --total_batch_size {args.total_batch_size}; drop one of them")
    args.gradient_accumulation = accum

    # ---- data download (one process), then the device and the process group
    if args.download:
        # enough train shards that the run sees no document twice (a C4 en shard holds ~356k documents)
        n_train = min(1024, math.ceil(args.num_training_steps * args.total_batch_size / 350_000))
        if ddp:  # the other ranks would wait on a barrier for the whole download, past the process group's timeout
            raise SystemExit(f"--download under torchrun: fetch the data once first, with python data.py download "
                             f"--out {args.data_dir} --tokenizer {args.tokenizer} --train_shards {n_train}")
        print(f"--download: {n_train} C4 train shard(s), 1 validation shard and the T5 tokenizer into {args.data_dir}")
        download(args.data_dir, args.tokenizer, shards=shard_names(train=n_train, validation=1))
    if args.device == "auto":
        args.device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    master = rank == 0
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    args.dtype = str(dtype).removeprefix("torch.")

    # ---- cheap checks of the data, and the resume checkpoint
    try:
        find_shards(args.data_dir, "train")
        find_shards(args.data_dir, "validation")
        vocab_size = load_tokenizer(args.tokenizer).get_piece_size()  # 32000 for T5's, as in the paper
    except (OSError, ValueError) as e:
        raise SystemExit(f"train.py --size {args.size}: {e}") from None
    ckpt = None
    if args.resume:
        path = os.path.join(args.out_dir, "ckpt.pt") if args.resume == "auto" else args.resume
        if not os.path.exists(path):
            raise SystemExit(f"--resume: no checkpoint at {path}; pass its path or drop --resume")
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        old = ckpt["args"]
        keys = ("size",) + MODEL_FIELDS + ("optimizer", "per_layer", "total_batch_size", "max_length", "pack")
        diff = [f"{k} {old[k]} (now {getattr(args, k)})" for k in keys if old[k] != getattr(args, k)]
        if ckpt["model_config"]["vocab_size"] != vocab_size:
            diff.append(f"vocab_size {ckpt['model_config']['vocab_size']} (now {vocab_size})")
        if ckpt["world"] != world:
            diff.append(f"{ckpt['world']} processes (now {world})")
        if diff:
            raise SystemExit(f"--resume: {path} was written by another run: {', '.join(diff)}; "
                             "pass the same flags and device count, or a new --out_dir")
        if ckpt["step"] >= args.num_training_steps:
            raise SystemExit(f"--resume: {path} already has {ckpt['step']} updates; raise --num_training_steps "
                             "to train on")

    # ---- model
    torch.manual_seed(args.seed)
    config = config_for(args.size, method=args.method, rank=args.rank, alpha=args.alpha, delta=args.delta,
                        vocab_size=vocab_size)
    model = LLaMA(config, device=device).to(dtype)
    model.activation_checkpointing = args.activation_checkpointing
    if ckpt:
        model.load_state_dict(ckpt["model"])
    raw_model = model  # checkpoints come from the unwrapped, uncompiled model
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
                    gradient_as_bucket_view=True)  # gradients live in the all-reduce buckets, not twice
    if master:
        print(json.dumps(vars(args)))
        print(describe(raw_model))
        print(f"{world} x {device.type} | {args.dtype} | batch {args.batch_size} x {accum} accum x {world} = "
              f"{args.total_batch_size} sequences of {args.max_length} tokens per update")

    # ---- optimizer and schedule
    Opt = {"adamw": AdamW, "adam8bit": Adam8bit}.get(args.optimizer)
    make_optimizer = lambda params: Opt(params, lr=args.lr, betas=(args.beta1, args.beta2),  # noqa: E731
                                        weight_decay=args.weight_decay)
    make_optimizer = galore_maker(args, raw_model) if args.optimizer.startswith("galore") else make_optimizer
    if args.per_layer:
        per_layer = attach_per_layer(model, make_optimizer, lr_lambda_for(args))
        optimizer = scheduler = None
    else:
        per_layer = None
        optimizer = make_optimizer(list(raw_model.parameters()))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(args))
    if ckpt:
        if per_layer:
            per_layer.load_state_dict(ckpt["optimizer"])
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])

    loader = TrainLoader(args.data_dir, args.tokenizer, args.batch_size, max_length=args.max_length, seed=args.seed,
                         rank=rank, world_size=world, pack=args.pack, num_workers=args.workers)
    if ckpt:
        loader.load_state_dict(ckpt["data"][rank])
        torch.set_rng_state(ckpt["rng"])
    val = validation_batches(args.data_dir, args.tokenizer, args.batch_size, max_length=args.max_length,
                             eval_tokens=args.eval_tokens, pack=args.pack)
    batches = iter(loader)

    # ---- SIGTERM/SIGINT ask for a checkpoint and a clean exit at the end of the current update
    stop = {"signal": None}
    old_handlers = {sig: signal.signal(sig, lambda signum, frame: stop.update(signal=signal.Signals(signum).name))
                    for sig in (signal.SIGTERM, signal.SIGINT)}

    os.makedirs(args.out_dir, exist_ok=True)
    metrics = open(os.path.join(args.out_dir, "metrics.jsonl"), "a") if master else None

    def record(row):
        if master:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    def check_finite():
        if first_bad.item() >= 0:  # a host sync: only at log and save steps
            raise SystemExit(f"non-finite loss at step {first_bad.item()}; stopping. The last good checkpoint "
                             f"is {args.out_dir}/ckpt.pt; lower --lr or add --grad_clipping, then --resume")

    def checkpoint(step):
        check_finite()  # never overwrite the last good checkpoint with a diverged model
        state = {"model": raw_model.state_dict(), "optimizer": (per_layer or optimizer).state_dict(),
                 "scheduler": scheduler.state_dict() if scheduler else None, "step": step, "args": vars(args),
                 "model_config": asdict(config), "world": world, "rng": torch.get_rng_state(),
                 "data": [None] * world}
        if ddp:
            dist.all_gather_object(state["data"], loader.state_dict())
        else:
            state["data"][0] = loader.state_dict()
        if master:
            save_checkpoint(os.path.join(args.out_dir, "ckpt.pt"), state)

    last_eval = {}

    def run_eval(step):
        val_loss, val_ppl = evaluate(raw_model, val, device, rank, world)
        if master:
            print(f"step {step}/{args.num_training_steps} | val loss {val_loss:.4f} | val ppl {val_ppl:.2f}")
        last_eval.update(step=step, val_loss=val_loss, val_ppl=val_ppl)
        record(dict(last_eval))

    # ---- the loop: exactly num_training_steps updates
    start = ckpt["step"] if ckpt else 0
    first_bad = torch.tensor(-1, device=device)  # first update with a non-finite loss, kept on device (no sync)
    tokens_per_update = args.total_batch_size * (args.max_length - (0 if args.pack else 1))
    t_log, step_log, t_start = time.perf_counter(), start, time.perf_counter()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start, args.num_training_steps):
        micro_batches = [next(batches) for _ in range(accum)]
        # weight each micro-batch by its counted targets over the whole update's, so the gradient is the
        # token-weighted mean over the global batch, whatever the padding, the accumulation or the device count
        counts = [(y != -1).sum() for _, y in micro_batches]
        n_total = torch.stack(counts).sum().to(device, torch.float64)
        if ddp:
            dist.all_reduce(n_total)
        step_loss = torch.zeros((), device=device, dtype=torch.float64)
        for i, (x, y) in enumerate(micro_batches):
            last = i == accum - 1
            sync = model.no_sync() if ddp and not last else nullcontext()
            hold = per_layer.accumulating() if per_layer and not last else nullcontext()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with sync, hold:
                _, loss = model(x, y)
                weight = counts[i].to(device) / n_total
                (loss * (weight * world)).backward()  # DDP averages over ranks; * world makes it a sum
            step_loss += loss.detach().double() * weight
        if per_layer:
            norm = per_layer.grad_norm()
        else:
            max_norm = args.grad_clipping if args.grad_clipping > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(step_loss), step + 1, first_bad)
        loss_sum += step_loss
        done = step + 1
        relora_restart(args, raw_model, per_layer.optimizers.values() if per_layer else [optimizer], done)
        if args.stop_after and done - start >= args.stop_after and done < args.num_training_steps:
            stop["signal"] = "--stop_after"

        # ---- log (the only host syncs of the loop), evaluate, save, stop
        is_log = done % args.log_every == 0 or done == args.num_training_steps
        if is_log or (not ddp and stop["signal"]):
            if ddp:
                dist.all_reduce(loss_sum)  # each rank holds its share of the token-weighted mean: sum them
                flag = torch.tensor(1 if stop["signal"] else 0, device=device)
                dist.all_reduce(flag)  # every rank must stop at the same update
                stop["signal"] = stop["signal"] or ("a signal on another rank" if flag.item() else None)
            check_finite()
            now = time.perf_counter()
            ms = 1000 * (now - t_log) / (done - step_log)
            tok_s = tokens_per_update / (ms / 1000)
            lr = (per_layer.get_last_lr() if per_layer else scheduler.get_last_lr())[0]
            mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9
            eta = (now - t_start) / (done - start) * (args.num_training_steps - done)
            row = {"step": done, "loss": loss_sum.item() / (done - step_log), "lr": lr, "grad_norm": norm.item(),
                   "ms_per_step": ms, "tokens_per_s": tok_s, "peak_mem_gb": mem}
            if master and is_log:
                print(f"step {done}/{args.num_training_steps} | loss {row['loss']:.4f} | lr {lr:.1e} | "
                      f"norm {row['grad_norm']:.2f} | {ms:.0f} ms | {fmt_rate(tok_s)} tok/s | mem {mem:.1f} GB | "
                      f"eta {fmt_time(eta)}", flush=True)
            if is_log:
                record(row)
                loss_sum.zero_()
                t_log, step_log = now, done
        if done % args.eval_every == 0 or done == args.num_training_steps:
            t_eval = time.perf_counter()
            run_eval(done)
            t_log += time.perf_counter() - t_eval  # ms/step and tok/s count training time only
        if done % args.save_every == 0 or done == args.num_training_steps or stop["signal"]:
            checkpoint(done)
        if stop["signal"]:
            if master:
                print(f"stopped by {stop['signal']}: saved {args.out_dir}/ckpt.pt at step {done}; rerun with --resume")
            break

    if master and not stop["signal"]:
        total = time.perf_counter() - t_start
        print(f"done: {args.num_training_steps - start} updates in {fmt_time(total)} "
              f"({fmt_rate(tokens_per_update * (args.num_training_steps - start) / total)} tok/s with evals) | "
              f"val loss {last_eval['val_loss']:.4f} | val ppl {last_eval['val_ppl']:.2f} | "
              f"checkpoint {args.out_dir}/ckpt.pt")
    for sig, handler in old_handlers.items():
        signal.signal(sig, handler)
    if metrics:
        metrics.close()
    if ddp:  # DDP's reducer (and the per-layer hooks on it) must go before the process group does
        if per_layer:
            per_layer.remove()
        model = per_layer = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
