"""
Generate text from a checkpoint that train.py (or export.py --merged) wrote, with the checkpoint's tokenizer.

    python sample.py out/ckpt.pt --prompt "The best way to" --num_samples 3 --max_new_tokens 100
    python sample.py out/ckpt.pt --temperature 0.8 --top_k 200 --seed 1337 --device cuda
    python sample.py out/ckpt.pt --temperature 1 --top_k 0 --top_p 0.9    # nucleus sampling alone

Sampling as nanoGPT's: the logits of the last position divided by the temperature, cut to the top k (and with
--top_p to the nucleus, the most likely tokens that hold that much of the probability), softmax, one draw; the
context is cropped to the positions training saw (max_length - 1 inputs in the paper's padded rows, max_length with
--pack), past which rotary positions were never seen.
--temperature 0 picks the most likely token (greedy). Output is deterministic for a seed on one device (and one
--batch_size: the samples are drawn --batch_size at a time, each printed once its batch is done, so that any number
of them runs in the memory of one batch).
A sample ends at its first end of document (EOS), so it may be shorter than --max_new_tokens: training documents end
there (paper mode never shows the model a token after EOS), and what followed would be a second, unrelated document.
Generation stops once every sample has ended.

Two things make a token cheap. The model's SLTrain (and ReLoRA) weights are merged once, as export.py --merged does:
the SLTrain layer as trained forms W = s·BA + S at every call, which for one new token per sample costs
r / num_samples times the product itself (--keep_factors keeps them, for less memory). And the keys and values of the
tokens seen are kept (model.KVCache), so that a new token runs the model on one position rather than on the whole
context; past the context, the cropped window is run afresh at each step, as its positions start over. In float32
the tokens are those of the model as trained run on its whole window; in bf16 the merge (rounded once) and the
cache round differently, so a near tie can go the other way.
"""

import argparse
import atexit
import gc
import math
import signal
import sys

import torch

from checkpoint import check_tokenizer, load_model
from data import empty_path_refusal, load_tokenizer
from devices import device_from_flag
from estimate_memory import memory_there
from export import MERGED, densify
from model import KVCache

BATCH = 16  # samples drawn at once by default
TOP_K = 200  # draws from the k likeliest tokens by default
MERGES = ("sltrain", "sltrain_ft", "relora")  # the methods whose weights `merged` makes dense


def merged(model):
    """The model with each SLTrain (also fine-tuned) and ReLoRA weight merged once into a dense one, for generation:
    an SLTrain layer forms W = s·BA + S at every call, a ReLoRA layer runs s·B(Ax) beside W0 x. A low-rank layer
    never forms W, and stays as it is. The merge is in place (export.densify), a layer at a time: it holds the dense
    model and one layer more, about twice an SLTrain model's weights (7b: 6.74G parameters against 3.14G); copy the
    model first to keep it as trained."""
    if model.config.method not in MERGES:
        return model
    return densify(model).eval()


