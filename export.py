"""
Export a trained model (full, lowrank, sltrain, relora or a fine-tuned sltrain_ft) as dense weights: a Hugging Face
LLaMA folder, or our own format.

    python export.py out/ckpt.pt --out hf_model          # config.json, model.safetensors, tokenizer files
    python export.py out/ckpt.pt --merged out/dense.pt   # a full-rank checkpoint that analyze.py and sample.py read

Every SLTrain, low-rank and ReLoRA weight is merged into its dense (out, in) matrix (W = s·BA + S, W0 + s·BA, or
fine-tuning's W0 + s·BA + S), in float32 and rounded once to the weights' dtype, one layer at a time in place, so
that the merge never holds both models (`densify`). The folder loads with
transformers.LlamaForCausalLM.from_pretrained(folder) and gives our logits: model.py already follows HF's LLaMA
(rotary embeddings in the half-split layout with rotate_half, RMSNorm in float32 with eps inside the root, SwiGLU
MLP, no biases, untied head), so only the names change, and no weight is permuted. test_export.py checks the logits.

safetensors is written here, without the package: an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range [begin, end) in the data that follows, then the raw tensors back to back.
"""

import argparse
import atexit
import copy
import functools
import gc
import json
import math
import os
import struct
import sys
import tempfile
from dataclasses import asdict, replace

import torch
import torch.nn as nn

from checkpoint import (SaveFailed, atomic_files, check_tokenizer, checkpoint_file, load_model, make_folder,
                        remove_empty, save)
from data import Unbroken, empty_path_refusal, load_tokenizer
from model import ReLoRALinear
from sllinear import SLLinear

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# ----------------------------------------------------------------------------- safetensors

def write_whole(parts, kept):
    """{path: bytes, or a function that writes into a binary file} -> files that appear at their paths all or none
    (checkpoint.atomic_files). A failed write raises OSError naming its file, then `kept`: what stays as it was."""
    paths = list(parts)
    try:
        with atomic_files(paths) as files:
            for path, f in zip(paths, files):
                try:
                    parts[path](f) if callable(parts[path]) else f.write(parts[path])
                    f.flush()  # a write the disk refuses fails now, naming its file, before any file is renamed
                except OSError as e:
                    raise OSError(e.errno, e.strerror, path) from None
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror}; {kept}", e.filename) from None


