"""
train.py's command line: every flag and its help line, the paper's recipe for each size, and the checks that refuse
a bad value in one line naming the fix before any work: ranges, flags that exclude each other, the device, the batch
arithmetic (total = micro-batch x accumulation x devices), and whether the run fits in memory.

    python train.py --help
    python -m pytest -q test_train.py test_devices.py      # the refusals are tested there
"""

import argparse
import dataclasses
import json
import math
import os
import re
import sys

import torch

import adam8bit_kernel
import checkpoint
from data import _cpus, empty_path_refusal, load_tokenizer
from devices import cublas_refusal, device_from_flag
from estimate_memory import BLOCK_SIZE, estimate, memory_there
from model import METHODS, SPARSE, LLaMA, SIZES, config_for, length_refusal

# size -> (training steps, warmup steps, peak lr, micro-batch per device on a GPU): §5.1 and the authors' scripts,
# whose warmup is 10% of the steps except 1b's (10k of 140k); another --num_training_steps keeps that share. The
# micro-batches are the scripts' (--batch_size 256, 256, 128, 32, 8; 350m's 128 is also the appendix's "batch size
# = 128 per GPU"); they were 128, 128 and 64 at 60m to 350m, half the scripts', until 2026-12-03
RECIPES = {"tiny": (1000, 100, 3e-3, 16), "60m": (11_000, 1100, 3e-3, 256), "130m": (22_000, 2200, 3e-3, 256),
           "350m": (65_000, 6500, 3e-3, 128), "1b": (140_000, 10_000, 3e-3, 32), "7b": (150_000, 15_000, 5e-4, 8)}
# the baselines' own flags (GaLore's paper and ReLoRA's): their defaults, filled in once the method is known
BASELINES = {"galore_update_gap": 200, "galore_scale": 0.25, "relora_reset": 2000, "relora_warmup": 50,
             "relora_prune": 0.99}
# GaLore's lr and projection gap per size, as its scripts (lr 0.01 and gap 200 up to 1b; its 7b script: 0.005, 500)
GALORE = {size: (5e-3, 500) if size == "7b" else (1e-2, 200) for size in RECIPES}
# the flags one method or optimizer reads, and the fix to name when another run is given them
READ_BY = {"rank": "a --method with factors (lowrank, relora, sltrain, sltrain_ft) or a galore_* --optimizer",
           **dict.fromkeys(("block_size", "adam8bit_kernel"), "an 8-bit --optimizer (adam8bit, galore_adam8bit)"),
           "alpha": "a --method with factors (lowrank, relora, sltrain, sltrain_ft)",
           "delta": "--method sltrain or sltrain_ft",
           **dict.fromkeys(("galore_rank", "galore_update_gap", "galore_scale"), "a galore_* --optimizer"),
           **dict.fromkeys(("relora_reset", "relora_warmup", "relora_prune"), "--method relora")}
BETA_MAX = 0.999999  # the largest --beta1 and --beta2
CPU_MICRO = 16  # micro-batch default on CPU: a 60m model at 16 x 256 tokens needs ~3 GB
# what --eval_only reads: the checkpoint's model (checked against it), where and how it runs, and which validation
# tokens; a training flag given with it is refused, not ignored
EVAL_READS = ("size", "model_config", "method", "rank", "delta", "alpha", "ffn_dim", "dtype", "amp", "compile",
              "device", "batch_size", "max_length", "eval_tokens", "pack", "eval_only", "resume", "out_dir",
              "data_dir", "tokenizer", "download", "packed_support", "deterministic")


# --model_config: the keys of an HF LLaMA config.json (the authors' configs/llama_<size>.json) this repo's model reads,
# as LLaMAConfig's fields; those that must hold this model's own value (any other is another architecture); and
# those that say nothing of the model's weights (HF's runtime, the file's own, token ids the tokenizer has; the
# weights' storage dtype, torch_dtype before transformers 4.56 and dtype since)
CONFIG_KEYS = {"hidden_size": "dim", "intermediate_size": "ffn_dim", "num_attention_heads": "n_heads",
               "num_hidden_layers": "n_layers", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
               "vocab_size": "vocab_size"}
CONFIG_FIXED = {"hidden_act": "silu", "model_type": "llama", "tie_word_embeddings": False, "attention_bias": False,
                "mlp_bias": False, "rope_scaling": None, "pretraining_tp": 1, "initializer_range": 0.02,
                "attention_dropout": 0.0}
CONFIG_IGNORED = ("architectures", "bos_token_id", "eos_token_id", "pad_token_id", "max_sequence_length",
                  "max_position_embeddings", "transformers_version", "use_cache", "torch_dtype", "dtype")