def draw(logits, temperature, top_k=None, top_p=None, generator=None):
    """logits (B, vocab) -> the next tokens (B, 1): the most likely at temperature 0, else drawn from the softmax of
    logits / temperature cut to the top_k most likely tokens, then to the nucleus: the most likely ones whose
    probabilities add up to top_p, the one that reaches it included."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    # shifted by the max first: a tiny temperature then sends the rest to -inf, never the max to inf (NaN); and at
    # least the dtype's smallest normal number, as one below it (1e-50) is 0 in float32, and the max's 0/0 NaN
    temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if top_k:  # None or 0: no cut (sample.py's --top_k 0)
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ranked, order = logits.sort(-1, descending=True)  # (B, vocab) each
        p = ranked.softmax(-1)
        above = p.cumsum(-1) - p  # the probability of the tokens ranked above each; the first's is 0 < top_p
        logits = logits.scatter(-1, order, ranked.masked_fill(above >= top_p, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, context=255, generator=None, eos_id=None,
             cache=True, top_p=None):
    """idx (B, T) -> (B, T + n), n <= max_new_tokens: each new token drawn from the model's next-token distribution
    (see draw). With eos_id, a row ends at its first new EOS and is EOS from there on; the loop stops when every row
    has ended. cache=False runs the whole window at every step: slower, the same tokens in float32 (a check)."""
    ended = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # (B,)
    finite = torch.ones((), dtype=torch.bool, device=idx.device)  # every logit so far; see refuse_logits
    kv = None
    for _ in range(max_new_tokens):
        if not cache:
            window = idx[:, -context:]
        elif kv is None or idx.size(1) > context:  # the first window, or a cropped one: positions from 0
            if kv is None:
                kv = KVCache(model.config.n_layers, context)
            kv.pos, window = 0, idx[:, -context:]
        else:
            window = idx[:, -1:]  # the new token; the cache holds the ones before it
        logits, _ = model(window, cache=kv)  # (B, T', vocab)
        last = logits[:, -1, :].float()  # (B, vocab)
        # a NaN or +inf (max propagates NaN), or a row of -inf, was multinomial's RuntimeError, or at temperature 0 a
        # text of token 0; a -inf beside finite logits is a token ruled out, which draw takes as its own cuts do.
        # Read where the step waits for the device anyway (a draw copies its probabilities to the host, the EOS
        # check reads ended); greedy without EOS issues no sync, and reads it once, at the end
        finite = finite & torch.isfinite(last.max(-1).values).all()
        if temperature > 0 or eos_id is not None:
            refuse_logits(model, finite)
        next_id = draw(last, temperature, top_k, top_p, generator)  # (B, 1)
        if eos_id is not None:
            # an ended row stays in the batch (its draws unused) and keeps EOS: nothing after its end is shown
            next_id = next_id.masked_fill(ended[:, None], eos_id)
            ended |= next_id[:, 0] == eos_id
        idx = torch.cat([idx, next_id], dim=1)
        if eos_id is not None and ended.all():
            break
    refuse_logits(model, finite)
    return idx


def refuse_logits(model, finite):
    """Refuses logits that held NaN or inf (finite, a bool on the device, says they did not): from a weight that
    holds one (refuse_non_finite names it), else from activations past the range of the model's dtype."""
    if not finite:
        refuse_non_finite(model, "the model")
        raise ValueError(f"the model's logits hold NaN or inf though its weights are finite: its "
                         f"{next(model.parameters()).dtype} activations overflow; sample a float32 copy of it "
                         "(export.py CKPT --merged dense.pt --dtype float32)")