def write_safetensors(tensors, f):
    """{name: tensor} -> the bytes of one .safetensors file, into the binary file f, a tensor at a time (no copy of
    the whole model in host memory)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be exported; cast to float32 or bfloat16 first")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for t in tensors.values():
        f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # little-endian host


def save_safetensors(tensors, path):
    """{name: tensor} -> one .safetensors file, atomic (write_whole): a failed write leaves no partial file and raises
    OSError naming path."""
    write_whole({path: functools.partial(write_safetensors, tensors)}, "nothing was left there")


def load_safetensors(path):
    """One .safetensors file -> {name: tensor}, read back the same way (for checks)."""
    names = {v: k for k, v in DTYPES.items()}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8)
        out[name] = raw.view(names[info["dtype"]]).reshape(info["shape"])
    return out


# ----------------------------------------------------------------------------- dense weights

MERGED = (SLLinear, ReLoRALinear)  # the re-parameterized projections, each exported as one dense weight


@torch.no_grad()
def densify(model, dtype=None):
    """The model itself made full-rank, in place: each SLLinear and ReLoRALinear replaced by an nn.Linear holding its
    merged weight (s·BA + S, or W0 + s·BA), then every tensor cast to dtype (default: the model's). One layer at a
    time, its factors freed as it goes, so the merge holds the dense model and one layer more, never both models
    (7b: 6.74G parameters, not 6.74G + 3.14G). Each merge runs in float32 and is rounded once: bf16 factors
    multiplied in bf16, or float32 ones cast to bf16 before the product, would round twice."""
    dtype = dtype or model.embed.weight.dtype
    names = [name for name, module in model.named_modules() if isinstance(module, MERGED)]  # names: no reference
    for name in names:
        parent, attr = name.rsplit(".", 1)
        layer = model.get_submodule(name)
        dense = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        # <-- SLTrain: W = s·BA + S, merged once, on a float32 copy of the layer
        weight = copy.deepcopy(layer).float().merged_weight()
        refuse_overflow(f"{name}.weight", weight, dtype)
        dense.weight = nn.Parameter(weight.to(dtype))
        setattr(model.get_submodule(parent), attr, dense)  # the factors go with the layer
        del layer, weight
    for name, tensor in model.state_dict().items():  # the rest: embeddings, norms, head
        if name.removesuffix(".weight") not in names:
            refuse_overflow(name, tensor, dtype)
    model.config = replace(model.config, method="full", packed_support=False)  # no support left to store
    return model.to(dtype)


def refuse_overflow(name, tensor, dtype):
    """A tensor that holds NaN or inf (a diverged run's) is refused, as is one with a value past dtype's range: cast to
    float16 (at most 65504) it would hold inf."""
    if not (tensor.is_floating_point() and tensor.numel()):
        return
    low, high = (v.item() for v in torch.aminmax(tensor.detach()))  # one pass, no copy (an abs() would be one)
    if not math.isfinite(low) or not math.isfinite(high):  # aminmax propagates a NaN
        raise ValueError(f"{name} holds NaN or inf (the run diverged); export an earlier checkpoint")
    largest = max(-low, high)
    if dtype.is_floating_point and largest > torch.finfo(dtype).max:
        wider = "bfloat16 or float32" if dtype == torch.float16 else "float32"  # past bf16's 3.39e38: float32 alone
        raise ValueError(f"{name} holds a value of magnitude {largest:.4g}, past {dtype}'s largest, "
                         f"{torch.finfo(dtype).max:.6g}: pass --dtype {wider}")


def hf_name(name):
    """Our parameter name -> Hugging Face LLaMA's."""
    name = name.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
    name = name.replace(".attn.", ".self_attn.")
    if name.startswith("embed."):
        return "model.embed_tokens." + name[len("embed."):]
    if name.startswith(("layers.", "norm.")):
        return "model." + name
    return name  # lm_head.weight


def hf_config(config, max_length, dtype, eos_id, pad_id=0):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.dim, "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_heads, "hidden_act": "silu",
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "max_position_embeddings": max_length,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
            "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "initializer_range": 0.02}


# what export_hf writes. The sentencepiece model goes under both names transformers reads it by: T5's tokenizer
# class reads spiece.model (its vocab_files_names; transformers 4.x finds no other), and 5.x tokenizer.model first
# where there is one (so both are written, and an earlier export's is never left there to be read)
HF_FILES = ("config.json", "model.safetensors", "tokenizer.model", "spiece.model", "tokenizer_config.json")


def export_hf(model, ckpt, out_dir, tokenizer=None, dtype=None):
    """Write config.json, model.safetensors (in dtype, default the model's) and the tokenizer (sentencepiece model,
    as tokenizer.model and spiece.model, + tokenizer_config.json)."""
    run = ckpt.get("args", {})
    tokenizer = tokenizer or run.get("tokenizer")
    if not tokenizer:
        raise ValueError("the checkpoint names no tokenizer; pass --tokenizer")
    sp = load_tokenizer(tokenizer, pieces=model.config.vocab_size, sha256=run.get("tokenizer_sha256"))
    with open(tokenizer, "rb") as f:
        spm = f.read()  # read first: --tokenizer may be the tokenizer.model (or spiece.model) of this very folder
    os.makedirs(out_dir, exist_ok=True)
    tensors = {hf_name(k): v for k, v in densify(model, dtype).state_dict().items()}
    dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    # max_position_embeddings only sizes HF's rotary cache; the model saw sequences of max_length tokens
    pad_id = max(sp.pad_id(), 0)  # what the loader pads rows with (data.py): T5's pad, 0
    config = hf_config(model.config, max(2048, run.get("max_length", 256)), dtype, sp.eos_id(), pad_id)
    # T5's tokenizer class reads a sentencepiece unigram model with its own normalizer, so its ids are ours (the
    # LLaMA class re-reads the model as BPE and is not). No extra ids: the vocabulary stays the model's. It appends
    # EOS, which ends every training document: right for scoring documents; pass add_special_tokens=False for prompts
    eos, unk = sp.id_to_piece(sp.eos_id()), sp.id_to_piece(max(sp.unk_id(), 0))
    tok = {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "model_max_length": run.get("max_length", 256),
           "eos_token": eos, "unk_token": unk, "pad_token": sp.id_to_piece(pad_id),
           "clean_up_tokenization_spaces": False}
    # all or none: a disk that fills after the weights (or a Ctrl-C there) would leave, with --overwrite, new
    # weights beside an earlier export's config, a folder that loads as neither model
    contents = {"config.json": json.dumps(config, indent=2).encode(),
                "model.safetensors": functools.partial(write_safetensors, tensors), "tokenizer.model": spm,
                "spiece.model": spm, "tokenizer_config.json": json.dumps(tok, indent=2).encode()}
    write_whole({os.path.join(out_dir, name): contents[name] for name in HF_FILES},
                "none of the export's files was replaced (an earlier export there is as it was)")
    return list(HF_FILES)  # (not the folder's listing: it may hold other files, a run's own when it is the run's)


def export_merged(model, ckpt, path, dtype=None, merged_from=None):
    """A full-rank checkpoint of the same model, in train.py's format (weights, config and the run's args). The model
    is made dense in place (densify); merged_from is the method it was trained with (default: the model's). Returns
    the method recorded as merged from."""
    run = ckpt.get("args", {})  # a merged checkpoint merged again keeps what it was first trained as
    run = dict(run, method="full", merged_from=run.get("merged_from") or merged_from or model.config.method)
    densify(model, dtype)
    # the run's dtype is the one train.py --eval_only builds the model in: the weights' now, or float32 for float16
    # ones (train.py takes no float16; float32 holds them exactly), without --amp where it changed (bf16 weights)
    weights = str(model.embed.weight.dtype).removeprefix("torch.")
    weights = weights if weights in ("float32", "bfloat16") else "float32"
    if run.get("dtype") != weights:
        run.update(dtype=weights, amp=False)
    save(path, {"model": model.state_dict(), "model_config": asdict(model.config), "args": run,
                "step": ckpt.get("step")})  # atomic and checksummed, as train.py's
    return run["merged_from"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("ckpt", help="a checkpoint written by train.py")
    p.add_argument("--out", help="write a Hugging Face LLaMA folder here")
    p.add_argument("--merged", help="write a full-rank checkpoint in our format to this file")
    p.add_argument("--tokenizer", help="sentencepiece model (default: the one the checkpoint was trained with)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (default: as trained)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --merged file, or the export files "
                   "already in --out")
    args = p.parse_args(argv)
    if refusal := empty_path_refusal(args, ("ckpt", "--out", "--merged", "--tokenizer")):
        p.error(refusal)
    if not (args.out or args.merged):
        p.error("nothing to write: pass --out FOLDER (Hugging Face) and/or --merged FILE (our format)")
    source = checkpoint_file(args.ckpt)  # a run's folder stands for its ckpt.pt
    both = args.merged and os.path.exists(args.merged) and os.path.exists(source)  # else samefile would raise
    if both and os.path.samefile(args.merged, source):
        p.error(f"--merged {args.merged} is the checkpoint being exported: its optimizer and resume state would be "
                "lost; pass another file")
    # the folder is written first: a --merged among its files would replace that file with a torch checkpoint
    written = {os.path.realpath(os.path.join(args.out, name)): name for name in HF_FILES} if args.out else {}
    if args.merged and os.path.realpath(args.merged) in written:
        p.error(f"--merged {args.merged} is the {written[os.path.realpath(args.merged)]} that --out writes; pass "
                f"another name, such as {os.path.join(os.path.dirname(args.merged), 'dense.pt')}")
    if args.merged and os.path.isfile(args.merged) and not args.overwrite:  # another run's ckpt.pt, say
        p.error(f"--merged {args.merged} exists: pass another file, or --overwrite to replace it")
    # the output paths first: a bad one would otherwise fail after the load, and --merged after the folder was written
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} is a file; pass a folder (it is created if missing)")
    held = [name for name in HF_FILES if args.out and os.path.exists(os.path.join(args.out, name))]
    if held and not args.overwrite:  # an earlier export, of this run or another
        p.error(f"--out {args.out} holds an export already ({', '.join(held)}): pass another folder, or --overwrite "
                "to replace it")
    if args.merged and os.path.isdir(args.merged):
        p.error(f"--merged {args.merged} is a folder; pass a file in it, such as "
                f"{os.path.join(args.merged, 'dense.pt')}")
    merged = os.path.realpath(args.merged or ".")
    if args.merged and args.out and os.path.commonpath([os.path.realpath(args.out), merged]) == merged:
        # --out itself, or a missing folder above it: a folder once --out is written, where --merged then failed
        p.error(f"--merged {args.merged} is a folder that --out makes; pass a file in it, such as "
                f"{os.path.join(args.merged, 'dense.pt')}")
    folder = os.path.realpath(os.path.dirname(args.merged or "") or ".")
    # a folder that --out makes (--out itself, or a missing folder above it) is there by the time --merged is written
    made_by_out = args.out and os.path.commonpath([folder, os.path.realpath(args.out)]) == folder
    if args.merged and not os.path.isdir(folder) and not made_by_out:
        p.error(f"--merged {args.merged}: no folder {os.path.dirname(args.merged)}; create it or pass a file in an "
                "existing folder")
    if args.merged and os.path.isdir(folder):  # tried, as make_folder tries --out's: else the save fails at the end
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            p.error(f"--merged {args.merged}: cannot write into {os.path.dirname(args.merged) or '.'} "
                    f"({e.strerror or e}); pass a file in a folder you can write to")
    if args.tokenizer and not args.out:
        p.error("--tokenizer is for the Hugging Face folder: add --out FOLDER, or drop --tokenizer (--merged keeps the "
                "run's tokenizer)")
    if args.tokenizer:
        try:
            load_tokenizer(args.tokenizer)
        except (OSError, ValueError) as e:
            p.error(f"--tokenizer: {e}")
    if args.out:  # the Hugging Face folder's tokenizer, checked against the checkpoint at a quick look, before its
        try:  # full read
            check_tokenizer(args.ckpt, args.tokenizer)
        except (OSError, ValueError) as e:
            raise SystemExit(f"export.py: {e}") from None
    made = []
    if args.out:
        try:
            made = make_folder(args.out)
        except OSError as e:
            p.error(f"--out {args.out}: cannot make or write into the folder ({e.strerror or e}); pass a folder you "
                    "can write to")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        model, ckpt = load_model(args.ckpt)
        # only the run's args and step are needed: the rest (the model's tensors as trained, which would outlive the
        # merge, and the optimizer's state) is freed now
        ckpt, method = {k: ckpt[k] for k in ("args", "step") if k in ckpt}, model.config.method
        if args.out:
            files = export_hf(model, ckpt, args.out, args.tokenizer, dtype)
            print(f"wrote {args.out}: {', '.join(files)}")
        if args.merged:
            merged_from = export_merged(model, ckpt, args.merged, dtype, method)
            print(f"wrote {args.merged}: full-rank, merged from {merged_from}")
    except BaseException as e:  # whatever ends it (a file that cannot be written, Ctrl-C, a bug), no empty folder stays
        remove_empty(made)
        if isinstance(e, (OSError, ValueError, SaveFailed)):  # the partial file is gone already: one line
            raise SystemExit(f"export.py: {e}") from None
        if isinstance(e, KeyboardInterrupt):
            raise SystemExit("export.py: interrupted; what it was writing is removed, what it finished stays") \
                from None
        raise


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    sys.stdout = Unbroken(sys.stdout)  # a reader's end after the folder's line must not stop --merged's write
    main()