FLOAT32_MAX = torch.finfo(torch.float32).max  # the largest a float flag may be: the step takes it as a float32
INT64_MAX = 2 ** 63 - 1  # the largest a count may be: tensors, torch's sizes and data positions are int64
# the flags that name a file or folder: an empty one is refused, not taken as "none" or the current folder
PATHS = ("resume", "init_from", "model_config", "out_dir", "data_dir", "tokenizer")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every flag's default, except where the help line already says what it is."""

    def _get_help_string(self, action):
        # by identity: `in` compares with ==, and a default of 0.0 (--weight_decay's) equals False
        shown = "default" in action.help or any(action.default is v for v in (None, False, argparse.SUPPRESS))
        return action.help if shown else action.help + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same flags and finds the same fault: local rank 0 says it, once per
    machine (a path may exist on one machine's disk only). A fault of one rank's own (its GPU: not there, or without
    room) is said by that rank: error_here."""

    def error(self, message):
        if not local_rank_0():
            self.exit(2)
        super().error(message)

    def error_here(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def local_rank_0():
    """Whether this process says the faults that every rank meets: local rank 0 under torchrun, or any process
    without it (a LOCAL_RANK that is no number is refused by torchrun_ranks, which every process says)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0
    except ValueError:
        return True


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def torchrun_ranks():
    """(rank, local rank, world size) from the variables torchrun sets, (0, 0, 1) where none is set. A ValueError,
    in one line, where they are set in part or not as torchrun sets them (a job script's leftovers, an export by
    hand): DDP would halve each update in silence, or fail in its rendezvous after the data checks."""
    named = [n for n in TORCHRUN_VARIABLES if n in os.environ]
    if not named:
        return 0, 0, 1
    now = " ".join(f"{n}={os.environ[n]!r}" for n in named)
    if len(named) < len(TORCHRUN_VARIABLES) or not all(os.environ.get(n) for n in ("MASTER_ADDR", "MASTER_PORT")):
        missing = [n for n in TORCHRUN_VARIABLES + ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
        raise ValueError(f"{now} is set without {', '.join(missing)}: torchrun sets them all; start the run with "
                         "torchrun, or unset those variables for one process")
    try:
        rank, local_rank, world = (int(os.environ[n]) for n in TORCHRUN_VARIABLES)
    except ValueError:
        raise ValueError(f"{now}: torchrun sets whole numbers; start the run with torchrun, or unset those variables "
                         "for one process") from None
    if not (world >= 1 and 0 <= local_rank <= rank < world):
        raise ValueError(f"{now}: not a process of a torchrun job (0 <= LOCAL_RANK <= RANK < WORLD_SIZE); start the "
                         "run with torchrun, or unset those variables for one process")
    return rank, local_rank, world


def make_parser(description=None):
    # a flag by its whole name only: argparse's prefixes took --packed as --packed_support, --lora as --lora_alpha
    p = Parser(description=description, formatter_class=HelpFormatter, allow_abbrev=False)
    a = p.add_argument
    a("--size", choices=list(SIZES), help="model size (the paper's LLaMA configs; default 60m)")
    a("--method", "--peft_model", choices=list(METHODS), default="sltrain",
      help="weights: dense, W = s·BA, W = W0 + s·BA with W0 frozen and merged into (ReLoRA), W = s·BA + S, or "
           "fine-tuning a pretrained --init_from: W = W0 + s·BA + S with W0 frozen (only B, A and V learn)")
    a("--rank", type=int, help="rank r of the factors (default: the paper's for the size; sltrain_ft 8)")
    a("--delta", "--sp_ratio", type=float,
      help="sparsity: fraction of entries in S (default 0.03; 7b 0.05; sltrain_ft 0.005)")
    a("--alpha", "--lora_alpha", type=float,
      help="low-rank scale s = alpha/r (default: the paper's for the size; sltrain_ft 32)")
    a("--ffn_dim", type=int, help="width of each MLP's hidden layer (default: the paper's for the size). 1b's, 5461, "
      "is not a multiple of 8, which a GPU's bf16 matmuls run slowly: 5464 takes a 1b step 1.8x (SLTrain) to 2.4x "
      "(full rank) faster on an H200")
    a("--optimizer", default="adamw", choices=["adamw", "adam8bit", "adamw_per_layer", "adam8bit_per_layer",
                                                "galore_adamw", "galore_adam8bit", "galore_adamw_per_layer",
                                                "galore_adam8bit_per_layer"],
      help="optimizer (written from scratch: optim.py, galore.py); *_per_layer is --per_layer; galore_* needs "
           "--method full")
    a("--per_layer", action="store_true", help="update each parameter inside backward and free its gradient")
    a("--block_size", type=int, help="8-bit Adam: entries per block, each block with one float32 scale (default "
      "256, bitsandbytes' since 0.44; before, when the paper's 8-bit runs were made, its blocks were of 2048)")
    a("--adam8bit_kernel", choices=["auto", "on", "off"], help="8-bit Adam on a CUDA GPU: its step as one Triton "
      "kernel per run of tensors (adam8bit_kernel.py) where it can run (default auto), always (on: refused where it "
      "cannot), or never (off: the eager step, or --compile's); the state is the same, so a run resumes under any")
    a("--grad_clipping", type=float, help="clip the global gradient norm to this, 0: off (default: 1.0 at 7b, as its "
      "authors' script, unless --per_layer, which cannot clip globally; else 0)")
    a("--activation_checkpointing", action="store_true", help="recompute each block in backward")
    a("--dtype", choices=["float32", "bfloat16"], help="parameter dtype (default bfloat16 on GPU, float32 on CPU; "
      "--resume and --eval_only take the run's)")
    a("--amp", action="store_true", help="mixed precision: float32 parameters and optimizer state, bf16 autocast "
      "for forward and backward (the default on GPU is the paper's pure bf16)")
    a("--compile", action="store_true", help="torch.compile each transformer block (model.compile_blocks: one "
      "graph for all, per-layer memory kept) and 8-bit Adam's step where its one-kernel GPU step does not run "
      "(adam8bit_kernel.py; on a CPU inductor's code for the step is slower than eager)")
    a("--cuda_graph", action="store_true", help="capture each micro-batch's forward and backward once as a CUDA "
      "graph and replay it (cudagraph.py): the host issues one launch where it issued thousands, so a step bound by "
      "the host runs at the GPU's pace; the optimizer stays eager and the gradients stay allocated between updates; "
      "with --per_layer the last micro-batch's updates are replayed too, from the second update on. One CUDA GPU")
    a("--sync_debug", action="store_true", help="count the host syncs of the updates between log steps (there "
      "should be none; hostsync.py; under --compile or --cuda_graph not the first update, which compiles or "
      "captures, and under --cuda_graph --per_layer not the first two) and print them at the end")
    a("--deterministic", action="store_true", help="torch's deterministic algorithms and cuBLAS's fixed workspace "
      "(devices.set_deterministic), so that on a GPU, where scatters and GEMMs may otherwise add in any order, the "
      "same flags give the same numbers run after run and across a resume; at some speed (a scatter sorts its "
      "indices). A CPU run is so without it")
    a("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda (the local rank's GPU) or cuda:N")
    a("--lr", type=float, help=f"peak learning rate (default {RECIPES['60m'][2]:g}, 7b {RECIPES['7b'][2]:g}; a "
      f"galore_* --optimizer: GaLore's {GALORE['60m'][0]:g}, 7b {GALORE['7b'][0]:g})")
    a("--batch_size", type=int, help="sequences per device per micro-batch (default: the size's GPU micro-batch, "
      f"at most {CPU_MICRO} on CPU)")
    a("--total_batch_size", type=int, default=512, help="sequences per update, over all devices and micro-batches")
    a("--gradient_accumulation", type=int, help="micro-batches per update (default: derived)")
    a("--max_length", type=int, default=256, help="tokens per sequence")
    a("--num_training_steps", type=int, help="optimizer updates (default: the paper's for the size)")
    a("--warmup_steps", type=int, help="linear warmup updates (default: the size's share of the steps, 10%% "
      "but 1b's 1/14 as in the authors' scripts, for ReLoRA at most --relora_reset; on resume, the run's)")
    a("--min_lr_ratio", type=float, default=0.1, help="the cosine schedule ends at this fraction of --lr")
    a("--scheduler", default="cosine", choices=["cosine"], help="learning-rate schedule (warmup, then cosine)")
    a("--weight_decay", type=float, default=0.0, help="decoupled weight decay")
    a("--beta1", type=float, default=0.9, help="Adam beta1")
    a("--beta2", type=float, default=0.999, help="Adam beta2")
    a("--eval_every", type=int, default=1000, help="evaluate validation perplexity every this many updates")
    a("--eval_tokens", type=int, default=10_000_000, help="validation tokens (the first N of the validation shards)")
    a("--eval_only", action="store_true", help="evaluate the --resume checkpoint (default out_dir/ckpt.pt) and exit")
    a("--save_every", type=int, default=1000, help="write a checkpoint every this many updates")
    a("--out_dir", "--save_dir", default="out", help="checkpoint and metrics.jsonl folder")
    a("--resume", "--continue_from", nargs="?", const="auto",
      help="continue from a checkpoint, or the ckpt.pt in a folder (default out_dir/ckpt.pt)")
    a("--overwrite", action="store_true", help="replace a checkpoint already in out_dir: start afresh, or continue "
      "another run's --resume PATH there")
    a("--stop_after", type=int, help="end this run after this many updates, with a checkpoint (job time limits)")
    a("--data_dir", default="data/c4", help="folder of C4 shards (c4-train.*.json.gz, c4-validation.*.json.gz)")
    a("--tokenizer", default="data/t5_spiece.model", help="sentencepiece model (T5's: 32000 pieces)")
    a("--download", action="store_true", help="fetch missing C4 shards and the T5 tokenizer first")
    a("--pack", action="store_true", help="pack documents into full windows (default: the paper's padding)")
    a("--workers", type=int, default=1, help="data loader worker processes (0: load in the main process)")
    a("--log_every", type=int, default=10, help="print and record a log line every this many updates")
    a("--seed", type=int, default=42, help="seed for initialization, support and data order")
    a("--model_config", help="the authors' configs/llama_<size>.json: sets --size, and where the file is here its "
      "contents are read: the shape must be the size's, intermediate_size sets --ffn_dim, vocab_size must be the "
      "tokenizer's, and a key of another architecture is refused (a path not here is taken by its name)")
    a("--init_from", help="start a lowrank/sltrain model at a full-rank checkpoint: s·BA = its best rank-r "
      "approximation, S = the residual on the support (analyze.py); sltrain_ft: W0 = its weights, B = 0, V = 0; "
      "full: its weights (full-rank fine-tuning, also with a GaLore optimizer). "
      "A resumed run does not need it: its start is in its checkpoint")
    a("--support", default="random", choices=["random", "top"],
      help="with --init_from: the sparse support random as usual, or the largest entries of the residual")
    a("--freeze", choices=["lowrank"],
      help="train only the sparse values V: B, A (with --init_from: L0), embeddings, norms and head stay")
    a("--support_seed", type=int, help="draw the sparse supports from this seed, apart from --seed (Figure 4)")
    a("--packed_support", action="store_true", help="store each sparse support packed, about 1.1 bytes a position "
      "where int32 takes 4 (7b: 0.35 G in place of 1.30 G), unpacked at each use: a few small kernels more per "
      "layer per pass")
    a("--galore_rank", type=int, help="GaLore: rank of the gradient projection (default: --rank, the size's)")
    a("--galore_update_gap", type=int,
      help=f"GaLore: recompute each projection every this many updates (default {BASELINES['galore_update_gap']}; "
      f"7b {GALORE['7b'][1]}, as GaLore's scripts)")
    a("--galore_scale", type=float, help=f"GaLore: scale of the update projected back (default "
      f"{BASELINES['galore_scale']})")
    a("--relora_reset", type=int, help=f"ReLoRA: merge BA into W0 and restart every this many updates (default "
      f"{BASELINES['relora_reset']})")
    a("--relora_warmup", type=int, help=f"ReLoRA: updates of linear lr warmup after each restart (default "
      f"{BASELINES['relora_warmup']})")
    a("--relora_prune", type=float, help="ReLoRA: fraction of the restarted factors' Adam moments zeroed, smallest "
      f"magnitudes first (default {BASELINES['relora_prune']})")
    return p


def get_args(argv=None, description=None):
    """The flags, every one checked here before any work: a bad value is one line naming the fix. description:
    --help's text above the flags (train.py's usage)."""
    p = make_parser(description)
    args = p.parse_args(argv)
    try:
        torchrun_ranks()
    except ValueError as e:
        p.error_here(str(e))  # every process says it: the rank it would be said by is in doubt
    # "$CKPT" of an unset variable: --resume "" trained afresh, with --overwrite over the run
    if refusal := empty_path_refusal(args, ["--" + name for name in PATHS]):
        p.error(refusal)
    # --model_config sets --size, and the MLP's width where its file holds an intermediate_size
    width_from_file = bool(args.model_config) and check_model_config(p, args) is not None
    args.size = args.size or "60m"
    if args.eval_only:
        given = [name for name in given_flags(argv) if name not in EVAL_READS]
        if given:
            p.error(f"{', '.join('--' + name for name in given)}: not read by --eval_only, which evaluates the "
                    f"checkpoint's model on the validation tokens; drop {'them' if len(given) > 1 else 'it'}")
    drop_per_layer = "drop --per_layer"  # the fix where per-layer updates are refused: the flag that asked for them
    if args.optimizer.endswith("_per_layer"):
        drop_per_layer = f"pass --optimizer {args.optimizer[: -len('_per_layer')]}" + \
            (" without --per_layer" if args.per_layer else "")
        args.optimizer, args.per_layer = args.optimizer[: -len("_per_layer")], True
    steps, _, lr, _ = RECIPES[args.size]
    args.num_training_steps = steps if args.num_training_steps is None else args.num_training_steps
    galore = args.optimizer.startswith("galore")
    args.lr = (GALORE[args.size][0] if galore else lr) if args.lr is None else args.lr
    check_ranges(p, args)
    # a resume checks it once the run's own --num_training_steps is known (train.load_for_resume)
    if args.warmup_steps is not None and args.warmup_steps > args.num_training_steps and not args.resume:
        p.error(f"--warmup_steps must be in [0, {args.num_training_steps}], got {args.warmup_steps}")
    if args.per_layer and args.grad_clipping:
        p.error("--per_layer updates each parameter during backward, before the global gradient norm exists: "
                f"drop --grad_clipping or {drop_per_layer}")
    if args.cuda_graph and args.per_layer and args.optimizer.startswith("galore"):
        p.error("--cuda_graph --per_layer replays each update, and GaLore's projector is remade on the host every "
                "--galore_update_gap updates: drop --cuda_graph, or use --optimizer adamw or adam8bit")
    if args.grad_clipping is None:  # the authors clip at 7b alone (their 7b script; the others do not)
        args.grad_clipping = 1.0 if args.size == "7b" and not args.per_layer else 0.0
    starting = not (args.resume or args.eval_only)  # a resumed or evaluated run has its start in its checkpoint
    if args.init_from:  # a run's folder names its ckpt.pt, as for --resume and the other tools
        args.init_from = checkpoint.checkpoint_file(args.init_from)
    if args.init_from and args.method == "relora":
        p.error("--init_from starts a full, lowrank, sltrain or sltrain_ft model at a full-rank checkpoint; ReLoRA "
                "starts from its own: pass --method sltrain or lowrank, or drop --init_from")
    if args.init_from and starting and not os.path.isfile(args.init_from):
        p.error(f"--init_from {args.init_from}: no checkpoint there; pass a full-rank ckpt.pt (train.py --method full, "
                "or export.py --merged of any run), or the --out_dir holding one")
    if args.method == "sltrain_ft" and not args.init_from and starting:
        p.error("--method sltrain_ft fine-tunes a pretrained model: pass --init_from with its full-rank checkpoint "
                "(train.py --method full, or export.py --merged of any run)")
    if args.support == "top" and not ((args.init_from or not starting) and args.method == "sltrain"):
        p.error("--support top picks the residual's largest entries: it needs --init_from and --method sltrain")
    if args.support == "top" and args.support_seed is not None:
        p.error("--support top picks the residual's largest entries, and --support_seed draws random ones: drop one")
    if args.freeze and args.method != "sltrain":
        p.error("--freeze lowrank trains only the sparse values: it needs --method sltrain")
    if args.support_seed is not None and args.method not in SPARSE:
        p.error(f"--support_seed draws the sparse supports: it needs --method sltrain or sltrain_ft, not "
                f"{args.method}")
    if args.packed_support and args.method not in SPARSE:
        p.error(f"--packed_support stores the sparse supports: it needs --method sltrain or sltrain_ft, not "
                f"{args.method}")
    refusal = args.deterministic and cublas_refusal()
    if refusal:
        p.error(refusal)
    if args.amp and args.dtype == "bfloat16":
        p.error("--amp keeps float32 parameters and computes in bf16 under autocast: drop --dtype bfloat16")
    if args.resume and args.overwrite and same_file(resume_path(args), os.path.join(args.out_dir, "ckpt.pt")):
        p.error("--resume continues the checkpoint in --out_dir and --overwrite replaces it: drop one of them")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.error(f"--out_dir {args.out_dir} is a file: pass a folder")
    if same_file(args.out_dir, args.data_dir) and not args.eval_only:  # data.SHARD_GLOBS would take metrics.jsonl
        p.error(f"--out_dir {args.out_dir} is --data_dir too: the run's metrics.jsonl would be read as a shard, and "
                "the data folder would hold checkpoints; pass another --out_dir")
    if args.init_from and not args.eval_only and same_file(args.init_from, os.path.join(args.out_dir, "ckpt.pt")):
        p.error(f"--init_from {args.init_from} is the checkpoint in --out_dir {args.out_dir}, which this run's own "
                "checkpoints replace: pass another --out_dir (or start from a copy)")
    # --resume PATH names what is evaluated; a bare --resume, --out_dir's ckpt.pt
    if args.eval_only and args.resume not in (None, "auto") and "out_dir" in given_flags(argv):
        p.error(f"--eval_only evaluates --resume's checkpoint ({resume_path(args)}) and writes nothing: drop "
                "--out_dir, or drop --resume's path to evaluate --out_dir's")
    given = [name for name in unused_flags(args.method, args.optimizer) if getattr(args, name) is not None]
    if given:
        fixes = " or ".join(dict.fromkeys(READ_BY[name] for name in given))
        p.error(f"{', '.join('--' + name for name in given)}: not read by --method {args.method} with --optimizer "
                f"{args.optimizer}; drop {'them' if len(given) > 1 else 'it'}, or pass {fixes}")
    if args.optimizer.endswith("adam8bit"):
        args.block_size = BLOCK_SIZE if args.block_size is None else args.block_size
        if args.block_size < 1:
            p.error(f"--block_size must be >= 1, got {args.block_size}")
    rank_given, alpha_given = args.rank, args.alpha  # (None where not given: config_for gives the size's)
    try:
        model_config = config_for(args.size, method=args.method, rank=args.rank, alpha=args.alpha, delta=args.delta,
                                  ffn_dim=args.ffn_dim)
        check_rank(p, args, model_config, width_from_file)
        largest = max(t.numel() for t in LLaMA(model_config, device="meta").parameters())  # (and checks rank and
    except ValueError as e:  # delta against every layer shape, for free)
        p.error(str(e))
    if args.optimizer.endswith("adam8bit") and args.block_size > largest:  # each moment pads to whole blocks
        p.error(f"--block_size {args.block_size} is larger than any tensor of the {args.size} model (the largest has "
                f"{largest:,} entries), and each tensor's 8-bit moments fill whole blocks: pass at most {largest}")
    args.rank, args.alpha, args.delta = model_config.rank, model_config.alpha, model_config.delta
    args.ffn_dim = model_config.ffn_dim
    check_removed_parts(p, args, alpha_given)
    check_baseline_flags(p, args, model_config, rank_given)
    resolve_device_and_batch(p, args)
    check_adam8bit_kernel(p, args)
    if args.warmup_steps is None and not args.resume:  # a resumed run keeps its own warmup
        steps, warmup, _, _ = RECIPES[args.size]
        args.warmup_steps = args.num_training_steps * warmup // steps
        if args.method == "relora":  # its first warmup ends by its first restart (see check_baseline_flags)
            args.warmup_steps = min(args.warmup_steps, args.relora_reset)
    args.lr_restart = None  # set on a resume that raised --num_training_steps: see lr_lambda_for
    return args


def check_removed_parts(p, args, alpha_given):
    """A flag of the sparse part refused where --delta 0 removes it, and --alpha (as given) where --rank 0 removes
    the factors: each would be taken and do nothing."""
    if args.freeze and args.delta == 0:
        p.error("--freeze lowrank trains only the sparse values, which --delta 0 removes: pass a --delta above 0, or "
                "drop --freeze")
    for name in ("packed_support", "support_seed", "support"):  # each is of the supports
        if args.delta == 0 and getattr(args, name) not in (None, False, "random"):
            p.error(f"--{name} is of the sparse supports, which --delta 0 removes: pass a --delta above 0, or drop "
                    f"--{name}")
    if args.rank == 0 and alpha_given is not None and args.method in SPARSE:
        p.error("--alpha scales the low-rank factors, which --rank 0 removes (S alone): pass a --rank above 0, or "
                "drop --alpha")


def check_ranges(p, args):
    """Each number within its range: counts positive (or >= 0) and at most int64's, floats at most float32's (NaN
    refused), seeds 64-bit, the betas in [0, BETA_MAX], --min_lr_ratio in [0, 1], --workers at most the CPUs,
    --max_length in [2, 2^24]."""
    positive = ("num_training_steps", "eval_every", "save_every", "log_every", "total_batch_size", "eval_tokens",
                "lr", "alpha", "batch_size", "gradient_accumulation", "stop_after", "ffn_dim", "galore_scale")
    # a float flag becomes a float32 in the step: inf, nan or beyond float32's range would be inf there; a count
    # becomes an int64 (a tensor's size, a data position): beyond it torch overflows
    top = lambda v: FLOAT32_MAX if isinstance(v, float) else INT64_MAX  # noqa: E731
    bound = lambda v: f" and at most {FLOAT32_MAX:.3g}" if isinstance(v, float) else " and at most 2^63 - 1"  # noqa
    for name in positive:
        value = getattr(args, name)
        if value is not None and not 0 < value <= top(value):  # `not <` refuses NaN
            p.error(f"--{name} must be positive{bound(value)}, got {value}")
    for name in ("grad_clipping", "weight_decay", "workers", "warmup_steps"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= top(value):
            p.error(f"--{name} must be >= 0{bound(value)}, got {value}")
    if args.workers > _cpus():  # each a process reading shards: more than the CPUs only crowd them (those this
        # process may run on, as data.py counts them: a container's or a scheduler's share, not the machine's)
        p.error(f"--workers must be at most {_cpus()}, the CPUs this process may use, got {args.workers}")
    for name in ("seed", "support_seed"):  # torch's generators take a 64-bit seed
        if getattr(args, name) is not None and not 0 <= getattr(args, name) < 2 ** 63:
            p.error(f"--{name} must be in [0, 2^63), got {getattr(args, name)}")
    if not 0 <= args.min_lr_ratio <= 1:
        p.error(f"--min_lr_ratio must be in [0, 1], got {args.min_lr_ratio}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) <= BETA_MAX:
            p.error(f"--{name} must be in [0, {BETA_MAX}] (closer to 1, a moment averages over more than a million "
                    f"updates, longer than any run), got {getattr(args, name)}")
    if args.max_length < 2:
        p.error(f"--max_length must be at least 2 (an input token and its target), got {args.max_length}")
    if refusal := length_refusal(args.max_length):
        p.error(refusal)


def read_model_config(path, size):
    """The LLaMAConfig fields that the HF LLaMA config.json at path sets (CONFIG_KEYS); a ValueError, in one line, for
    a file that is not one, a key of another architecture, or a shape other than the size's (the paper's sizes are
    what this repo builds: model.SIZES)."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot be read as JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"holds a JSON {type(hf).__name__}, not a config's object")
    own = dataclasses.asdict(config_for(size))
    fixed = dict(CONFIG_FIXED, num_key_value_heads=own["n_heads"], head_dim=own["dim"] // own["n_heads"])
    unknown = [k for k in hf if k not in CONFIG_KEYS and k not in fixed and k not in CONFIG_IGNORED]
    if unknown:
        them = "them" if len(unknown) > 1 else "it"
        raise ValueError(f"{', '.join(unknown)}: not read by this repo's LLaMA; remove {them}, or use a model that "
                         f"reads {them}")
    for key, field in CONFIG_KEYS.items():  # the shape is the size's; the MLP width and vocabulary are the file's
        value = hf.get(key, own[field])
        if field in ("ffn_dim", "vocab_size") and not (isinstance(value, int) and value > 0):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if field not in ("ffn_dim", "vocab_size") and value != own[field]:
            raise ValueError(f"{key} {value!r}, where size {size} has {own[field]!r}: this repo builds the paper's "
                             "sizes (model.SIZES; --ffn_dim sets the MLP's width)")
    for key, value in hf.items():
        if key in fixed and value != fixed[key]:
            raise ValueError(f"{key} {value!r}: this repo's LLaMA has {fixed[key]!r} (a model it does not build)")
    return {field: hf[key] for key, field in CONFIG_KEYS.items() if key in hf}


def check_model_config(p, args):
    """--model_config: its name sets --size (configs/llama_<size>.json); where the file is here it is read
    (read_model_config): its intermediate_size is --ffn_dim's (the two disagreeing are refused); its vocab_size is
    checked against the tokenizer by train.py, once that is loaded. Returns the file's intermediate_size, or None
    (none in it, or no file here)."""
    m = re.search(r"llama_(\w+)\.json$", args.model_config)
    if not m or m.group(1) not in SIZES:
        p.error(f"--model_config {args.model_config}: expected configs/llama_<size>.json with size in {list(SIZES)}")
    if args.size not in (None, m.group(1)):
        p.error(f"--model_config {args.model_config} is size {m.group(1)}, --size says {args.size}: drop one")
    args.size = m.group(1)
    if not os.path.exists(args.model_config):  # the authors' command lines name their own configs/ folder
        return None
    try:
        fields = read_model_config(args.model_config, args.size)
    except ValueError as e:
        p.error(f"--model_config {args.model_config}: {e}")
    ffn_dim = fields.get("ffn_dim")
    if None not in (ffn_dim, args.ffn_dim) and ffn_dim != args.ffn_dim:
        p.error(f"--model_config {args.model_config} has intermediate_size {ffn_dim}, --ffn_dim says {args.ffn_dim}: "
                "drop one")
    args.ffn_dim = args.ffn_dim if ffn_dim is None else ffn_dim
    return ffn_dim


def model_config_refusal(args, vocab_size):
    """train.py's check, once the tokenizer is loaded (or, where there is none yet, before --download fetches T5's),
    that --model_config's vocab_size is its size; None if so."""
    if not (args.model_config and os.path.exists(args.model_config)):
        return None
    want = read_model_config(args.model_config, args.size).get("vocab_size", vocab_size)
    tokenizer = f"the tokenizer {args.tokenizer}" if os.path.exists(args.tokenizer) else \
        f"T5's tokenizer, which --download fetches to {args.tokenizer},"  # (train.setup asks before it does)
    if want != vocab_size:
        return (f"--model_config {args.model_config} has vocab_size {want}, and {tokenizer} has {vocab_size} "
                "pieces: pass the tokenizer the config was made for, or a config of its size")
    return None


def given_flags(argv=None):
    """The flags on the command line (their dest names, in the parser's order), whatever their values."""
    p, unset = make_parser(), object()
    every = vars(p.parse_args(argv))
    seen = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(every, unset)))  # defaults fill only what is absent
    return [name for name in every if getattr(seen, name) is not unset]


def unused_flags(method, optimizer):
    """The flags of READ_BY that this method and optimizer do not read, in READ_BY's order: refused when given, and
    not compared on resume (a run from before the refusal may have stored a value for them)."""
    galore = optimizer.startswith("galore")
    read = {"rank", "alpha"} if method != "full" else {"rank"} if galore else set()
    read |= {"delta"} if method in SPARSE else set()
    read |= {"galore_rank", "galore_update_gap", "galore_scale"} if galore else set()
    read |= {"block_size", "adam8bit_kernel"} if optimizer.endswith("adam8bit") else set()
    read |= {"relora_reset", "relora_warmup", "relora_prune"} if method == "relora" else set()
    return [name for name in READ_BY if name not in read]


def check_baseline_flags(p, args, config, rank_given=None):
    """GaLore's and ReLoRA's flags (the baselines of Table 2). GaLore's rank is --galore_rank, or --rank (the
    authors' name for it), or the size's rank; rank_given: --rank as given, None if not."""
    galore = args.optimizer.startswith("galore")
    relora_given = [name for name in ("relora_reset", "relora_warmup", "relora_prune")
                    if getattr(args, name) is not None]
    if galore and None not in (rank_given, args.galore_rank) and rank_given != args.galore_rank:
        p.error(f"--rank {rank_given} and --galore_rank {args.galore_rank}: both set GaLore's projection rank; drop "
                "one")
    rank_flag = "--galore_rank" if args.galore_rank is not None else "--rank"
    for name, default in dict(BASELINES, galore_update_gap=GALORE[args.size][1]).items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    args.galore_rank = args.rank if args.galore_rank is None else args.galore_rank  # an explicit 0 is refused below
    if galore and args.method != "full":
        p.error(f"--optimizer {args.optimizer} projects the gradients of full-rank weights: pass --method full")
    if galore and not 0 < args.galore_rank <= min(config.dim, config.ffn_dim):
        p.error(f"{rank_flag} (GaLore's rank) must be in [1, {min(config.dim, config.ffn_dim)}], got "
                f"{args.galore_rank}")
    for name, least in (("galore_update_gap", 1), ("relora_reset", 1), ("relora_warmup", 0)):
        if getattr(args, name) < least:  # the one given, named (a line naming all three left which to find)
            p.error(f"--{name} must be at least {least}, got {getattr(args, name)}")
    if args.method == "relora" and args.relora_warmup >= args.relora_reset:  # else no jag ever reaches the cosine
        p.error(f"--relora_warmup {args.relora_warmup} must be shorter than --relora_reset {args.relora_reset}: each "
                "restart's warmup ends before the next restart, else the learning rate never climbs back to the "
                "cosine; pass a smaller --relora_warmup")
    if args.method == "relora" and args.warmup_steps is not None and args.warmup_steps > args.relora_reset:
        # ReLoRA's scheduler, and the SLTrain authors', assert it: a restart within the warmup would merge, prune the
        # moments and start a jag while the learning rate is still climbing to its peak
        p.error(f"--warmup_steps {args.warmup_steps} is longer than --relora_reset {args.relora_reset}: ReLoRA's "
                "first restart comes after its warmup; pass a --warmup_steps of at most "
                f"{args.relora_reset}, or a --relora_reset of at least {args.warmup_steps}")
    if not 0 <= args.relora_prune <= 1:
        p.error(f"--relora_prune must be in [0, 1], got {args.relora_prune}")
    if args.method == "relora" and relora_given and not args.resume and args.relora_reset >= args.num_training_steps:
        p.error(f"{', '.join('--' + name for name in relora_given)}: --relora_reset {args.relora_reset} restarts "
                f"nothing in a run of {args.num_training_steps} updates; pass a --relora_reset below "
                "--num_training_steps, or drop them")
    for name in set(unused_flags(args.method, args.optimizer)) & {"galore_rank", *BASELINES}:
        setattr(args, name, None)  # a run records the baselines' settings only where it is one


def check_rank(p, args, config, width_from_file=False):
    """The factors' rank below the narrowest projection's width, refused naming the flags that set each (each layer's
    own check names neither): the MLP's width is --ffn_dim's, or the size's, unless width_from_file (--model_config's
    intermediate_size). Full rank has no factors; GaLore's rank is checked with its flags."""
    narrowest = min(config.dim, config.ffn_dim)
    if config.method == "full" or config.rank < narrowest:
        return
    rank = f"--rank {config.rank}" if args.rank is not None else f"--size {args.size}'s rank, {config.rank},"
    wider = "" if config.ffn_dim >= config.dim else \
        f" or a larger intermediate_size in {args.model_config}" if width_from_file else " or a larger --ffn_dim"
    p.error(f"{rank} must be below min(dim {config.dim}, ffn_dim {config.ffn_dim}) = {narrowest}, every projection's "
            f"smaller side: pass a smaller --rank{wider}")


def check_adam8bit_kernel(p, args):
    """--adam8bit_kernel: auto by default for an 8-bit optimizer; `on` refused where the kernel cannot run."""
    if not args.optimizer.endswith("adam8bit"):
        return
    args.adam8bit_kernel = args.adam8bit_kernel or "auto"
    device = torch.device(args.device)
    reason = args.adam8bit_kernel == "on" and adam8bit_kernel.why_not(device, getattr(torch, run_dtype(args, device)),
                                                                      args.block_size)
    if reason:
        p.error(f"--adam8bit_kernel on: the one-kernel 8-bit step cannot run here: {reason}; pass --adam8bit_kernel "
                "auto (the kernel where it can run) or off")


def resolve_device_and_batch(p, args):
    """The device, then the batch arithmetic (total = batch_size x accumulation x world, exactly), then memory."""
    _, local_rank, world = torchrun_ranks()  # checked in get_args
    if args.cuda_graph and world > 1:
        p.error("--cuda_graph is for one process: DDP's all-reduce inside a captured backward is not supported "
                "here; drop --cuda_graph under torchrun")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device_from_flag(p.error, args.device, "auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        device = cuda_device(p, args, device, local_rank)
    check_bf16_decay(p, args, device)
    if args.cuda_graph and device.type != "cuda":
        p.error(f"--cuda_graph needs a CUDA GPU; --device is {device}: drop --cuda_graph")
    micro = RECIPES[args.size][3] if device.type == "cuda" else CPU_MICRO  # the size's usual micro-batch
    if args.eval_only:  # the validation tokens are the same at any batch size (data.validation_batches)
        args.batch_size = micro if args.batch_size is None else args.batch_size
        args.total_batch_size = args.gradient_accumulation = None  # no update
        return  # its memory is checked once it has taken the run's own length and dtype (train.eval_settings)
    if args.resume and args.total_batch_size % world:  # the fixes below name a --total_batch_size, which a resume
        shares = [n for n in range(1, 2 * world + 1) if args.total_batch_size % n == 0]  # refuses as another run's
        counts = " or ".join(str(n) for n in (max(n for n in shares if n < world),
                                              min((n for n in shares if n > world), default=None)) if n)
        p.error(f"--resume on {world} processes: the run's update of --total_batch_size {args.total_batch_size} "
                f"sequences, which a resume keeps, does not split into {world} equal shares; resume on {counts} "
                "processes")
    accumulation, batch = args.gradient_accumulation, args.batch_size
    if accumulation is not None and batch is not None and batch * accumulation * world != args.total_batch_size:
        # the total they make; or the total alone, where it divides into micro-batches of that accumulation
        also = " or drop --batch_size" if args.total_batch_size % (accumulation * world) == 0 else ""
        fix = f"pass --total_batch_size {batch * accumulation * world}{also}"
        if args.resume:  # the run's update stays (a job requeued on other processes): the accumulation adapts to it
            fixes = [f"drop --{flag}" for flag, kept in (("gradient_accumulation", batch), ("batch_size", accumulation))
                     if args.total_batch_size % (kept * world) == 0]
            fix = " or ".join(fixes) or "drop --gradient_accumulation and --batch_size"
        p.error(f"--gradient_accumulation {accumulation} x --batch_size {batch} x {world} devices = "
                f"{batch * accumulation * world}, not --total_batch_size {args.total_batch_size}; {fix}")
    if accumulation is not None and args.total_batch_size % (accumulation * world):  # no micro-batch size fits
        total = -(-args.total_batch_size // (accumulation * world)) * accumulation * world  # the next multiple up
        fix = "drop --gradient_accumulation, or pass one" if args.resume else \
            f"pass --total_batch_size {total}, or a --gradient_accumulation"  # a resume keeps the run's update
        p.error(f"--total_batch_size {args.total_batch_size} is not a multiple of --gradient_accumulation "
                f"{accumulation} x {world} devices; {fix} that divides it")
    if args.batch_size is None:
        args.batch_size = args.total_batch_size // (world * (accumulation or 1))
        if accumulation is None:  # the size's usual micro-batch (smaller on CPU), accumulating the rest
            args.batch_size = max(1, min(args.batch_size, micro))
        if accumulation is None and args.resume:  # a default the user never gave: the resume takes the run's own
            # micro-batch where that still divides the update (train.resume_settings), else the largest up to this
            # default that does, not a refusal of the default (the update splits over these processes: checked above)
            args.batch_size = next(b for b in range(args.batch_size, 0, -1) if args.total_batch_size % (b * world) == 0)
    per_micro = args.batch_size * world
    if args.total_batch_size % per_micro:
        fits = next((b for b in range(args.batch_size - 1, 0, -1) if args.total_batch_size % (b * world) == 0), None)
        total = -(-args.total_batch_size // per_micro) * per_micro  # the next multiple up
        fix = f"--batch_size {fits} or --total_batch_size {total}" if fits else f"--total_batch_size {total}"
        if args.resume:  # a resume keeps the run's update; 1 always divides it (and the update splits: checked above)
            fix = f"--batch_size {fits}, or drop --batch_size"
        default = "" if batch is not None else " (the default)"  # not a value the user gave
        p.error(f"--total_batch_size {args.total_batch_size} is not a multiple of --batch_size {args.batch_size}"
                f"{default} x {world} devices; pass {fix}")
    args.gradient_accumulation = args.total_batch_size // per_micro
    if not args.resume:  # a resume is checked once it has taken the run's own batch and dtype (load_for_resume)
        check_memory(p, args, device, world, vocabulary(args), accumulation_given=accumulation is not None)


def vocabulary(args):
    """A new run's number of pieces, which its embeddings, output head and logits are as wide as: the tokenizer's at
    --tokenizer, or None (T5's 32000, the one --download fetches) where none is there yet or it cannot be read, which
    train.py refuses on its own, naming the fix. A resume's or evaluation's is its checkpoint's, the same (checked)."""
    try:
        return load_tokenizer(args.tokenizer, args.data_dir).get_piece_size()
    except (OSError, ValueError):
        return None


def run_dtype(args, device):
    """--dtype, or its default: bf16 on a GPU (the paper's pure bf16), float32 on a CPU or under --amp."""
    return args.dtype or ("bfloat16" if device.type == "cuda" and not args.amp else "float32")


def check_bf16_decay(p, args, device):
    """Refuse a --weight_decay that bf16 parameters cannot take. Every optimizer here decays as torch's AdamW does, by
    a multiply of its own, w·(1 - lr·wd), rounded to the parameter's dtype; in bf16, for lr·wd < 2⁻⁹ (half a step of
    bf16's 8-bit significand, relative to any weight) that rounds back to w: nothing decays, at any weight, ever
    (the schedule only lowers lr). --amp keeps float32 parameters, where it does decay. A resume is asked once its
    checkpoint gives the run's own dtype (train.load_for_resume): a float32 run goes on in float32 on a GPU too."""
    if args.resume:
        return
    refusal = bf16_decay_refusal(args, run_dtype(args, device))
    if refusal:
        p.error(refusal)


def bf16_decay_refusal(args, dtype, resuming=False):
    """check_bf16_decay's refusal for parameters of dtype, or None; train.py asks again once a resume has taken the
    run's own dtype, lr and weight decay (resuming: a bf16 run cannot take --amp, whose parameters are float32)."""
    if dtype == "bfloat16" and not args.eval_only and args.weight_decay and args.lr * args.weight_decay < 2 ** -9:
        least = 2 ** -9 / args.lr  # the smallest decay that acts, rounded up to 3 digits
        digits = 2 - math.floor(math.log10(least))
        amp = "--amp in place of --dtype bfloat16" if args.dtype == "bfloat16" else "--amp"  # both: refused
        fix = (f"the run's parameters stay bf16 (--amp's are float32, another dtype): pass --weight_decay 0, or one "
               f"of at least {math.ceil(least * 10 ** digits) / 10 ** digits:g} at --lr {args.lr:g}") if resuming else \
            f"pass {amp} (float32 parameters, bf16 compute) to decay, or --weight_decay 0"
        return (f"--weight_decay {args.weight_decay} with bf16 parameters: its decay per update, lr x weight_decay = "
                f"{args.lr * args.weight_decay:.2g} at most, is under 2^-9, half a bf16 step of any weight, so it "
                f"rounds away and would do nothing; {fix}")
    return None


def cuda_device(p, args, device, local_rank):
    """The GPU this process trains on, always with its index: torch.cuda.set_device and DDP's device_ids need one.
    Plain --device cuda means the local rank's GPU (cuda:0 without torchrun); one GPU named for several processes
    of one machine is refused (device_from_flag refused an index that is not there)."""
    count, local_world = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.index is None:
        if local_rank >= count:
            p.error_here(f"torchrun started {local_world} processes on this machine, which has {count} CUDA GPU(s): "
                    f"pass --nproc_per_node={count}")
        device = torch.device("cuda", local_rank)
    elif local_world > 1:
        p.error(f"--device {args.device}: under torchrun each of this machine's {local_world} processes takes the GPU "
                f"of its local rank; pass --device cuda (or auto)")
    args.device = str(device)
    torch.cuda.set_device(device)  # before any other CUDA call, which would otherwise make a context on cuda:0 too
    return device


def check_memory(p, args, device, world, vocab_size, accumulation_given=False):
    """Refuse, before anything is built, a run whose estimated peak (estimate_memory.py at this run's settings, and at
    vocab_size, its tokenizer's pieces: None for T5's) exceeds the memory it has, naming a --batch_size that fits
    (and, where the command line gave --gradient_accumulation, the one that makes up the update with it: a
    --batch_size alone would be refused then). On CPU: 80% of the machine's
    memory, shared by the ranks; beyond it the kernel would kill the run with one word, 'Killed'. On a GPU: 95% of
    its free memory (other processes' and CUDA's own context already taken out), the rest left to the allocator;
    beyond it CUDA would run out of memory once the model is built."""
    there = memory_there(device, world)
    if there is None:
        return
    available, share, where = there
    galore, eight_bit = args.optimizer.startswith("galore"), args.optimizer.endswith("adam8bit")
    dtype = run_dtype(args, device)

    method, rank = ("galore", args.galore_rank) if galore else (args.method, args.rank)

    def need(batch, checkpointing=args.activation_checkpointing, packed=args.packed_support):
        # a smaller micro-batch means more of them an update: from 2 on the gradients are kept between backwards
        accumulation = 1 if args.eval_only else args.total_batch_size // (batch * world)
        supports = "packed" if packed else "int32"  # sllinear's: int32 below 2^31 entries
        row = estimate(args.size, method, rank, args.delta, index_dtype=supports, ffn_dim=args.ffn_dim,
                       vocab_size=vocab_size, optimizer="adam8bit" if eight_bit else "adamw", per_layer=args.per_layer,
                       batch_size=batch, max_length=args.max_length, activation_checkpointing=checkpointing,
                       dtype=dtype, amp=args.amp, freeze=args.freeze, block_size=args.block_size or BLOCK_SIZE,
                       accumulation=accumulation, ddp=world > 1, cuda_graph=args.cuda_graph)
        return row["eval_gb" if args.eval_only else "train_gb"] * 1e9  # --eval_only: a forward without gradients
    needed = need(args.batch_size)
    if needed <= share * available:
        return
    divides = lambda b: args.eval_only or args.total_batch_size % (b * world) == 0  # an update's batch must divide
    smaller = lambda **kw: next((b for b in range(args.batch_size - 1, 0, -1)
                                 if divides(b) and need(b, **kw) <= share * available), None)
    def batch(b):  # a given --gradient_accumulation stays unless named anew: the micro-batch alone cannot change
        return f"--batch_size {b}" + (f" --gradient_accumulation {args.total_batch_size // (b * world)}"
                                      if accumulation_given and not args.eval_only else "")
    fits = smaller()
    fixes = [f"pass {batch(fits)}"] if fits else []
    if not args.eval_only and not args.activation_checkpointing:
        if need(args.batch_size, True) <= share * available:
            fixes.append("add --activation_checkpointing")
        elif not fits and smaller(checkpointing=True):  # neither alone, both together
            fixes.append(f"pass {batch(smaller(checkpointing=True))} with --activation_checkpointing")
    if method in SPARSE and not args.packed_support and need(args.batch_size, packed=True) <= share * available:
        fixes.append("add --packed_support")
    fix = " or ".join(fixes) or "pick a smaller --size or more memory"
    say = p.error_here if device.type == "cuda" else p.error  # a GPU's free memory is its rank's own to say
    say(f"--size {args.size} with --batch_size {args.batch_size} needs about {needed / 1e9:.1f} GB per process, "
        f"more than {share:.0%} of {where}; {fix}")


def no_checkpoint(args):
    """The refusal of a --resume or --eval_only whose checkpoint is not there, or None."""
    if (args.resume or args.eval_only) and not os.path.exists(resume_path(args)):
        flag = "--eval_only" if args.eval_only else "--resume"
        drop = f"drop {flag}"
        if args.resume and not args.overwrite and not args.eval_only:
            from keeper import others_rows  # (keeper imports flags)
            if others_rows(args.out_dir):  # a run that stopped before its first save: a fresh one would be refused
                drop = f"drop --resume and pass --overwrite (it replaces the rows in {args.out_dir} of a run that " \
                    "saved no checkpoint)"
        return f"{flag}: no checkpoint at {resume_path(args)}; pass its path with --resume or {drop}"
    return None


def resume_path(args):
    """The checkpoint that --resume names: out_dir/ckpt.pt by default, or the ckpt.pt in a folder."""
    if args.resume in (None, "auto"):
        return os.path.join(args.out_dir, "ckpt.pt")
    return checkpoint.checkpoint_file(args.resume)


def same_file(a, b):
    """Whether two paths are one file, through links and relative parts."""
    return os.path.realpath(a) == os.path.realpath(b)