def refuse_non_finite(model, where):
    """A model with a weight that holds NaN or inf (a diverged run's) is refused, naming the first such tensor: every
    logit it gives is then NaN."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{where}: {name} holds NaN or inf (the run diverged); sample an earlier checkpoint")


def sample(ckpt_path, prompt="", num_samples=1, max_new_tokens=100, temperature=0.8, top_k=200, seed=1337,
           device="cpu", tokenizer=None, top_p=None, merge=True, batch_size=BATCH):
    """The generated texts (prompt included), as a list: see samples."""
    return list(samples(ckpt_path, prompt, num_samples, max_new_tokens, temperature, top_k, seed, device, tokenizer,
                        top_p, merge, batch_size))


def batch_bytes(config, batch_size, context, dtype):
    """What generating a batch holds beside the weights, at least: the KV cache of every layer over the context, and
    the logits of the first window (every position's, in the model's dtype, and the last's in float32)."""
    width = torch.tensor([], dtype=dtype).element_size()
    per_row = 2 * config.n_layers * context * config.dim * width + context * config.vocab_size * width
    return batch_size * (per_row + config.vocab_size * 4)


def settings_refusal(num_samples, max_new_tokens, batch_size, temperature, top_k, top_p, seed, flag=""):
    """What is wrong with these sampling settings, in one line naming the setting (as flag + its name: "--" at the
    command line), or None. top_k and top_p may be None (no cut)."""
    for name, n in (("num_samples", num_samples), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if not 0 < n < 2 ** 63:  # a tensor's size is an int64
            return f"{flag}{name} must be positive and at most 2^63 - 1, got {n}"
    if not 0 <= temperature < math.inf:  # `not <=`: NaN is refused too, not left to fail in the draw
        return f"{flag}temperature must be a finite number >= 0, got {temperature}"
    if top_k is not None and top_k < 0:
        return f"{flag}top_k must be >= 0, got {top_k}"
    if top_p is not None and not 0 < top_p <= 1:  # NaN is refused too
        return f"{flag}top_p must be in (0, 1], got {top_p}"
    if not -2**63 <= seed < 2**64:  # what torch.Generator.manual_seed takes
        return f"{flag}seed must fit in 64 bits, got {seed}"
    return None


def samples(ckpt_path, prompt="", num_samples=1, max_new_tokens=100, temperature=0.8, top_k=200, seed=1337,
            device="cpu", tokenizer=None, top_p=None, merge=True, batch_size=BATCH):
    """The generated texts (prompt included), each yielded once its batch (of batch_size samples) is done. The draws
    come from a CPU generator, so a seed repeats on any device, at the same batch_size. merge=False generates from
    the weights as trained: less memory, slower. A batch_size whose cache and logits cannot fit is refused (a
    ValueError naming one that fits) before the merge. Settings the command line refuses are refused here too,
    before the load (settings_refusal)."""
    if refusal := settings_refusal(num_samples, max_new_tokens, batch_size, temperature, top_k, top_p, seed):
        raise ValueError(refusal)
    try:  # a shell passes the bytes it was given, and Python keeps those that are not UTF-8 as it cannot encode them
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"--prompt is not UTF-8 text (byte {ord(prompt[e.start]) & 0xFF:#x} at character {e.start}): "
                         "pass it in UTF-8") from None
    check_tokenizer(ckpt_path, tokenizer)  # before the full read and the merge, which at 7b take a while
    model, ckpt = load_model(ckpt_path, device=device)
    refuse_non_finite(model, ckpt_path)  # before the merge, which would only carry the NaN into every layer
    run = ckpt.get("args", {})
    del ckpt  # its tensors (the optimizer's state too) would stay in memory through the run
    tokenizer = tokenizer or run.get("tokenizer")
    if not tokenizer:
        raise ValueError(f"{ckpt_path} names no tokenizer; pass --tokenizer")
    sp = load_tokenizer(tokenizer, pieces=model.config.vocab_size, sha256=run.get("tokenizer_sha256"))
    context = run.get("max_length", 256) - (0 if run.get("pack") else 1)  # the positions training saw
    batch_size = min(batch_size, num_samples)
    check_batch(model, batch_size, context, torch.device(device), merge)
    model = merged(model) if merge else model
    # an empty prompt (or one of spaces alone, which encodes to nothing) starts after an end of document: with --pack
    # every training document follows one; the paper's padded rows never predict a document's first token, so there
    # the first draw is from an untrained position (said)
    ids = sp.encode(prompt)
    prompted = bool(ids)
    ids = ids if prompted else [sp.eos_id()]
    if not prompted and not run.get("pack"):
        print("sample.py: note: no prompt, so each sample starts after an end of document, a position the run's padded "
              "rows never trained (--pack's do): its first tokens may be noise; pass --prompt", file=sys.stderr)
    if len(ids) > context:  # the model would see its last context tokens: said, not left to be found
        print(f"sample.py: note: the prompt is {len(ids)} tokens, more than the {context} positions the model was "
              f"trained on; it sees the last {context}", file=sys.stderr)
    g = torch.Generator().manual_seed(seed)
    eos = sp.eos_id()
    typed = sp.decode(ids) if prompted else ""
    # the prompt as typed, less the whitespace at its end, which the tokenizer drops (the model saw none there)
    head = prompt if typed != typed.rstrip() else prompt.rstrip()
    for start in range(0, num_samples, batch_size):
        idx = torch.tensor([ids] * min(batch_size, num_samples - start), dtype=torch.long, device=device)  # (B, T)
        out = generate(model, idx, max_new_tokens, temperature, top_k, context=context, generator=g, eos_id=eos,
                       top_p=top_p)
        for row in out.tolist():
            new = row[len(ids):]
            new = new[:new.index(eos)] if eos in new else new  # the sample ends with its document
            text = sp.decode((ids if prompted else []) + new)
            # the prompt as typed: decoded, a character outside the vocabulary would show as ⁇
            yield head + text[len(typed):] if text.startswith(typed) else text


def check_batch(model, batch_size, context, device, merge=True):
    """Refuse a batch whose cache and logits (batch_bytes) with the weights generated from (dense ones if merge)
    would not fit in the memory there (estimate_memory.memory_there), naming the largest batch that would."""
    there = memory_there(device)
    if there is None:
        return
    available, share, where = there
    dtype = next(model.parameters()).dtype
    # the model as loaded, buffers included (ReLoRA's and SLTrain-FT's W0 are its largest tensors), and as it is
    # generated from: a merge replaces each merged layer by its dense weight; full and low-rank models, and
    # --keep_factors, stay as loaded
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    layers = [m for m in model.modules() if isinstance(m, MERGED)] if merge and model.config.method in MERGES else []
    dense = held + sum(m.in_features * m.out_features * dtype.itemsize
                       - sum(t.nbytes for t in (*m.parameters(), *m.buffers())) for m in layers)
    # on a GPU the loaded weights are out of its free memory already, and only what the merge adds is needed
    weights = max(dense - held, 0) if device.type == "cuda" else max(dense, held)
    room, need = share * available - weights, batch_bytes(model.config, batch_size, context, dtype)
    if need > room:
        fits = int(room // batch_bytes(model.config, 1, context, dtype))
        fix = f"pass --batch_size {fits}" if fits >= 1 else "pass a smaller model, or use a machine with more memory"
        raise ValueError(f"a batch of {batch_size} samples holds a KV cache and logits of about {need / 1e9:.1f} GB, "
                         f"beside the weights, more than {share:.0%} of {where}; {fix}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("ckpt", help="a checkpoint written by train.py or export.py --merged")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--num_samples", type=int, default=3, help="how many continuations")
    p.add_argument("--batch_size", type=int, default=BATCH, help="samples drawn at once, each batch printed as it "
                   "ends (a seed repeats at the same batch size)")
    p.add_argument("--max_new_tokens", type=int, default=100, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="below 1 sharpens, above 1 flattens; 0 is greedy")
    p.add_argument("--top_k", type=int, help=f"draw only from the k most likely tokens (0: all; default {TOP_K})")
    p.add_argument("--top_p", type=float,
                   help="then only from the most likely tokens whose probabilities add up to this (1: all, the "
                        "default)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the draws")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--tokenizer", help="sentencepiece model (default: the one the checkpoint was trained with)")
    p.add_argument("--keep_factors", action="store_true",
                   help="generate from the SLTrain (or ReLoRA) weights as trained, not merged once: for SLTrain "
                        "about half the weights' memory, and several times slower")
    args = p.parse_args(argv)
    if refusal := empty_path_refusal(args, ("ckpt", "--tokenizer")):
        p.error(refusal)
    if refusal := settings_refusal(args.num_samples, args.max_new_tokens, args.batch_size, args.temperature,
                                   args.top_k, args.top_p, args.seed, flag="--"):
        p.error(refusal)
    cuts = [f"--{name}" for name in ("top_k", "top_p") if getattr(args, name) is not None]
    if args.temperature == 0 and cuts:  # the likeliest token is in any cut
        p.error(f"--temperature 0 takes the likeliest token, which {' and '.join(cuts)} keep{'s' * (len(cuts) == 1)} "
                f"anyway: drop {'them' if len(cuts) > 1 else 'it'}, or pass a --temperature above 0 to draw")
    args.top_k, args.top_p = TOP_K if args.top_k is None else args.top_k, 1.0 if args.top_p is None else args.top_p
    device_from_flag(p.error, args.device)
    try:
        for text in samples(args.ckpt, args.prompt, args.num_samples, args.max_new_tokens, args.temperature,
                            args.top_k or None, args.seed, args.device, args.tokenizer,
                            args.top_p if args.top_p < 1 else None, not args.keep_factors, args.batch_size):
            print(text)
            print("-" * 40, flush=True)
    except (OSError, ValueError) as e:
        raise SystemExit(f"sample.py: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("sample.py: interrupted") from None


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # it writes no file: a reader that stops (| head) ends it at once
    main()
