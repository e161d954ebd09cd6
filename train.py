"""
Pretrain a LLaMA on C4 with SLTrain (W = s·BA + S), low-rank, or full-rank weights, on one device or many.

    python train.py --size 60m                                      # one device: CUDA if present, else CPU
    torchrun --standalone --nproc_per_node=8 train.py --size 1b     # DDP over 8 GPUs (NCCL; gloo on CPU)
    python train.py --size 60m --optimizer adam8bit --per_layer     # the paper's memory-frugal setting
    python train.py --size 60m --resume                             # continue exactly from out/ckpt.pt
    python train.py --size 60m --eval_only                          # validation loss of out/ckpt.pt alone
    python train.py --size 60m --method full --optimizer galore_adamw   # the baselines: GaLore, and ReLoRA
    python train.py --size 60m --method relora

Defaults are the paper's recipe for each size (§5.1 and the authors' scripts); every flag has a help line, and is
checked before any work (flags.py). What a run keeps in out_dir (the lock, metrics.jsonl, ckpt.pt) is keeper.py's.
The authors' flag names (--model_config, --peft_model, --sp_ratio, --lora_alpha, ...) are accepted too.
"""

import argparse
import atexit
import copy
import ctypes
import functools
import gc
import hashlib
import json
import math
import os
import resource
import signal
import sys
import time
import warnings
from contextlib import ExitStack, nullcontext, suppress
from dataclasses import dataclass


def stop_when_torchrun_ends():
    """Under torchrun: SIGTERM to this rank should torchrun's agent end first. torchrun starts its workers in
    sessions of their own, so a signal to its process group reaches the agent alone, which passes on only the
    signals it handles (SIGTERM, SIGINT, SIGHUP, SIGQUIT unless --signals_to_handle says otherwise). Another one
    (SIGUSR1 from `timeout -s USR1` or `kill -USR1 -PGID`) or a kill -9 ends the agent without a word to the ranks,
    which would train on unwatched; with Linux's PR_SET_PDEATHSIG they stop with a checkpoint instead. Asked for
    first thing, before torch's import (seconds): a parent already gone sends nothing, and a rank whose torchrun died
    while it imported would then wait in init_process_group for a store that is gone (minutes; seen). Till the run
    answers the stop signals, SIGTERM ends the rank: in the import by its default action, later with one line
    (main, which asks again for a train.py run from a script of its own)."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG, sent when the parent (the agent) dies


if __name__ == "__main__":  # here, not on import: the rest of the imports take seconds
    stop_when_torchrun_ends()

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import adam8bit_kernel
from analyze import init_refusal, prepare_for_training
import checkpoint
import flags
from cudagraph import MicroBatchGraph, PerLayerGraph
from data import (STOP_SIGNALS, SharedMemoryFull, TrainLoader, Unbroken, find_shards, load_tokenizer, one_line,
                  validation_batches)
from devices import set_deterministic
from download import T5_PIECES, download, shard_names
from flags import resume_path, same_file
from hostsync import HostSyncs
from keeper import (OVERWRITE_ROWS, START_AGAIN, Keeper, any_rank, diverged, exploded, go_on_from, lock_out_dir,
                    refuse_overwrite, rerun_resume, resumable, start_again)
from model import LLaMA, LLaMAConfig, config_for, describe, is_projection, relora_merge, slow_width
from galore import GaLore, galore_param_groups
from optim import AdamW, Adam8bit, clip_grad_norm32, prune_state_
from per_layer import attach_per_layer

MODEL_FIELDS = ("method", "rank", "alpha", "delta", "ffn_dim")
# a checkpoint write longer than this is said once: schedulers commonly allow 30 s between SIGTERM and SIGKILL
SLOW_SAVE_S = 20
VALIDATION_SHARD_TOKENS = 8_000_000  # --download's reckoning of a C4 validation shard's tokens, a little under (setup)
TRAIN_DOC_TOKENS = 480  # and of a C4 train document's, with its EOS, a little under (510 in shard 00000's first 1,000)


def get_args(argv=None):
    """The flags, each checked before any work (flags.py), with this file's usage above them in --help."""
    return flags.get_args(argv, __doc__)


def lr_lambda_for(args, jags=True):
    """Linear warmup to the peak, then cosine down to min_lr_ratio of it (the authors' schedule). When a resumed run
    raised --num_training_steps, args.lr_restart = [step, factor] holds where the old cosine stood: from there
    the cosine goes on from that factor down to the floor at the new end, so the learning rate never jumps. For
    ReLoRA (unless jags=False) the same cosine, cut into jags by a short warmup after every restart (ReLoRA's
    jagged schedule)."""
    warmup, total, floor = args.warmup_steps, args.num_training_steps, args.min_lr_ratio
    begin, top = args.lr_restart or (warmup, 1.0)

    def lr_lambda(step):
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - begin) / max(1, total - begin)
        return floor + (top - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def jagged(step):  # ReLoRA: the cosine, with a linear warmup from 0 again after every restart
        since = step % args.relora_reset
        if step >= args.relora_reset and since < args.relora_warmup:
            return lr_lambda(step) * since / args.relora_warmup
        return lr_lambda(step)
    return jagged if args.method == "relora" and jags else lr_lambda


def galore_maker(args, model):
    """make_optimizer for GaLore: the attention and MLP projections projected at --galore_rank, the rest plain."""
    names = {p: name for name, p in model.named_parameters()}

    def make(params):
        groups = galore_param_groups([(names[p], p) for p in params], args.galore_rank,
                                     lambda name, p: is_projection(name))
        return GaLore(groups, lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay,
                      update_gap=args.galore_update_gap, scale=args.galore_scale,
                      inner=args.optimizer.removeprefix("galore_"), block_size=args.block_size or flags.BLOCK_SIZE,
                      compile=args.compile, fused=fused_for(args))
    return make


def eight_bit_step(args, device):
    """How an 8-bit optimizer steps, for the run's first lines: one kernel (a launch per run of consecutive tensors,
    optim.KERNEL_RUN), or eager (or compiled) and why not the kernel."""
    if args.eval_only or not args.optimizer.endswith("adam8bit"):
        return ""
    why = "--adam8bit_kernel off" if args.adam8bit_kernel == "off" else \
        adam8bit_kernel.why_not(device, getattr(torch, args.dtype), args.block_size)
    return " | 8-bit step: one kernel per run of tensors" if why is None else \
        f" | 8-bit step: {'compiled' if args.compile else 'eager'} (no kernel: {why})"


def fused_for(args):
    """--adam8bit_kernel as the optimizers' fused: the one-kernel 8-bit step where it can run, always, or never."""
    return {"on": True, "off": False}.get(args.adam8bit_kernel)


def relora_restart(args, model, optimizers, done):
    """ReLoRA, after every --relora_reset updates but the last: merge s·BA into W0, restart the factors (the new A
    drawn from a generator seeded by the step, the same on every rank) and prune 99% of their Adam moments."""
    if args.method == "relora" and done % args.relora_reset == 0 and done < args.num_training_steps:
        restarted = relora_merge(model, torch.Generator().manual_seed(args.seed + done))
        prune_state_(optimizers, restarted, args.relora_prune)  # <-- ReLoRA: the optimizer state of A, B reset


# ----------------------------------------------------------------------------- checkpoint and resume

RESUME_MUST_MATCH = ("size",) + MODEL_FIELDS + ("optimizer", "per_layer", "total_batch_size", "max_length", "pack",
                                                "seed", "dtype", "data_dir", "tokenizer_sha256", "galore_rank",
                                                "galore_update_gap", "galore_scale", "relora_reset", "relora_warmup",
                                                "relora_prune", "init_from", "support", "freeze", "support_seed",
                                                "block_size")
EVAL_MUST_MATCH = ("size",) + MODEL_FIELDS + ("tokenizer_sha256",)
RESUME_HONORED = ("lr", "min_lr_ratio", "beta1", "beta2", "weight_decay", "grad_clipping", "num_training_steps",
                  "warmup_steps", "batch_size", "gradient_accumulation", "activation_checkpointing", "compile",
                  "cuda_graph", "amp", "eval_every", "eval_tokens", "save_every", "log_every", "workers", "device",
                  "adam8bit_kernel", "packed_support", "deterministic")
# how --eval_only cuts and counts the validation set where its command line does not say: as the run did, so that it
# gives the run's val_loss again (its batch and dtype are the device's: neither changes which tokens are scored)
EVAL_KEPT = ("max_length", "pack", "eval_tokens")
# (packed_support is how the supports are stored, and SLLinear loads either; deterministic, the order a GPU adds in)
# the honored flags with a value that a resume takes from the run where its command line gives none: --resume alone
# continues the run as it was, not with the size's defaults (the switches, --compile and the like, are as given)
RESUME_KEPT = ("lr", "min_lr_ratio", "beta1", "beta2", "weight_decay", "grad_clipping", "num_training_steps",
               "eval_every", "eval_tokens", "save_every", "log_every")


def same_run(args, ckpt, path, vocab_size, dtype_given):
    """The run's args (ckpt["args"], with the defaults of flags added since), once this command line is checked
    against them: another model, tokenizer or data is refused, a weights-only checkpoint too. Takes the run's start
    (--init_from) and dtype where not given. Called on checkpoint.peek's quick look, then on the loaded checkpoint."""
    # the model is built from the flags, compared below: a field no flag sets is checked here, or would be dropped
    if other := checkpoint.other_model(ckpt["model_config"]):
        raise SystemExit(f"{'--eval_only' if args.eval_only else '--resume'}: {path}: {other}; "
                         f"{checkpoint.OTHER_VERSION}")
    old = ckpt["args"]
    if "block_size" not in old:  # a run from before --block_size: 8-bit Adam's blocks were of 256
        old["block_size"] = flags.BLOCK_SIZE if old.get("optimizer", "").endswith("adam8bit") else None
    old.setdefault("packed_support", False)  # a run from before --packed_support: flat positions
    old.setdefault("ffn_dim", ckpt["model_config"]["ffn_dim"])  # nor --ffn_dim: its size's
    old.setdefault("deterministic", False)  # nor --deterministic
    if "adam8bit_kernel" not in old:  # nor --adam8bit_kernel: compared as its default, not reported as a change
        old["adam8bit_kernel"] = "auto" if old.get("optimizer", "").endswith("adam8bit") else None
    if args.init_from is None:  # the run's start, read once when it began: the file need not exist any more
        args.init_from = old.get("init_from")
    if not (dtype_given or args.amp) and old.get("dtype") and (args.eval_only or not old.get("amp")):
        args.dtype = old["dtype"]  # the device's default was for a new run
        args.amp = bool(args.eval_only and old.get("amp"))  # evaluated as it trained: its val_loss again
    # evaluation needs the same model and tokenizer only: batch, data, dtype and length are its own to choose
    unused = flags.unused_flags(args.method, args.optimizer)  # an older run may have stored them
    must_match = [k for k in (EVAL_MUST_MATCH if args.eval_only else RESUME_MUST_MATCH) if k not in unused]
    def same(k):  # a data folder reached through a link is the same folder; the run's start, the same file by any
        if k == "data_dir" and old.get(k):  # path (its folder's too, that folder since removed: the run needs it not)
            return same_file(old[k], args.data_dir)
        if k == "init_from" and old.get(k) and args.init_from:
            return any(same_file(old[k], p) for p in (args.init_from, os.path.join(args.init_from, "ckpt.pt")))
        return old.get(k) == getattr(args, k)
    def why(k):  # --amp sets the dtype too (float32): a difference it makes is named by it, not by --dtype
        if k == "dtype" and args.amp and not old.get("amp"):
            return f", by --amp: drop --amp{' and --dtype' if dtype_given else ''}"
        if k == "dtype" and old.get("amp") and not args.amp:
            return f", the run's was --amp's: pass --amp{' instead of --dtype' if dtype_given else ''}"
        return ""
    diff = [f"{k} {old.get(k)} (now {getattr(args, k)}{why(k)})" for k in must_match if not same(k)]
    if "init_from" in must_match and old.get("init_from") and same("init_from"):
        args.init_from = old["init_from"]  # recorded as the run began, however this command line spells it
    if ckpt["model_config"]["vocab_size"] != vocab_size:
        diff.append(f"vocab_size {ckpt['model_config']['vocab_size']} (now {vocab_size})")
    if not args.eval_only and "optimizer" not in ckpt:
        raise SystemExit(f"--resume: {path} holds weights only (export.py --merged): evaluate it with --eval_only, "
                         f"or start a new run from it with --init_from")
    if diff and args.eval_only:
        raise SystemExit(f"--eval_only: {path} holds another model: {', '.join(diff)}; pass the --size, --method, "
                         "--rank, --alpha, --delta, --ffn_dim and tokenizer it was trained with")
    if diff:
        raise SystemExit(f"--resume: {path} was written by another run: {', '.join(diff)}; "
                         "pass the same flags, tokenizer and data, or a new --out_dir")
    return old


def load_for_resume(args, vocab_size, world, device, master=True, dtype_given=True, given=(), on_look=None):
    """The checkpoint to resume from, checked against this run. Every flag either must match (the differences are
    listed in one refusal) or is honored and said so (by the master); args then records what this run does. A
    resume without --dtype (or --amp) takes the run's own: bf16, as on a GPU, also when resumed on a CPU; so does
    each flag of RESUME_KEPT not in `given` (the flags on the command line), and the micro-batch where neither
    --batch_size nor --gradient_accumulation is given and it still divides the update. Then the memory check of a
    new run (flags.check_memory, on `device`), at the run's own settings. All of it is decided on checkpoint.peek's
    quick look where one can be had: a refusal comes at once, not after a read of minutes at 7b. on_look(look): what
    else is decided on that look (the data position, by prepare) before the read."""
    path = resume_path(args)  # (there: prepare checked, flags.no_checkpoint)
    look, ckpt = quick_look(path), None  # its args and step, its tensors mapped from the file, not read
    if look is None:
        look = ckpt = read_checkpoint(path)  # no quick look: the checks wait for the read (which says what is wrong)
    said = settle(args, look, path, vocab_size, device, world, dtype_given, given)
    if master and said:
        print(said)
    if on_look:
        on_look(look)
    if ckpt is None:  # the verified file; its args (the look's) get the defaults of flags added since, for the run
        seen = [look.get(k) for k in ("step", "eval_pending", "data")]  # plain values: not the file's mapped tensors
        del look
        ckpt = read_checkpoint(path)
        same_run(args, ckpt, path, vocab_size, dtype_given)
        if not args.eval_only and seen != [ckpt.get(k) for k in ("step", "eval_pending", "data")]:
            # the job that writes it (a resume from another --out_dir) saved in between: the loader stands at the
            # look's data position and the schedule was set at its step, the weights at another update. (An
            # evaluation takes from the look the run's settings alone, the same at every save)
            raise SystemExit(f"--resume {path} was saved over while it was read (step {ckpt['step']}, where its first "
                             f"look had step {seen[0]}): run the same command again, to go on from the new one")
    return ckpt, path


def quick_look(path):
    """checkpoint.peek of a run's checkpoint (its args, model config and step there), else None."""
    look = checkpoint.peek(path)
    return look if isinstance(look, dict) and {"args", "model_config", "step"} <= set(look) else None


def settle(args, look, path, vocab_size, device, world, dtype_given, given):
    """same_run, then the resume's (or the evaluation's) settings, on a look at the checkpoint at path -> the line
    that says what is taken from the run and what changed, or None."""
    precision = (args.dtype, args.amp)  # the device's default, or the command line's
    old = same_run(args, look, path, vocab_size, dtype_given)
    return (eval_settings(args, old, vocab_size, device, world, given, precision) if args.eval_only else
            resume_settings(args, old, look, path, vocab_size, device, world, given))


def refuse_before_download(args, vocab_size, dtype_given, given):
    """A resume's (or --eval_only's) refusals, on the checkpoint's quick look, before --download's minutes (and before
    a data folder that is not there is said as a new run's): another model or flag, another data folder, a finished
    run, a warmup or memory that does not fit. Decided on a copy of args (the run decides again once the data is
    there); with no tokenizer there yet, its vocabulary and digest are taken as the run's (the run then checks the
    downloaded one). Without a quick look the read after the download says what is wrong."""
    path = resume_path(args)
    if (look := quick_look(path)) is None:
        return
    early, device = copy.deepcopy(args), torch.device(args.device)
    early.dtype = flags.run_dtype(early, device)
    if vocab_size is None:
        vocab_size = look["model_config"].get("vocab_size")
        early.tokenizer_sha256 = look["args"].get("tokenizer_sha256")
    else:
        early.tokenizer_sha256 = file_sha256(args.tokenizer)
    settle(early, look, path, vocab_size, device, 1, dtype_given, given)


def refuse_start_before_download(args, vocab_size):
    """A new run's --init_from refused on the checkpoint's quick look before --download's minutes, as prepare would
    refuse it after them: not full-rank, or of another shape or vocabulary (vocab_size: the tokenizer's there; with
    none there yet, T5's, the one fetched), or trained with another tokenizer than the one there. Without a quick
    look the read after the download says what is wrong."""
    if (look := checkpoint.peek(args.init_from)) is None:
        return
    config = config_for(args.size, method=args.method, rank=args.rank, alpha=args.alpha, delta=args.delta,
                        ffn_dim=args.ffn_dim, vocab_size=vocab_size or T5_PIECES)
    if refusal := init_refusal(args.init_from, look, config, file_sha256(args.tokenizer) if vocab_size else None):
        raise SystemExit(refusal)


def file_sha256(path):
    """The sha256 of a file's bytes, in hex."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_checkpoint(path):
    """checkpoint.load, its refusal of a damaged or foreign file one line."""
    try:
        return checkpoint.load(path)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def eval_settings(args, old, vocab_size, device, world, given, precision):
    """--eval_only's cut and count of the validation set, and its dtype, taken from the run where the command line
    names none (its val_loss, again) -> the line that says so, or None; then the memory check at those and at
    vocab_size, the run's (same_run checked)."""
    kept = [k for k in EVAL_KEPT if k not in given and k in old and old[k] != getattr(args, k)]
    for k in kept:
        setattr(args, k, old[k])
    said = [f"--{k} {old[k]}" for k in kept]
    if (args.dtype, args.amp) != precision:  # same_run took the run's, which the command line did not name
        said.insert(0, "--amp (bf16 compute)" if args.amp else f"--dtype {args.dtype}")
    # checked here alone, at the run's length and dtype: the command line's defaults (256 tokens, float32 on a CPU)
    # would refuse a bf16 run of shorter rows that fits
    flags.check_memory(flags.make_parser(), args, device, world, vocab_size)
    return f"--eval_only: the run's own {', '.join(said)} (pass others to choose)" if said else None


def resume_settings(args, old, ckpt, path, vocab_size, device, world, given):
    """A resume's flags against the run's (old, its step and world in ckpt): the run's own where not given, the rest
    checked against where the run stands -> the line that says what resumes and what changed. vocab_size: the
    run's (same_run checked), which its memory is checked at."""
    for k in RESUME_KEPT:
        if k not in given and k in old:
            setattr(args, k, old[k])
    micro = old.get("batch_size")  # the run's micro-batch, not this device's default: the same sums, the same memory
    fits = micro and args.total_batch_size % (micro * world) == 0  # (on another number of processes it may not)
    if fits and not {"batch_size", "gradient_accumulation"} & set(given):
        args.batch_size, args.gradient_accumulation = micro, args.total_batch_size // (micro * world)
    refusal = flags.bf16_decay_refusal(args, args.dtype, resuming=True)  # the run's dtype, lr and decay, known now
    if refusal:
        raise SystemExit(f"--resume: {path} holds bf16 parameters, and {refusal}")
    step = ckpt["step"]
    if step >= args.num_training_steps and not (step == args.num_training_steps and ckpt.get("eval_pending")):
        raise SystemExit(f"--resume: {path} already has {step} updates; raise --num_training_steps to train on")
    if args.warmup_steps is None:
        args.warmup_steps = old["warmup_steps"]  # the run's, not the recipe's share of a new --num_training_steps
        if args.warmup_steps > args.num_training_steps:
            raise SystemExit(f"--resume: the run's warmup of {args.warmup_steps} updates is longer than "
                             f"--num_training_steps {args.num_training_steps}: pass --warmup_steps too")
    elif args.warmup_steps > args.num_training_steps:  # against the run's updates, known only now
        raise SystemExit(f"--resume: --warmup_steps must be in [0, {args.num_training_steps}] (the run's "
                         f"--num_training_steps), got {args.warmup_steps}")
    elif args.warmup_steps != old["warmup_steps"] and 0 < step >= min(args.warmup_steps, old["warmup_steps"]):
        # past either warmup's end the two schedules stand apart: the learning rate would climb a second warmup and
        # then drop to the cosine, or leap to the cosine's top. (Short of both, the ramp takes the new slope: a step
        # the user asked for; at update 0 nothing has trained yet)
        ended = "its warmup" if step >= old["warmup_steps"] else "the new warmup"
        raise SystemExit(f"--resume: {path} is at update {step}, past the end of {ended}, and --warmup_steps "
                         f"{args.warmup_steps} is not the run's {old['warmup_steps']}: a warmup can be changed "
                         "only while both are still ahead; drop --warmup_steps")
    flags.check_memory(flags.make_parser(), args, device, world, vocab_size,
                       accumulation_given="gradient_accumulation" in given)
    args.lr_restart = old.get("lr_restart")
    if args.num_training_steps != old["num_training_steps"] and step >= min(old["warmup_steps"], args.warmup_steps):
        # continue the cosine from where it stood; at a ReLoRA restart its jag is at 0, the cosine is not
        args.lr_restart = [step, lr_lambda_for(argparse.Namespace(**old), jags=False)(step)]
    changed = [f"{k} {old.get(k)} -> {getattr(args, k)}" for k in RESUME_HONORED if old.get(k) != getattr(args, k)]
    if ckpt["world"] != world:  # the same updates (--total_batch_size), the data dealt anew (train_loader)
        changed.append(f"processes {ckpt['world']} -> {world}")
    return f"resuming from {path} at step {step}" + (f"; changed and honored: {', '.join(changed)}" if changed else "")


def same_validation(args, sha256, ckpt, path):
    """Record the validation set's digest in args (so in the checkpoint); a resume whose set has changed since (its
    shards replaced, or one added before them in file order), at the same --eval_tokens, is refused: its val_loss
    rows would go on over another set without a word. Another --eval_tokens asks for a new set, and is honored."""
    before, args.validation_sha256 = ckpt and ckpt["args"].get("validation_sha256"), sha256
    if before and before != sha256 and ckpt["args"].get("eval_tokens") == args.eval_tokens:
        raise SystemExit(f"--resume: the validation shards in {args.data_dir} have changed since {path} was "
                         "evaluated on them, and its val_loss rows would go on over another set; restore them, or "
                         "pass another --eval_tokens to evaluate on a new set from here")


def set_hyperparameters(args, optimizers, scheduler):
    """A loaded optimizer state brings the old run's lr, betas and weight decay; this run's flags replace them."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.update(initial_lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)
    if scheduler:
        scheduler.base_lrs = [args.lr] * len(scheduler.base_lrs)
        factor = lr_lambda_for(args)(scheduler.last_epoch)
        for group in scheduler.optimizer.param_groups:
            group["lr"] = args.lr * factor
        scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def causes(error):
    """error, then its cause or context, and theirs (torch.compile wraps the errors raised inside it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = error.__cause__ or error.__context__


def ran_out_of_memory(error):
    """Whether running out of memory is this error or its cause: a GPU's OutOfMemoryError, or on a CPU an allocation
    refused under a limit on the address space (`ulimit -v`, a scheduler's h_vmem): torch's RuntimeError, or
    Python's MemoryError. Without a limit the OS kills the process instead, and nothing is said."""
    return any(isinstance(e, (torch.OutOfMemoryError, MemoryError)) or
               (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)) for e in causes(error))


def lost_a_rank(error):
    """Whether a collective failed: another rank is gone (killed for memory, or by hand) or the network broke. NCCL
    raises torch.distributed's errors; gloo a RuntimeError from its transport, which names its source file."""
    return any(isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo/transport" in str(e))
               for e in causes(error))


def rank_lost(rank, where, error, fix):
    """The line for a collective that failed mid-run, said by each rank left (its own view of the failure)."""
    said = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return RankFault(f"rank {rank}: {where}: a collective with the other ranks failed ({said.strip()[:200]}): "
                     f"a rank died (torchrun's report names it and its exit code; -9 is a kill, often for memory) "
                     f"or the network broke. {fix}")


def lost_in_setup(rank, error, signalled):
    """The line for a collective that failed before the first update. torchrun signals every rank at once: a rank
    still setting up stops there (StoppedBeforeTheRun) and ends, while one already set up waits for it in a
    collective, which fails. Signalled too, that rank stops with it (said once, by local rank 0); else another rank
    died in its setup (killed for memory as it read the checkpoint, say). Nothing was trained yet either way."""
    if signalled:
        return stopped_before_the_run(signalled)
    return rank_lost(rank, "setting up the run", error, "Nothing was trained yet: run the same command again")


def stopped_before_the_run(signal_name):
    return SystemExit(f"stopped by {signal_name} before the first update: nothing was saved")


def out_of_memory(args, run, where, last_good):
    """The line for running out of memory mid-run (the check before the first update went by an estimate): where, the
    peak, and the fix from the last checkpoint. Nothing since that checkpoint is saved: with per-layer updates an
    update cut short is half applied."""
    if args.eval_only:  # any batch size evaluates the same tokens
        smaller = args.batch_size // 2
    else:  # a smaller micro-batch must divide the rank's share of the update, as flags checks; accumulation makes up
        share = args.total_batch_size // run.world  # the rest
        smaller = next((b for b in range(args.batch_size - 1, 0, -1) if share % b == 0), None)
    more = "a GPU with more memory" if run.device.type == "cuda" else "more memory (a higher address-space limit)"
    if smaller:
        fix = f"--batch_size {smaller}" + ("" if args.eval_only else f" (the same {args.total_batch_size} sequences "
                                                                     "per update, in more micro-batches)")
    elif args.eval_only:
        fix = more
    elif not args.activation_checkpointing:
        fix = "--activation_checkpointing"
    else:  # --resume refuses another --size
        fix = more if resumable(last_good) else f"{more} (or a smaller --size)"
    peak = ""
    if run.device.type == "cuda":
        total = torch.cuda.get_device_properties(run.device).total_memory
        peak = f" ({torch.cuda.max_memory_allocated(run.device) / 1e9:.1f} GB allocated at the peak, of " \
            f"{total / 1e9:.1f})"
    if args.eval_only:
        then = f"rerun --eval_only with {fix}"
    elif resumable(last_good):
        then = f"the last checkpoint is {last_good[0]}, step {last_good[1]}: rerun with " \
            f"{rerun_resume(last_good[0], args.out_dir)} and {fix}"
    else:  # none yet, or gone since (its folder removed under the run, a resume's source deleted once read)
        then = start_again(last_good, fix) if last_good else \
            f"no checkpoint was saved yet: start again with {fix} and {OVERWRITE_ROWS}"
    if run.world == 1:
        return RankFault(f"out of memory in {where}{peak}; {then}")
    # said now, not at exit: the process group's teardown before it may wait on the other ranks (NCCL)
    print(f"rank {run.rank}: out of memory in {where}{peak}; {then}", file=sys.stderr, flush=True)
    return RankFault(1)


# ----------------------------------------------------------------------------- evaluation and logging

@torch.no_grad()
def evaluate(model, batches, device, rank, world, stop):
    """Token-weighted mean loss over the fixed validation set (each rank takes every world-th batch), and the
    number of tokens it covered; None when a signal arrived meanwhile (the caller stops, without waiting)."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of losses, targets)
    for i in range(0, len(batches), world):  # the same number of rounds on every rank, for the stop flag's all-reduce
        if stopping(stop, world):
            model.train()
            return None
        if i + rank >= len(batches):
            continue
        x, y, n = on_host(*batches[i + rank], device)
        loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))[1]
        total += torch.stack([loss.double() * n, torch.full_like(total[1], n)])
    if world > 1:
        dist.all_reduce(total)
    model.train()
    val_loss = (total[0] / total[1]).item()
    return val_loss, math.exp(min(val_loss, 50.0)), int(total[1].item())


def stopping(stop, world):
    """Whether any rank was signalled: every rank must stop at the same point, or the others would wait forever. Under
    DDP the answer is the all-reduced one: a signal that arrives just after it is for the next check, on every rank."""
    if world == 1:
        return stop["signal"] is not None
    if any_rank(stop["signal"] is not None):
        stop["signal"] = stop["signal"] or "a signal on another rank"
        return True
    return False


def carried_loss(ckpt, rank, world):
    """This rank's part of the loss since the checkpoint's last log row, which the next row goes on summing (Meter). On
    another number of processes rank 0 carries the whole: the ranks' parts are summed into the row anyway."""
    parts = ckpt and ckpt.get("meter")
    if not parts:
        return None
    if len(parts) == world:
        return parts[rank]
    if None in parts:
        return None
    return {"loss": sum(part["loss"] for part in parts) if rank == 0 else 0.0, "since": parts[0]["since"]}


class Meter:
    """The loss and trained (non-pad) tokens since the last log line, summed on the device (no host sync before
    row())."""

    def __init__(self, device, start, total, carried=None):
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        self.loss_from = start  # the loss sums the updates since this step: a resume carries those before it
        if carried:
            self.loss += carried["loss"]
            self.loss_from = carried["since"]
        self.tokens = torch.zeros((), device=device, dtype=torch.float64)
        self.device, self.start, self.total, self.tokens_all = device, start, total, 0.0
        self.t_start = self.t_log = time.perf_counter()
        self.step_log = start
        self.paced_from = None  # (step, time) of the first row: the eta counts the pace after it

    def add(self, loss, tokens):
        self.loss += loss
        self.tokens += tokens

    def pause(self, seconds):  # an evaluation or a checkpoint: ms/step and tok/s count training time only
        self.t_log += seconds

    def row(self, done, lr, norm, ddp):
        """The log row of the updates since the last one (this syncs), which starts the next interval."""
        if ddp:
            dist.all_reduce(self.loss)  # each rank holds its share of the token-weighted mean: sum them
        tokens = self.tokens.item()  # waits for the device: the clock is read once the interval's work is done
        now, n = time.perf_counter(), done - self.step_log
        row = {"step": done, "loss": self.loss.item() / (done - self.loss_from), "lr": lr, "grad_norm": norm.item(),
               "ms_per_step": 1000 * (now - self.t_log) / n, "tokens_per_s": tokens / (now - self.t_log),
               "peak_mem_gb": peak_mem_gb(self.device)}
        # the pace since the first row, whose interval held the one-off costs (a compile, a CUDA graph's capture, a
        # resumed run's pending evaluation: minutes at 7b, which the eta of a long run carried for days); the
        # evaluations and checkpoints since recur, so they count. The first row's own: its training time
        since, then = self.paced_from or (self.step_log, self.t_log)
        self.eta = (now - then) / (done - since) * (self.total - done)
        self.paced_from = self.paced_from or (done, now)
        self.tokens_all += tokens
        self.loss.zero_()
        self.tokens.zero_()
        self.t_log, self.step_log, self.loss_from = now, done, done
        return row

    def state(self):
        """This rank's loss since the last log row, for the checkpoint (one host sync: saves sync anyway)."""
        return {"loss": self.loss.item(), "since": self.loss_from}

    def line(self, r):
        return (f"step {r['step']}/{self.total} | loss {r['loss']:.4f} | lr {r['lr']:.1e} | norm {r['grad_norm']:.2f} "
                f"| {r['ms_per_step']:.0f} ms | {fmt_rate(r['tokens_per_s'])} tok/s | mem {r['peak_mem_gb']:.1f} GB | "
                f"eta {fmt_time(self.eta)}")


def fmt_rate(tokens_per_s):
    return f"{tokens_per_s / 1e3:.0f}k" if tokens_per_s >= 1e4 else f"{tokens_per_s / 1e3:.1f}k"


def fmt_time(seconds):
    h, m = divmod(int(seconds) // 60, 60)
    return f"{h}h{m:02d}m"


def peak_mem_gb(device):
    """Peak CUDA memory allocated on a GPU; on CPU the process's peak resident set size (RSS)."""
    return (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9


# ----------------------------------------------------------------------------- setup

def download_shards(args, given=()):
    """What --download fetches: the train shard names, and how many validation shards. Enough train shards that the
    run sees no document twice (a C4 en shard holds ~356k documents); on a resume the checkpoint's own, which its
    data position needs, whatever this command line's --num_training_steps (the run's own is taken later) says. And
    validation shards for --eval_tokens: one holds about 8.9M non-pad tokens at the paper's 256 a row (45,576
    documents, 195 tokens each on average in C4's validation sample of 2,000), so the paper's 10M take two; a shorter
    row holds fewer (about 2.9M a shard at 64), a packed window every token (about 22M). A packed window takes its
    share of a document of TRAIN_DOC_TOKENS (257 tokens about half of one, 1025 about two). A resume or --eval_only
    takes the run's --eval_tokens (and --eval_only its --max_length and --pack) where `given` (the command line's
    flags) has none (RESUME_KEPT, EVAL_KEPT): its shards are fetched, not the default's."""
    ckpt = checkpoint.peek(resume_path(args)) if args.resume or args.eval_only else None  # none: said later
    run = ckpt.get("args") if isinstance(ckpt, dict) and isinstance(ckpt.get("args"), dict) else {}
    kept = EVAL_KEPT if args.eval_only else RESUME_KEPT
    eval_tokens, max_length, pack = (run.get(k, getattr(args, k)) if k in kept and k not in given else getattr(args, k)
                                     for k in ("eval_tokens", "max_length", "pack"))
    per_shard = VALIDATION_SHARD_TOKENS * (1 if pack else min(1, max_length / 256))  # a row holds max_length at most
    n_val = min(8, math.ceil(eval_tokens / per_shard))
    if args.eval_only:  # an evaluation reads no train shard
        return [], n_val
    if isinstance(ckpt, dict) and ckpt.get("data"):
        return list(ckpt["data"][0]["shards"]), n_val  # every rank's state names the same shards
    docs = (max_length + 1) / TRAIN_DOC_TOKENS if pack else 1  # a sequence's documents (a share of one)
    n_train = min(1024, math.ceil(args.num_training_steps * args.total_batch_size * docs / 350_000))
    return shard_names(train=n_train, validation=0), n_val


def setup(args, given=(), dtype_given=True):
    """DDP (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE), the download, the device, and cheap data checks. given: the
    flags on the command line (a resume's download fetches what the run's own settings read, once they are checked
    against it)."""
    ddp = "RANK" in os.environ  # then every variable of torchrun's is there, and sound (flags.torchrun_ranks)
    rank, _, world = flags.torchrun_ranks()
    # a tokenizer already there is read before a download's minutes (which keeps it): a --model_config of another
    # vocabulary, or a file that is no tokenizer, is refused first
    vocab_size = tokenizer_pieces(args) if os.path.isfile(args.tokenizer) else None
    if args.download and vocab_size is None and (refusal := flags.model_config_refusal(args, T5_PIECES)):
        raise SystemExit(refusal)  # none there: the one it fetches is T5's, known before the minutes of fetching it
    if args.download:
        train_shards, n_val = download_shards(args, given)
        if ddp:  # the other ranks would wait on a barrier for the whole download, past the process group's timeout
            raise SystemExit(f"--download under torchrun: fetch the data once first, with python data.py download "
                             f"--out {args.data_dir} --tokenizer {args.tokenizer} --train_shards {len(train_shards)} "
                             f"--validation_shards {n_val}")
        if args.resume or args.eval_only:
            refuse_before_download(args, vocab_size, dtype_given, given)
        elif args.init_from:
            refuse_start_before_download(args, vocab_size)
        whose = " (the resumed run's)" if args.resume and train_shards else ""
        # where each goes, the tokenizer apart; one already there is kept (download fetches none over it)
        tokenizer = f"; the tokenizer at {args.tokenizer} is there and kept" if os.path.exists(args.tokenizer) else \
            f" and the T5 tokenizer to {args.tokenizer}"
        print(f"--download: {len(train_shards)} C4 train shard(s){whose}, {n_val} validation shard(s) into "
              f"{args.data_dir}{tokenizer}")
        try:
            download(args.data_dir, args.tokenizer, shards=train_shards + shard_names(train=0, validation=n_val))
        except (OSError, ValueError) as e:  # offline, a failing server, a file that fails its checksum
            raise SystemExit(f"--download: {e}") from None
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    args.dtype = flags.run_dtype(args, device)
    try:
        if not args.eval_only:  # which reads no train shard
            find_shards(args.data_dir, "train")
        find_shards(args.data_dir, "validation")
    except (OSError, ValueError) as e:
        if args.resume or args.eval_only:  # a resume without the run's --data_dir: that difference is named, where
            refuse_before_download(args, vocab_size, dtype_given, given)  # fetching into this folder ends refused
        raise SystemExit(f"train.py --size {args.size}: {e}") from None
    vocab_size = vocab_size or tokenizer_pieces(args)
    # tools read them from the checkpoint, from any folder; the same vocabulary size is not the same tokenizer
    args.data_dir, args.tokenizer = os.path.abspath(args.data_dir), os.path.abspath(args.tokenizer)
    args.tokenizer_sha256 = file_sha256(args.tokenizer)
    if ddp:  # on GPUs the gradients go through NCCL and the ranks' one-number flags (a signal, a bad shard line)
        # through gloo, on the host: reading a flag then never waits for a GPU to finish its queue
        dist.init_process_group(process_group_backend(device))
    return ddp, rank, world, device, vocab_size


def process_group_backend(device):
    """What DDP runs on (the run's header line says it): on GPUs the gradients through NCCL and the ranks' one-number
    flags through gloo; on CPUs all through gloo."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def tokenizer_pieces(args):
    """The tokenizer's number of pieces (32000 for T5's, as the paper), which --model_config's vocab_size must be."""
    try:
        vocab_size = load_tokenizer(args.tokenizer, args.data_dir).get_piece_size()
    except (OSError, ValueError) as e:
        raise SystemExit(f"train.py --size {args.size}: {e}") from None
    if refusal := flags.model_config_refusal(args, vocab_size):
        raise SystemExit(refusal)
    return vocab_size


@dataclass
class Run:
    """What build() makes and train() drives: the model, what updates it, and where it runs."""
    model: torch.nn.Module  # what forward and backward go through: compiled blocks, in DDP under torchrun
    raw_model: LLaMA  # the same weights, plain: checkpoints and evaluation
    optimizer: torch.optim.Optimizer | None  # None with per-layer updates (or --eval_only)
    scheduler: torch.optim.lr_scheduler.LambdaLR | None
    per_layer: object  # per_layer.PerLayer: the updates made inside backward, each layer's optimizer and schedule
    config: LLaMAConfig
    device: torch.device
    rank: int
    world: int
    graph: MicroBatchGraph | None = None  # --cuda_graph: micro-batches' forward and backward (updates), replayed

    @property
    def optimizers(self):
        return list(self.per_layer.optimizers.values()) if self.per_layer else [self.optimizer]


def build(args, config, device, dtype, ddp, ckpt):
    """The Run: the model (raw, for checkpoints) and what trains it: DDP wrapper, optimizer, schedule or per-layer
    updates, loaded from ckpt when there is one."""
    torch.manual_seed(args.seed)
    # drawn in float32 and rounded a block at a time; under --amp SLTrain-FT's frozen W0 is kept in bf16 (it has no
    # gradient and no optimizer state, and only ever enters the bf16 W; model.frozen_base_to)
    raw_model = LLaMA(config, device=device, dtype=dtype, base_dtype=torch.bfloat16 if args.amp else None)
    raw_model.activation_checkpointing = args.activation_checkpointing
    raw_model.autocast = torch.bfloat16 if args.amp else None
    try:  # --support_seed, --init_from, --freeze (analyze.py)
        prepare_for_training(raw_model, args, resuming=bool(ckpt))
    except ValueError as e:  # an --init_from checkpoint that is damaged, not full-rank, or of another size
        message = str(e) if str(e).startswith("--init_from") else f"--init_from {args.init_from}: {e}"
        raise SystemExit(message if not ddp or dist.get_rank() == 0 else 1) from None
    if ckpt:
        raw_model.load_state_dict(ckpt["model"])
    if ddp:  # DDP broadcasts rank 0's parameters, not its buffers (broadcast_buffers=False): the supports (and an
        for buffer in raw_model.buffers():  # SLTrain-FT W0) each rank drew, alike from one seed on one kind of device
            dist.broadcast(buffer, 0)  # but not on GPUs of two kinds, whose random kernels split the work otherwise
    model = raw_model.compile_blocks() if args.compile else raw_model  # in place: checkpoints keep their names
    if ddp:
        with warnings.catch_warnings():  # newer torch deprecates broadcast_buffers, on every rank; its replacement
            # (forward_sync_buffers) is missing from older torch and would sync at init, which we do not need
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
                        gradient_as_bucket_view=True)  # gradients live in the all-reduce buckets, not twice
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    if args.eval_only:  # nothing trains: no optimizer, and a checkpoint of weights only will do
        return Run(model, raw_model, None, None, None, config, device, rank, world)
    hyper = dict(lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)
    make_optimizer = {"adamw": lambda params: AdamW(params, **hyper),
                      "adam8bit": lambda params: Adam8bit(params, **hyper, block_size=args.block_size,
                                                          compile=args.compile, fused=fused_for(args))}
    make_optimizer = make_optimizer.get(args.optimizer) or galore_maker(args, raw_model)
    if args.per_layer:
        per_layer, optimizer, scheduler = attach_per_layer(model, make_optimizer, lr_lambda_for(args)), None, None
    else:
        per_layer, optimizer = None, make_optimizer(list(raw_model.parameters()))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(args))
    graph = None if not args.cuda_graph else PerLayerGraph(model, per_layer) if per_layer else \
        MicroBatchGraph(model, raw_model.parameters())
    run = Run(model, raw_model, optimizer, scheduler, per_layer, config, device, rank, world, graph)
    if ckpt:
        (per_layer or optimizer).load_state_dict(ckpt["optimizer"])
        if scheduler:
            scheduler.load_state_dict(ckpt["scheduler"])
        set_hyperparameters(args, run.optimizers, scheduler)
    return run


# ----------------------------------------------------------------------------- the run

class RankFault(SystemExit):
    """A fault of one rank's own (its GPU ran out of memory): said by the rank that met it, wherever it is."""


def rank_0_speaks(fn):
    """Under torchrun every rank meets the same bad input and would say so: local rank 0 does, once per machine (a
    machine's own disk may lack what another's has); the others exit 1. A RankFault is said by its rank."""
    @functools.wraps(fn)
    def said_once(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if isinstance(e.code, str) and not flags.local_rank_0() and not isinstance(e, RankFault):
                raise SystemExit(1) from None
            raise
    return said_once


def claim_out_dir(args, held, rank, world):
    """out_dir's lock (but for --eval_only, which writes nothing), and the refusal of a checkpoint there that this
    run would replace unasked."""
    if not args.eval_only:
        lock_out_dir(args, held, rank, world)
    refuse_overwrite(args)


def prepare(args, held, given=()):
    """Everything before the first update: processes, data checks, out_dir's lock (into held, an ExitStack), the
    checkpoint to resume, the data and the Run, the config printed. Returns (ddp, ckpt, its path, (validation batches,
    this rank's training loader), run). The data is read before the model is built: a bad shard is one line, not a
    traceback after minutes of work. given: the flags on the command line (a resume keeps the run's others)."""
    dtype_given = args.dtype is not None  # else the device's default, or a resumed run's own
    if refusal := flags.no_checkpoint(args):  # before the tokenizer, a download and the process group
        raise SystemExit(refusal)
    # --download fetches for minutes, in one process (torchrun refuses it): out_dir's lock and refusals come first
    out_dir_first = args.download and "RANK" not in os.environ
    if out_dir_first:
        claim_out_dir(args, held, 0, 1)
    ddp, rank, world, device, vocab_size = setup(args, given, dtype_given)
    ckpt = ckpt_path = None
    if not out_dir_first:
        claim_out_dir(args, held, rank, world)
    loaders = []  # a resume's, at the data position of the checkpoint's look: its shards checked before the read
    if args.resume or args.eval_only:
        on_look = None if args.eval_only else lambda look: loaders.append(train_loader(args, rank, world, look))
        ckpt, ckpt_path = load_for_resume(args, vocab_size, world, device, rank == 0, dtype_given, given, on_look)
    config = config_for(args.size, method=args.method, rank=args.rank, alpha=args.alpha, delta=args.delta,
                        ffn_dim=args.ffn_dim, vocab_size=vocab_size, packed_support=args.packed_support)
    if args.init_from and not ckpt:  # a new run's start, checked on a quick look before the data and the model
        peeked = checkpoint.peek(args.init_from)
        if peeked is None:  # not readable so: the full read says why (it fails at once for a file of another kind)
            try:
                peeked = checkpoint.load(args.init_from)
            except (OSError, ValueError) as e:
                raise SystemExit(f"--init_from {args.init_from}: {e}") from None
        if refusal := init_refusal(args.init_from, peeked, config, args.tokenizer_sha256):
            raise SystemExit(refusal)
        del peeked
    try:  # read before the model is built: bad validation data is one line, not a traceback after the work
        val = validation_batches(args.data_dir, args.tokenizer, args.batch_size, max_length=args.max_length,
                                 eval_tokens=args.eval_tokens, pack=args.pack)
    except (OSError, ValueError) as e:
        raise SystemExit(f"train.py --size {args.size}: {e}") from None
    if not args.eval_only:
        same_validation(args, val.sha256, ckpt, ckpt_path)
    loader = None if args.eval_only else loaders[0] if loaders else train_loader(args, rank, world, ckpt)
    run = build(args, config, device, getattr(torch, args.dtype), ddp, ckpt)
    for key in ("model", "optimizer", "scheduler") if ckpt else ():  # loaded: the rest of the run needs its step,
        ckpt.pop(key, None)  # args, data and RNG only, and these would sit in host memory to its end, on every rank
    if rank == 0:
        read = flags.EVAL_READS + ("tokenizer_sha256",) if args.eval_only else vars(args)  # what this run uses
        print(json.dumps({k: v for k, v in vars(args).items() if k in read}))
        print(describe(run.raw_model))
        if device.type == "cuda" and (note := slow_width(config)):
            print(note)
        if val.short:  # --eval_tokens is honored as far as the shards go: said, not left to be found
            print(f"note: the validation shards in {args.data_dir} hold {val.tokens:,} tokens at --max_length "
                  f"{args.max_length}, fewer than --eval_tokens {args.eval_tokens:,}: every evaluation covers those "
                  f"{val.tokens:,}; for more, fetch more shards (python data.py download --validation_shards N)")
        if args.method == "relora" and not args.eval_only and args.relora_reset >= args.num_training_steps:
            # the default reset (ReLoRA's 2000) in a shorter run; one given is refused there (check_baseline_flags)
            print(f"note: --relora_reset {args.relora_reset} restarts nothing in a run of {args.num_training_steps} "
                  "updates: this run trains LoRA over a frozen W0, without ReLoRA's merges; pass a --relora_reset "
                  "below --num_training_steps for them")
        amp = " + bf16 autocast" if args.amp else ""
        mem = "peak CUDA allocated" if device.type == "cuda" else "peak RSS"
        exact = " | deterministic" if args.deterministic else ""
        ddp_on = f" (DDP: {process_group_backend(device)})" if ddp else ""
        print(f"{world} x {device.type}{ddp_on} | {args.dtype}{amp}{exact}{eight_bit_step(args, device)} | " + (
            f"--eval_only: batches of {args.batch_size} sequences of {args.max_length} tokens per device, the first "
            f"{val.tokens:,} validation tokens{rounded_up(args, val)}" if args.eval_only else
            f"batch {args.batch_size} x {args.gradient_accumulation} accum x {world} = {args.total_batch_size} "
            f"sequences of {args.max_length} tokens per update | tok/s counts trained (non-pad) tokens; mem is {mem}"))
    return ddp, ckpt, ckpt_path, (val, loader), run


def rounded_up(args, val):
    """What the validation set's size owes to --eval_tokens, where they differ: it ends with the row (or --pack's
    window) that reaches it. (Shards that hold fewer are said in a note of their own.)"""
    if val.tokens == args.eval_tokens or val.short:
        return ""
    unit = "window" if args.pack else "row"
    return f" (--eval_tokens {args.eval_tokens:,}, to the end of the {unit} that reaches it)"


class StoppedBeforeTheRun(BaseException):
    """A stop signal while the data loads, the checkpoint is read or the model is built (minutes at 7b): nothing is
    trained yet to save. A BaseException, as Ctrl-C's KeyboardInterrupt is: code that turns an Exception into its own
    error (a checkpoint that cannot be read is "damaged") must not turn a stop into that error."""


class Early:
    """The stop signals' handler till the run answers them: the first one raises StoppedBeforeTheRun while `armed`
    (main disarms it once prepared); later ones, and one after, are only kept in `signal`: a rank gets SIGTERM from
    torchrun's agent and again from the agent's death, and the second must not cut the first's exit short."""

    def __init__(self):
        self.signal, self.armed = None, True

    def __call__(self, signum, frame):
        first, self.signal = self.signal is None, self.signal or signal.Signals(signum).name
        if first and self.armed:
            raise StoppedBeforeTheRun(self.signal)


@rank_0_speaks
def main(argv=None, exiting=False):
    """exiting: the process ends after main (python train.py), so a stop signal after the run is ignored, not
    answered by the default handler, which would turn a saved run's exit 0 into a kill."""
    stop_when_torchrun_ends()
    # a stop signal before the run answers them is one line, as Ctrl-C is, where the default action killed the
    # process without a word; one the process started ignoring stays ignored (nohup's SIGHUP, `trap '' USR1`). Armed
    # first: the flags' checks build a model for the memory estimate (seconds)
    early = Early()
    original = {sig: signal.signal(sig, early) for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        with ExitStack() as held:  # out_dir's lock, released as main ends, however it ends
            try:
                args = get_args(argv)
                set_deterministic(args.deterministic)  # before the first GEMM; and off, for a run after one with it
                prepared = prepare(args, held, flags.given_flags(argv))
            except (KeyboardInterrupt, StoppedBeforeTheRun) as e:  # nothing to keep yet
                raise stopped_before_the_run(str(e) or "Ctrl-C") from None
            except Exception as e:  # under torchrun: a collective of the setup (the lock, DDP's broadcasts) failed
                if "RANK" in os.environ and lost_a_rank(e):
                    raise lost_in_setup(int(os.environ["RANK"]), e, early.signal) from None
                raise
            finally:  # from here a signal is the run's to answer, or comes while this exit unwinds
                early.armed = False
            run_or_evaluate(args, *prepared, list(original), early)
    finally:  # after the teardown: a second signal must not cut it short
        for sig, handler in original.items():
            signal.signal(sig, signal.SIG_IGN if exiting else handler)


def run_or_evaluate(args, ddp, ckpt, ckpt_path, data, run, answered, early):
    """The stop signals answered (those of `answered`; main restores them; one that came since main's handler was
    disarmed, in `early`, is answered too), then the training run (or --eval_only's evaluation), then the teardown."""
    device, rank, world, master = run.device, run.rank, run.world, run.rank == 0
    val, loader = data

    # ---- a stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2): said at once, then a checkpoint of the last whole
    # update and a clean exit, before the next micro-batch: a scheduler's grace period may be shorter than an update
    # of many micro-batches
    stop = {"signal": None}
    what = "the evaluation" if args.eval_only else \
        "before the next micro-batch (or in the evaluation), with a checkpoint of the last whole update"

    def on_signal(signum, frame):
        first, stop["signal"] = stop["signal"] is None, stop["signal"] or signal.Signals(signum).name
        if master and first:  # os.write: a print here could re-enter a print in progress
            with suppress(OSError):  # stdout's reader gone (`| tee` ended by the same signal): the stop goes on
                os.write(1, f"{signal.Signals(signum).name}: stopping {what}\n".encode())
    for sig in answered:
        signal.signal(sig, on_signal)
    if early.signal:
        on_signal(signal.Signals[early.signal], None)
    try:
        if args.eval_only:
            try:
                result = evaluate(run.raw_model, val, device, rank, world, stop)
            except Exception as e:
                if run.world > 1 and lost_a_rank(e) and not stop["signal"]:
                    raise rank_lost(run.rank, "the evaluation", e, "Run --eval_only again") from None
                if run.world > 1 and lost_a_rank(e):  # signalled, another rank stopped as it set up: this stop
                    result = None
                elif not ran_out_of_memory(e):
                    raise
                else:
                    raise out_of_memory(args, run, "the evaluation", None) from None
            if result is None:
                raise SystemExit(f"stopped by {stop['signal']} in the evaluation: no result; run --eval_only again")
            if master:
                print(f"{ckpt_path} at step {ckpt['step']} | val loss {result[0]:.4f} | val ppl {result[1]:.2f} | "
                      f"{val.tokens:,} validation tokens ({result[2]:,} targets scored, {len(val)} batches)")
        else:
            train(args, run, ckpt, val, loader, stop)
    finally:
        if ddp:  # DDP's reducer (and the per-layer hooks on it) must go before the process group does
            if run.per_layer:
                run.per_layer.remove()
            run = None
            gc.collect()
            dist.destroy_process_group()


def train_loader(args, rank, world, ckpt):
    """This rank's training batches (data.TrainLoader), at the checkpoint's data position; a shard that cannot be read,
    or a data folder that no longer holds what the checkpoint read, is one line naming the fix."""
    try:
        loader = TrainLoader(args.data_dir, args.tokenizer, args.batch_size, max_length=args.max_length,
                             seed=args.seed, rank=rank, world_size=world, pack=args.pack, num_workers=args.workers)
    except (OSError, ValueError) as e:
        raise SystemExit(f"train.py --size {args.size}: {e}") from None
    if ckpt:
        try:
            loader.load_state_dict(ckpt["data"])  # every rank's position; another number of them is regathered
        except ValueError as e:
            raise SystemExit(f"--resume {resume_path(args)}: {e}") from None
        if loader.fixed and rank == 0:
            print(f"training shard(s) {', '.join(loader.fixed)} changed since the checkpoint as the fix of the fault "
                  "that stopped it (its other lines checked): the run goes on with them")
        if (moved := loader.regathered) and rank == 0:
            begun = f", and {moved['begun_again']} of blocks begun, read again whole" if moved["begun_again"] else ""
            print(f"the data goes on from document {moved['document']} of shard {moved['shard']} of pass "
                  f"{moved['epoch']}, the first that no run had trained on, dealt anew to this run's {world} "
                  f"process{'es' * (world > 1)} (the checkpoint's: {moved['processes']}): {moved['seen_again']} "
                  f"documents trained on before come again{begun}, none is left out")
    return loader


def train(args, run, ckpt, val, loader, stop):
    """Exactly num_training_steps updates (from the checkpoint's step on), with logs, evaluations and checkpoints."""
    try:
        loop = Loop(args, run, ckpt, val, loader, stop)  # its first collective: the metrics opened (Keeper)
    except Exception as e:
        if run.world > 1 and lost_a_rank(e):
            raise lost_in_setup(run.rank, e, stop["signal"]) from None
        raise
    batches, syncs = iter(loop.loader), HostSyncs(run.device) if args.sync_debug else None

    def watching(done):  # --sync_debug: the updates between log, eval and save steps, which should never sync
        quiet = done != loop.total and all(done % every for every in (args.log_every, args.eval_every, args.save_every))
        # compiling (on a GPU autotuning syncs) and capturing a CUDA graph: the first update, or with per-layer
        # updates the first two (the second captures, after the first ran eagerly)
        first = 2 if args.cuda_graph and args.per_layer else 1 if args.compile or args.cuda_graph else 0
        quiet = quiet and done > loop.start + first
        return syncs.watch(ops=not args.compile) if syncs and quiet else nullcontext()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    where = f"what the resumed run left at step {loop.start} (its evaluation, or a ReLoRA restart)"
    try:
        if ckpt and ckpt["step"] == ckpt["args"]["num_training_steps"]:  # the run it ends skipped its last restart,
            relora_restart(args, run.raw_model, run.optimizers, ckpt["step"])  # due now that the run goes on
        if ckpt and ckpt.get("eval_pending") and not loop.pending_evaluation():
            return
        for step in range(loop.start, loop.total):
            where = f"update {step + 1}"
            data_state = loop.loader.state_dict()  # where this update's batches begin: a failed read saves this
            micro_batches, fault = read_update(batches, args.gradient_accumulation, run.device, run.world)
            if fault:
                where = f"the checkpoint of update {step}, before the data stopped"
                loop.stop_where_the_data_stopped(step, {**data_state, "fault": loop.loader.fault}, *fault)
            lr = loop.lrs.get_last_lr()[0]  # the one this update makes its step with, read before the step moves it
            with watching(step + 1):
                result = train_step(args, run, micro_batches, stop)
                if result:
                    step_loss, norm, n_total = result
                    loop.keeper.flag(step + 1, step_loss, norm)
                    loop.meter.add(step_loss, n_total)
            if result is None:
                where = f"the checkpoint of update {step}, on a stop signal"
                return loop.stop_within_update(step, data_state)
            where = f"the evaluation or checkpoint after update {step + 1}"
            relora_restart(args, run.raw_model, run.optimizers, step + 1)
            if loop.after_update(step + 1, norm, lr):
                return
        loop.summary()
    except Exception as e:  # a GPU's OutOfMemoryError, also wrapped (torch.compile raises its own error around it)
        if run.world > 1 and lost_a_rank(e):
            good = loop.keeper.last_good
            fix = (f"Nothing since the last checkpoint is kept: {go_on_from(good, args.out_dir)}" if good else
                   f"No checkpoint was saved yet: {START_AGAIN}")
            raise rank_lost(run.rank, where, e, fix) from None
        if not ran_out_of_memory(e):
            raise
        raise out_of_memory(args, run, where, loop.keeper.last_good) from None
    finally:
        batches.close()  # stops the loader's workers now, whatever ended the run
        if syncs and run.rank == 0:
            print(f"sync_debug: {syncs.blocks} update{'s' * (syncs.blocks != 1)} between log steps watched; host "
                  f"syncs: {syncs.summary()}")
        loop.keeper.close()


class Loop:
    """What train() does between updates: the loader (at the checkpoint's data position), the Keeper of metrics and
    checkpoints, the Meter of the loss; after each update the log row, the evaluation, the checkpoint and the stop."""

    def __init__(self, args, run, ckpt, val, loader, stop):
        self.args, self.model, self.val, self.device, self.stop = args, run.raw_model, val, run.device, stop
        rank, world = run.rank, run.world
        self.rank, self.world, self.master, self.lrs = rank, world, rank == 0, run.per_layer or run.scheduler
        self.start, self.total = ckpt["step"] if ckpt else 0, args.num_training_steps
        self.loader, self.epoch = loader, loader.epoch  # the pass over the training shards the data is in
        if ckpt:
            torch.set_rng_state(ckpt["rng"])
        self.keeper = Keeper(args, run, ckpt, val)
        carried = carried_loss(ckpt, rank, world)  # the loss since its last log row
        self.meter, self.last_eval, self.said_slow = Meter(run.device, self.start, self.total, carried), {}, False

    def evaluate(self, done):
        """The evaluation after update `done`, printed and recorded; False if a signal cut it short."""
        if self.device.type == "cuda":  # the updates still queued are training time, not the evaluation's
            torch.cuda.synchronize(self.device)
        t_eval = time.perf_counter()
        result = evaluate(self.model, self.val, self.device, self.rank, self.world, self.stop)  # agrees on a signal
        # finite parameters, yet the loss overflows or explodes (past 2·ln V): diverged too
        if why := result and exploded(result[0], self.keeper.config.vocab_size):
            raise diverged(f"the validation loss after step {done} is {why}", self.keeper.last_good, self.args.out_dir)
        if result:
            if self.master:
                print(f"step {done}/{self.total} | val loss {result[0]:.4f} | val ppl {result[1]:.2f}")
            # val_tokens: the set's size, which a resume with another --eval_tokens changes (analyze.py curves splits
            # a curve there)
            self.last_eval.update(step=done, val_loss=result[0], val_ppl=result[1], val_tokens=result[2])
            self.keeper.record(dict(self.last_eval))
        self.meter.pause(time.perf_counter() - t_eval)
        return result is not None

    def save(self, done, data_state=None, eval_pending=False, again=False):
        data_state = self.loader.state_dict() if data_state is None else data_state
        meter_state = self.meter.state()  # reads the loss, so waits for the device: the update's time stays training
        t_save = time.perf_counter()
        self.keeper.save(done, data_state, eval_pending=eval_pending, meter_state=meter_state, again=again)
        seconds = time.perf_counter() - t_save
        self.meter.pause(seconds)  # minutes at 7b: the next row's tok/s would fall to a fraction
        if seconds > SLOW_SAVE_S and self.master and not self.said_slow:  # a stop on a signal saves too, in its grace
            self.said_slow = True
            print(f"note: writing {self.keeper.path} took {seconds:.1f} s. A stop on a signal writes one too: give the "
                  "job longer than that between SIGTERM and SIGKILL (SLURM's KillWait and torchrun's "
                  "--shutdown_timeout, torch 2.12 on, are 30 s unless raised; before 2.12 torchrun's is a fixed 30 "
                  "s), or signal it earlier (SLURM: --signal=TERM@SECONDS); else that checkpoint is cut short and the "
                  "previous one kept", flush=True)

    def pending_evaluation(self):
        """The evaluation a signal stopped the last run before; False if a signal stops this one there too, or in
        its checkpoint: as in a scheduled save, that stops on it, with no update more and no second write."""
        if not self.evaluate(self.start):
            if self.master:
                print(f"stopped by {self.stop['signal']} in the evaluation of step {self.start}; "
                      f"{go_on_from(self.keeper.last_good, self.args.out_dir)}")
            return False
        self.save(self.start)  # made: a later resume must not make it (and its row) again
        if self.start < self.total and stopping(self.stop, self.world):
            self.say_stopped(self.start, self.stop["signal"])
            return False
        return True

    def stop_where_the_data_stopped(self, step, data_state, why, fix):
        """A bad shard line, or a data loader worker's death, on some rank: every rank keeps the work done so far,
        with the data position where this update began, then the message. A checkpoint of this step already on disk
        (a save or a resume just before) is written again when the position records the line: without that record the
        resume refuses the shard fixed as the message says, as changed since."""
        recorded = self.loader.fault is not None  # on the rank(s) that met the line
        self.save(step, data_state, again=any_rank(recorded) if self.world > 1 else recorded)
        fix = fix.replace("rerun with --resume", self.rerun())
        raise SystemExit(f"{why}\nsaved {self.args.out_dir}/ckpt.pt at step {step}; {fix}" if self.master else 1)

    def rerun(self):
        """The fix a stop names: --resume alone continues the checkpoint in --out_dir; a run that began from another
        (--resume PATH into a new --out_dir) is told this one's path, where its own command line would be refused."""
        mine = os.path.join(self.args.out_dir, "ckpt.pt")
        began_elsewhere = self.args.resume and not same_file(resume_path(self.args), mine)
        return f"rerun with --resume {mine}" if began_elsewhere else "rerun with --resume"

    def stop_within_update(self, step, data_state):
        """A signal between the micro-batches of update step + 1, which is dropped: the checkpoint is that of update
        `step`, with the data position where the dropped update began, so the resumed run does it again whole."""
        self.save(step, data_state)
        if self.master:
            print(f"stopped by {self.stop['signal']} within update {step + 1}, which the resumed run makes again: "
                  f"saved {self.args.out_dir}/ckpt.pt at step {step}; {self.rerun()}")

    def after_update(self, done, norm, lr):
        """Log (the only host syncs of the loop), evaluate, save, stop; True when the run stops here. The row has
        update `done`'s gradient norm and learning rate, and the mean loss since the last row."""
        args = self.args
        if self.loader.epoch != self.epoch:  # a second pass: the documents come again, said as it happens
            self.epoch = self.loader.epoch
            if self.master:
                print(f"note: by update {done} the training data has reached pass {self.epoch + 1} over the shards in "
                      f"{args.data_dir}: each document is seen again, in a new order (fetch more train shards for a "
                      "run that sees each once)", flush=True)
        planned = args.stop_after and done - self.start >= args.stop_after and done < self.total  # same on all ranks
        # stop on a signal where all ranks agree (here, or in evaluation): a later one waits for the next update
        signalled = stopping(self.stop, self.world)
        log_due = done % args.log_every == 0 or done == self.total
        eval_due = done % args.eval_every == 0 or done == self.total
        evaluate_now = eval_due and not signalled  # a signal asks for a quick exit: the resumed run evaluates first
        if log_due or evaluate_now:  # a diverged model is neither logged as if fine, nor evaluated, nor recorded
            self.keeper.check_finite()
        if log_due:
            row = self.meter.row(done, lr, norm, self.world > 1)
            if self.master:
                print(self.meter.line(row), flush=True)
            self.keeper.record(row)
        if evaluate_now:
            signalled = not self.evaluate(done)
        if done % args.save_every == 0 or done == self.total or signalled or planned:
            self.save(done, eval_pending=eval_due and signalled)
            if not (signalled or planned) and done < self.total:  # a signal in the save (tens of seconds at 7b)
                signalled = stopping(self.stop, self.world)  # stops on it: no update more, and no second write
        if signalled or planned:
            self.say_stopped(done, self.stop["signal"] or "--stop_after")
        return signalled or planned

    def say_stopped(self, step, by):
        """The line of a stop on its checkpoint, saved at update `step`."""
        if self.master:
            print(f"stopped by {by}: saved {self.args.out_dir}/ckpt.pt at step {step}; {self.rerun()}")

    def summary(self):
        if self.master:
            elapsed = time.perf_counter() - self.meter.t_start
            rate, ev = fmt_rate(self.meter.tokens_all / elapsed), self.last_eval
            print(f"done: {self.total - self.start} updates in {fmt_time(elapsed)} ({rate} tok/s with evals) | val "
                  f"loss {ev['val_loss']:.4f} | val ppl {ev['val_ppl']:.2f} | checkpoint {self.args.out_dir}/ckpt.pt")


def read_update(batches, accum, device, world):
    """This update's micro-batches (x, y, counted targets), or None and what stopped the read: the file:line message
    of a bad shard line, a full /dev/shm, or a data loader worker's death (the OOM killer's pick, often), each with
    its fix. Under DDP the ranks agree on it (one flag per update, on the host): a rank that stopped alone would
    leave the others waiting in a collective forever."""
    try:
        micro_batches, fault = [on_host(*next(batches), device) for _ in range(accum)], None
    except ValueError as e:
        micro_batches, fault = None, (one_line(e), "after fixing the shard as said, rerun with --resume")
    except SharedMemoryFull as e:
        micro_batches, fault = None, (one_line(e), "rerun with --resume once /dev/shm has room, or add --workers 0")
    except RuntimeError as e:
        if "DataLoader worker" not in str(e):
            raise
        micro_batches, fault = None, (f"{one_line(e)} (killed: out of memory, or by hand?)", "rerun with --resume")
    if world > 1 and any_rank(fault is not None):
        faults = [None] * world
        dist.all_gather_object(faults, fault)  # pickled through gloo, on the host
        fault = ("\n".join(f"rank {r}: {f[0]}" for r, f in enumerate(faults) if f),
                 min(f[1] for f in faults if f))  # "after fixing the shard, ..." first
    return micro_batches, fault


def on_host(x, y, device):
    """A micro-batch as train_step takes it: (x, y, the count of its targets), counted here, on the host. For a GPU,
    x and y in pinned memory: a copy from pageable memory may wait for the GPU to drain (hostsync.py)."""
    if device.type != "cpu":
        x, y = x.pin_memory(), y.pin_memory()
    return x, y, int((y >= 0).sum())


def train_step(args, run, micro_batches, stop=None):
    """One update over the micro-batches (from on_host); returns the update's loss, gradient norm and trained tokens
    (on device). Nothing in it makes the host wait for the device. None if a signal (in stop) came before its last
    micro-batch: then nothing was updated and the gradients so far are dropped."""
    model, per_layer, device, world = run.model, run.per_layer, run.device, run.world
    ddp, accum = world > 1, len(micro_batches)
    # weight each micro-batch by its counted targets over the whole update's, so the gradient is the
    # token-weighted mean over the global batch, whatever the padding, the accumulation or the device count
    counts = [n for _, _, n in micro_batches]
    n_total = torch.full((), float(sum(counts)), device=device, dtype=torch.float64)  # a fill, not a copy
    if ddp:
        dist.all_reduce(n_total)
    step_loss = torch.zeros((), device=device, dtype=torch.float64)
    for i, (x, y, _) in enumerate(micro_batches):
        # a signal stops here, where no parameter has changed yet (per-layer updates step in the last backward);
        # under DDP the ranks agree on it by a host all-reduce per micro-batch after the first, none without them
        if i and stop and stopping(stop, world):
            if per_layer:
                per_layer.reset()
            if run.graph or not per_layer:
                zero_grad(run)
            return None
        last = i == accum - 1
        sync = model.no_sync() if ddp and not last else nullcontext()
        hold = per_layer.accumulating() if per_layer and not last else nullcontext()
        weight = torch.full_like(n_total, counts[i]) / n_total
        if run.graph:  # x and y go from the host into the graph's buffers
            loss = run.graph(x, y, weight, last)
        else:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with sync, hold:
                loss = model(x, y)[1]  # not the logits: held here, they would stay alive through backward
                (loss * (weight * world)).backward()  # DDP averages over ranks; * world makes it a sum
        step_loss += loss.detach().double() * weight
    if per_layer:
        return step_loss, per_layer.grad_norm(), n_total
    max_norm = args.grad_clipping if args.grad_clipping > 0 else float("inf")
    norm = clip_grad_norm32(run.raw_model.parameters(), max_norm)
    run.optimizer.step()
    run.scheduler.step()
    zero_grad(run)
    return step_loss, norm, n_total


def zero_grad(run):
    """The gradients dropped for the next update; under --cuda_graph zeroed in place, where the graph adds to them."""
    if run.graph:
        run.graph.zero_grads()
    else:
        run.optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    # At exit, Python collects once more over every object left, all of which go with the process anyway: torch's
    # modules and, once a memory check or a compile loaded them, its compiler's. Frozen, they are skipped: a tiny run
    # ends about a second sooner on 2 CPU cores (BENCHMARKS.md). Nothing here needs that collection: files are
    # flushed and closed as written, and the data workers end from an atexit hook of their own.
    atexit.register(gc.freeze)
    sys.stdout = Unbroken(sys.stdout)
    try:
        main(exiting=True)
    finally:  # the run has ended, saved or said why: a late signal must not turn the exit into a kill
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
