"""
C4 for LLaMA pretraining: shards on disk, a sentencepiece tokenizer, and a loader that is deterministic,
resumable mid-stream and split across DDP ranks. train.py uses TrainLoader and validation_batches; the fetching that
`download` does is download.py's.

    python data.py download --out data/c4 --tokenizer data/t5_spiece.model --train_shards 1
    python data.py train-tokenizer --data_dir data/c4 --out data/spm --vocab_size 32000   # offline alternative
    python data.py stats --data_dir data/c4 --tokenizer data/t5_spiece.model   # checks every line, tokens/doc
    python data.py bench --data_dir data/c4 --tokenizer data/t5_spiece.model   # last line: tokens/s N
    python -m pytest -q test_data.py

Shards are C4's own files, one JSON object per line (only "text" is read): c4-train.NNNNN-of-01024.json.gz,
c4-validation.NNNNN-of-00008.json.gz, or plain .json/.jsonl. A file whose name contains "validation" is
validation data; every other shard in --data_dir is training data.

Batches follow nanoGPT: x and y are (B, T) torch.long and y is x shifted by one. Two sequence modes:
  paper (default): one document per row, doc[:max_length-1] + EOS, padded to max_length (as the paper's HF T5
      tokenizer with truncation); x = seq[:-1], y = seq[1:] with -1 wherever the target is padding, T = max_length-1.
  packed: documents joined with EOS, cut into non-overlapping windows of max_length+1; T = max_length, no -1.
"""
import argparse
import atexit
import gc
import gzip
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import zlib
from contextlib import suppress
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from download import C4_NAMES, HF_ENDPOINT, download, shard_names

DEFAULT_DATA_DIR = "data/c4"
DEFAULT_TOKENIZER = "data/t5_spiece.model"
SHARD_GLOBS = ("*.json.gz", "*.jsonl.gz", "*.json", "*.jsonl")


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ----------------------------------------------------------------------------- files and tokenizer

def empty_path_refusal(args, flags):
    """The one line that refuses the first of the path flags (`--name`, or a positional's name) that was given
    empty, as "$CKPT" of an unset variable gives it: taken as not given, it quietly became the default, or the
    current folder. None where each is a path or absent. A list (nargs) is refused for any empty one in it."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-"), None)
        if any(isinstance(v, str) and not v.strip() for v in (value if isinstance(value, list) else [value])):
            drop = f", or drop {flag}" if flag[0] == "-" else ""  # (a positional cannot be dropped)
            return f"{flag} is empty (an unset variable?): pass a path{drop}"
    return None


def load_tokenizer(path, data_dir=DEFAULT_DATA_DIR, pieces=None, sha256=None):
    """A sentencepiece model with an EOS piece (documents end with EOS); the default is T5's: pad 0, eos 1. data_dir
    is the folder a missing one could be trained on, for the message; pieces, a model's vocabulary size that the
    tokenizer must have (a checkpoint read with another tokenizer would index past its embedding, or mean nothing);
    sha256, the digest of the file a checkpoint was trained with (train.py records it): the same size is not the
    same tokenizer."""
    path = Path(path)
    # with no shards named, download fetches the tokenizer alone (by default a shard of each split too); it keeps a
    # file already there (a user's own, named by mistake, is never replaced), so for one there the fix moves it first
    fetch = f"fetch T5's (python data.py download --train_shards 0 --validation_shards 0 --tokenizer {path})"
    fix = (f"{fetch} or train one offline (python data.py train-tokenizer --data_dir {data_dir} --out data/spm), "
           "then pass --tokenizer")
    there = f"move it aside (a download keeps a file that is there), then {fix}"
    if path.is_dir():  # the fix is a file: download writes the file it is given, and refuses a folder
        raise IsADirectoryError(f"tokenizer {path} is a folder; pass the sentencepiece model file, such as "
                                f"{path / 'spiece.model'} (python data.py download --train_shards 0 "
                                f"--validation_shards 0 --tokenizer {path / 'spiece.model'} fetches T5's there alone)")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} not found; {fix}")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path} is not a readable sentencepiece model ({e}); {there}") from None
    if sp.eos_id() < 0:
        raise ValueError(f"{path} has no EOS piece, which separates documents; {there}")
    if pieces is not None and sp.get_piece_size() != pieces:
        raise ValueError(f"tokenizer {path} has {sp.get_piece_size()} pieces but the model {pieces}; pass the "
                         "--tokenizer it was trained with")
    if sha256 is not None and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise ValueError(f"tokenizer {path} is not the one the checkpoint was trained with (its sha256 differs); pass "
                         "--tokenizer with that one")
    return sp


# the fix that a missing data folder's message names, whichever tool read it
FETCH = "pass --data_dir, or fetch the shards (python data.py download, or train.py --download)"


def find_shards(data_dir, split):
    """The sorted shards of one split: names containing "validation" are validation, all others are train."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    folder = Path(data_dir)
    if folder.is_file():
        raise FileNotFoundError(f"--data_dir {folder} is a file; pass the folder that holds the shards "
                                f"({folder.parent}?)")
    if not folder.is_dir():
        raise FileNotFoundError(f"data folder {folder} does not exist; {FETCH}")
    found = {p for g in SHARD_GLOBS for p in folder.glob(g)}
    dangling = sorted(p.name for p in found if p.is_symlink() and not p.exists())
    if dangling:  # an unmounted data store: training on the rest would drop those shards without a word
        raise FileNotFoundError(f"{folder}: {', '.join(dangling)} link(s) to nothing; mount their target, or "
                                "remove the link(s)")
    files = sorted((p for p in found if p.is_file()), key=lambda p: p.name)
    twice = sorted(p.name for p in files if p.name.endswith(".gz") and (folder / p.name[:-3]).is_file())
    if twice:  # one shard kept both gzipped and not (gunzip -k): its documents would be trained on twice a pass
        raise ValueError(f"{folder}: {', '.join(twice)} also there unzipped ({', '.join(n[:-3] for n in twice)}): "
                         "one shard twice; remove one of each pair")
    shards = [p for p in files if ("validation" in p.name) == (split == "validation")]
    if not shards:
        rule = "contains" if split == "validation" else "does not contain"
        raise FileNotFoundError(f"no {split} shards in {folder} ({' '.join(SHARD_GLOBS)} whose name {rule} 'validation'"
                                f"; found {[p.name for p in files]}); {FETCH}")
    return shards


def _lines(path):
    """(line number, raw bytes) of each non-blank line; a truncated gzip fails here, naming the file and line."""
    lineno = 0
    try:
        with (gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.isspace():  # a blank line is not a document, so dropping it loses nothing
                    yield lineno, raw
    except (EOFError, OSError, zlib.error) as e:
        again = (f"download it again (python data.py download --shards {path.name} --out {path.parent}), or "
                 if path.name in C4_NAMES else "replace it with a whole copy, or ")  # download takes C4's names alone
        raise ValueError(f"{path}: cannot read past line {lineno} ({e}); the file is truncated or corrupt: {again}"
                         "remove it for a new run")


# a run stopped by a bad line goes on from its checkpoint with the line fixed where it is (TrainLoader._check): the
# shuffle deals the documents by their place, which deleting a line would move for every one after it
FIX_LINE = "fix that line in place (python data.py stats checks a whole folder)"


def _text(path, lineno, raw):
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON object ({e}); shards hold one JSON object per line: "
                         f"{FIX_LINE}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
        what = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f'{path}:{lineno}: no "text" string (got {what}); every line needs {{"text": "..."}}: '
                         f"{FIX_LINE}")
    try:
        doc["text"].encode()  # JSON's \ud800 escapes make strings that are not text, which the tokenizer refuses
    except UnicodeEncodeError as e:
        raise ValueError(f"{path}:{lineno}: the text is not valid Unicode ({e.reason} at character {e.start}): "
                         f"{FIX_LINE}") from None
    return doc["text"]


def _texts(shards):
    """Every document in file order, for validation, stats and tokenizer training."""
    for path in shards:
        for lineno, raw in _lines(path):
            yield _text(path, lineno, raw)


# ----------------------------------------------------------------------------- documents -> token arrays

class _Encoder:
    def __init__(self, tokenizer_path, max_length, threads):
        self.sp, self.max_length, self.threads = load_tokenizer(tokenizer_path), max_length, threads
        self.eos = self.sp.eos_id()
        # Paper mode keeps only max_length-1 tokens, so it may encode a prefix cut at a space instead of the whole
        # document (C4 docs average ~500 T5 tokens): when no piece holds a word boundary ("▁") past its first
        # character, words are segmented independently and the prefix's tokens are the document's first tokens.
        self.prefix_ok = not any("\u2581" in self.sp.id_to_piece(i)[1:] for i in range(self.sp.vocab_size()))

    def paper(self, texts):
        """(n, max_length) int32 rows: doc[:max_length-1] + EOS, then -1 where the row is padding."""
        keep, limit = self.max_length - 1, 6 * self.max_length  # T5 averages ~4.5 characters per token
        cut = [_prefix(t, limit) if self.prefix_ok else t for t in texts]
        ids = self.sp.encode(cut, num_threads=self.threads)
        redo = [i for i, (c, t, x) in enumerate(zip(cut, texts, ids)) if len(c) < len(t) and len(x) < keep + 8]
        for i, x in zip(redo, self.sp.encode([texts[i] for i in redo], num_threads=self.threads)):
            ids[i] = x  # the prefix came out short (long pieces, few spaces): encode the whole document
        rows = np.full((len(ids), self.max_length), -1, dtype=np.int32)
        for row, x in zip(rows, ids):
            n = min(len(x), keep)
            row[:n], row[n] = x[:n], self.eos
        return rows

    def packed(self, texts):
        """1-D int32 stream: each document's tokens followed by EOS."""
        ids = self.sp.encode(texts, num_threads=self.threads)
        out, o = np.empty(sum(map(len, ids)) + len(ids), dtype=np.int32), 0
        for x in ids:
            out[o:o + len(x)], out[o + len(x)] = x, self.eos
            o += len(x) + 1
        return out


def _prefix(text, limit):
    if len(text) <= limit:
        return text
    i = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit))
    return text[:i] if i > 0 else text


def _batch(units, batch_size, pad_id, pack):
    """Stacked units (rows, or a token run in packed mode) -> (x, y) torch.long, targets shifted by one."""
    seq = torch.as_tensor(units).long().view(batch_size, -1)
    x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
    if not pack:
        x[x < 0] = pad_id  # padding sits after the document, so causal attention never lets it change the loss
    return x, y


# ----------------------------------------------------------------------------- order: shuffle, ranks, blocks

def _shuffle(items, rng):
    # Fisher-Yates with rng.random(): Python guarantees random() per seed across versions, randrange not.
    for i in range(len(items) - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        items[i], items[j] = items[j], items[i]
    return items


def _shard_docs(path, seed, epoch, pos, rank, world_size, buffer, skip=0):
    """This rank's (line number, raw line) pairs of one shard: shuffled by a sliding buffer seeded by
    (seed, epoch, shard position), then document j of the shuffled shard goes to rank (j - skip) % world_size. The
    first `skip` documents go to no rank: a run resumed on another number of processes had trained on them
    (TrainLoader.load_state_dict)."""
    rng, buf, j = random.Random(f"{seed}/{epoch}/{pos}"), [], 0
    for item in _lines(path):
        if len(buf) < buffer:
            buf.append(item)
            continue
        i = int(rng.random() * buffer)
        item, buf[i] = buf[i], item
        if j >= skip and (j - skip) % world_size == rank:
            yield item
        j += 1
    for item in _shuffle(buf, rng):
        if j >= skip and (j - skip) % world_size == rank:
            yield item
        j += 1


def _fault_in(message, shards):
    """(shard, line, cut) of a bad line's message of _text (cut None) or a truncation's of _lines (cut: that line),
    or None where the message names no shard."""
    for path in shards:
        for is_cut, pattern in ((False, r":(\d+): "), (True, r": cannot read past line (\d+) ")):
            if m := re.match(re.escape(str(path)) + pattern, message):
                return path, int(m.group(1)), int(m.group(1)) if is_cut else None
    return None


def _shard_faults(path, cut=None):
    """(its bad lines, where it is cut) of a shard: the numbers of the non-blank lines before `cut` that are no
    document, and `cut`, or the line it cannot be read past (None where it reads to its end)."""
    bad = []
    try:
        for lineno, raw in _lines(path):
            if cut is not None and lineno >= cut:
                break
            try:
                _text(path, lineno, raw)
            except ValueError:
                bad.append(lineno)
    except ValueError as e:  # (only _lines' own, a truncation)
        cut = _fault_in(str(e), [path])[2]
    return bad, cut


def _kept_lines(path, bad, cut):
    """[count, sha256] of the shard's non-blank lines before `cut` (all, for None), the `bad` ones counted but not
    hashed: what the fix of a shard keeps as it was. A bad line fixed in place is still one line, so the count stays
    (the shuffle deals documents by their place); a cut shard downloaded again starts with the lines it had."""
    digest, count = hashlib.sha256(), 0
    for lineno, raw in _lines(path):
        if cut is not None and lineno >= cut:
            break
        count += 1
        if lineno not in bad:
            digest.update(raw)
    return [count, digest.hexdigest()]


def _run_of(states, block, pack):
    """What a run on len(states) processes had trained on, from its ranks' states: its dealing (skip, world) and each
    rank's place, [pass, shard, its documents of that shard trained on, and begun (packed: its block begun)]."""
    ranks = []
    for s in states:
        e, p, b, offset = (int(s[k]) for k in ("epoch", "shard", "block", "offset"))
        done = b * block + (0 if pack else offset)
        ranks.append([e, p, done, done + (block if pack and offset else 0)])
    return {"world": len(states), "skip": states[0].get("skip"), "ranks": ranks}


def _skip_at(skip, epoch, pos):
    return skip[2] if skip and tuple(skip[:2]) == (epoch, pos) else 0


def _marks(runs, epoch, pos, n):
    """Which of the n documents of shard `pos` of pass `epoch` the runs (_run_of) had trained on, and begun: two bool
    arrays. A rank has trained on each document _shard_docs deals it in a shard before its place, and in that shard
    on its first `done` (begun: `begun`)."""
    j = np.arange(n)
    trained, begun = np.zeros(n, bool), np.zeros(n, bool)
    for run in runs:
        ranks, skip, world = np.array(run["ranks"]).reshape(-1, 4), _skip_at(run["skip"], epoch, pos), run["world"]
        ahead = (ranks[:, 0] > epoch) | (ranks[:, 0] == epoch) & (ranks[:, 1] > pos)
        here = (ranks[:, 0] == epoch) & (ranks[:, 1] == pos)
        rank, nth = (j - skip) % world, (j - skip) // world  # each document's rank, and its place in the rank's share
        dealt = j >= skip
        trained |= dealt & (ahead[rank] | here[rank] & (nth < ranks[rank, 2]))
        begun |= dealt & (ahead[rank] | here[rank] & (nth < ranks[rank, 3]))
    return trained, begun


class _Blocks(IterableDataset):
    """The rank's endless stream of encoded blocks from `start` = (epoch, shard position, block) on. A block is
    `block_docs` consecutive documents of this rank's share of one shard, so a resume rereads one shard at most.
    Worker k of K encodes the blocks numbered k, k+K, ... from the start. Every worker reads every line (cheap
    next to tokenizing) so all agree on the numbering, and the DataLoader's round robin returns blocks in order:
    the stream is the same for any number of workers."""

    def __init__(self, loader, start):
        self.ld, self.start = loader, start

    def __iter__(self):
        ld, info = self.ld, get_worker_info()
        k, workers = (0, 1) if info is None else (info.id, info.num_workers)
        enc = _Encoder(ld.tokenizer_path, ld.max_length, max(1, _cpus() // workers))
        epoch, first_shard, first_block = self.start
        g = 0  # blocks since the start, dealt out to workers in turn
        while True:
            order = ld.order(epoch)
            blocks = 0
            for pos in range(first_shard, len(order)):
                docs = _shard_docs(order[pos], ld.seed, epoch, pos, ld.rank, ld.world_size, ld.shuffle_buffer,
                                   ld.skipped(epoch, pos))
                for b, chunk in enumerate(_chunks(docs, ld.block_docs)):
                    blocks += 1
                    if (pos, b) < (first_shard, first_block):
                        continue  # before the resume point: read to find the blocks, never tokenized
                    if g % workers == k:
                        texts = [_text(order[pos], lineno, raw) for lineno, raw in chunk]
                        block = torch.from_numpy(enc.packed(texts) if ld.pack else enc.paper(texts))
                        yield epoch, pos, b, block if info is None else _shared(block)
                    g += 1
            if blocks == 0 and first_shard == first_block == 0 and not ld.skipped(epoch, 0):
                raise ValueError(f"rank {ld.rank} of {ld.world_size} got no documents from {len(ld.shards)} shards; "
                                 f"use fewer ranks or more data (--data_dir)")
            epoch, first_shard, first_block = epoch + 1, 0, 0


class SharedMemoryFull(RuntimeError):
    """/dev/shm has no room for a data worker's block (see _shared)."""


def _mib(n):
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _shared(block):
    """A worker's block goes to the main process through /dev/shm. Left to torch's queue thread, a full /dev/shm
    (other jobs' files, leaked segments, a container's 64 MB) made that thread drop the block with a traceback, and
    the main process waited for it forever, past the stop signals too. Moved there by the worker itself, the refusal
    is the worker's error, which the main process is given between updates (train.read_update stops the run on it)."""
    try:
        return block.share_memory_()
    except RuntimeError as e:
        if "shared memory" not in str(e):
            raise
        said = f"/dev/shm has no room for a data worker's block of {_mib(block.nbytes)}"
        with suppress(OSError):
            disk = shutil.disk_usage("/dev/shm")
            said += f" ({_mib(disk.free)} free of {_mib(disk.total)})"
        raise SharedMemoryFull(said) from None


def one_line(error):
    """A DataLoader worker's exception carries the worker's whole traceback; its last line is the message, after
    the exception's name."""
    last, kind = str(error).strip().splitlines()[-1], type(error)
    return last.removeprefix(f"{kind.__module__}.{kind.__qualname__}: ").removeprefix(f"{kind.__qualname__}: ")


# The signals that end a job, which train.py answers with a checkpoint and a clean exit: SIGTERM (timeout, SLURM,
# Kubernetes, torchrun), SIGINT (Ctrl-C), SIGHUP (a closed terminal), SIGQUIT (Ctrl-\; torchrun passes these three
# on), SIGUSR1 and SIGUSR2 (the warnings SLURM's --signal and other schedulers send before a kill). By default each
# would kill the process unsaved (SIGQUIT with a core dump). Windows has the first two only.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                                        "SIGUSR2") if hasattr(signal, name))


def _leave_signals_to_main(_):
    """Schedulers (timeout, SLURM, torchrun) signal the whole process group: a worker killed by one of STOP_SIGNALS
    would take the main process down before it saves. Workers ignore them; the main process stops them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _chunks(items, n):
    items = iter(items)
    while chunk := list(itertools.islice(items, n)):
        yield chunk


# ----------------------------------------------------------------------------- training stream

class TrainLoader:
    """Endless (x, y) batches of the training shards for one DDP rank; each pass (epoch) is reshuffled.

    Each rank owns a disjoint share of every shard; together the ranks see every document once per pass.
    state_dict() is this rank's position (plain ints/strs): under DDP gather every rank's state
    (dist.all_gather_object) and save the list; load_state_dict accepts that list and picks its own rank, or, saved
    by another number of ranks, goes on from where they stood together (_regather).
    num_workers > 0 tokenizes in DataLoader worker processes and gives the same batches as num_workers=0."""

    def __init__(self, data_dir, tokenizer_path, batch_size, max_length=256, seed=42, rank=0, world_size=1,
                 pack=False, num_workers=0, shuffle_buffer=10_000, block_docs=512):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if min(batch_size, max_length - 1, shuffle_buffer, block_docs) < 1:
            raise ValueError(f"need batch_size, shuffle_buffer, block_docs >= 1 and max_length >= 2, got {batch_size}, "
                             f"{shuffle_buffer}, {block_docs} and {max_length}")
        self.shards, self.tokenizer_path = find_shards(data_dir, "train"), str(tokenizer_path)
        self.sizes = [p.stat().st_size for p in self.shards]  # read once: state_dict() comes before every update
        self.pad_id = max(load_tokenizer(tokenizer_path).pad_id(), 0)  # fail now on a bad tokenizer, not in a worker
        for path in self.shards:  # fail now on a shard that is not JSON lines; truncation shows only when read
            first = next(_lines(path), None)
            if first is None:
                raise ValueError(f"{path} holds no documents; remove it or download it again")
            _text(path, *first)
        self.batch_size, self.max_length, self.seed, self.rank, self.world_size = \
            batch_size, max_length, seed, rank, world_size
        self.pack, self.num_workers = pack, num_workers
        self.shuffle_buffer, self.block_docs = shuffle_buffer, block_docs
        self._pos = (0, 0, 0, 0)  # next unit: (epoch, shard position, block, units of that block already used)
        self._skip = None  # (epoch, shard position, n): the shard's first n documents go to no rank (_regather)
        self._history = []  # the runs before a change of processes whose documents lie ahead (_regather)
        self.regathered = None  # after a resume on another number of processes: what _regather did, to say it
        self.fault = None  # the bad line or cut that stopped the stream, for the checkpoint (see _check)
        self.fixed = []  # after a resume: the shards whose fault was fixed since, to say it

    @property
    def epoch(self):
        return self._pos[0]

    def order(self, epoch):
        """The training shards in the order of this pass."""
        return _shuffle(list(self.shards), random.Random(f"{self.seed}/{epoch}"))

    def skipped(self, epoch, pos):
        """How many of the first documents of shard `pos` of pass `epoch` go to no rank (see _regather)."""
        return _skip_at(self._skip, epoch, pos)

    def _config(self):
        return {"seed": self.seed, "rank": self.rank, "world_size": self.world_size, "pack": self.pack,
                "max_length": self.max_length, "shuffle_buffer": self.shuffle_buffer, "block_docs": self.block_docs,
                "shards": [p.name for p in self.shards], "sizes": self.sizes}

    def state_dict(self):
        epoch, shard, block, offset = self._pos
        return {"epoch": epoch, "shard": shard, "block": block, "offset": offset,
                "skip": list(self._skip) if self._skip else None, "history": self._history, **self._config()}

    def load_state_dict(self, state):
        """This rank's position from state_dict(), or from the list of every rank's (what train.py gathers). A list
        of another length, from a run on another number of processes, is taken as _regather says."""
        states = state if isinstance(state, (list, tuple)) else [state]
        faults = [one["fault"] for one in states if one and one.get("fault")]  # the rank(s) that met it
        if isinstance(state, (list, tuple)):  # every rank's state, as gathered for the checkpoint
            if len(state) != self.world_size:
                for one in state:
                    self._check(one, same_ranks=False, faults=faults)
                self._regather(state)
                return
            state = state[self.rank]
        self._check(state, faults=faults)
        self._pos = tuple(int(state[k]) for k in ("epoch", "shard", "block", "offset"))
        self._skip = tuple(state["skip"]) if state.get("skip") else None
        self._history = state.get("history") or []

    def _regather(self, states):
        """Go on from the states of a run on len(states) processes: from the first document, in the order of the
        passes and shards, that no run had trained on, dealt to this run's ranks anew. Each document after it that a
        run had trained on comes again, and none is left out. "A run": the checkpoint's, and the runs before a change
        of processes whose documents still lie ahead (self._history), so that their count stays exact when the
        processes change twice. In packed mode a rank's block begun is read again whole (no place within a block is
        kept); its documents are counted apart. Reads the line counts of the shards from the checkpoint's rank
        furthest behind to the rank furthest on (seconds a C4 shard). What it did goes in self.regathered."""
        runs = [*(states[0].get("history") or []), _run_of(states, self.block_docs, self.pack)]
        lines = {}

        def marks(e, p):  # (trained, begun) of each document of shard p of pass e, by any run
            path = self.order(e)[p]
            if path not in lines:
                lines[path] = sum(1 for _ in _lines(path))
            return _marks(runs, e, p, lines[path])

        def after(e, p):
            return (e, p + 1) if p + 1 < len(self.shards) else (e + 1, 0)

        # the start: before the place of the checkpoint's rank furthest behind, and before its run's own start (its
        # skip), every document was trained on; from there, the first that none was
        at = min(tuple(rank[:2]) for rank in runs[-1]["ranks"])
        lo = _skip_at(runs[-1]["skip"], *at)
        while not (untrained := np.flatnonzero(~marks(*at)[0][lo:])).size:  # none in this shard: the next's first
            at, lo = after(*at), 0
        (e0, p0), first = at, lo + int(untrained[0])
        lo = first
        # what comes again: the documents from there on that a run had trained on, and (packed) had begun
        again, begun_again, last = 0, 0, max(tuple(rank[:2]) for run in runs for rank in run["ranks"])
        while at <= last:
            done, begun = marks(*at)
            again, begun_again = again + int(done[lo:].sum()), begun_again + int((begun & ~done)[lo:].sum())
            at, lo = after(*at), 0
        self._pos, self._skip = (e0, p0, 0, 0), (e0, p0, first)
        self._history = [run for run in runs if max(tuple(rank[:2]) for rank in run["ranks"]) >= (e0, p0)]
        self.regathered = dict(processes=len(states), epoch=e0, shard=p0, document=first, seen_again=again,
                               begun_again=begun_again)

    def _check(self, state, same_ranks=True, faults=()):
        """Refuse a state of another data folder, seed, sequence settings or (same_ranks) number of processes. A shard
        changed since is taken where it is the fix of the fault that stopped the run (faults: the checkpoint's; see
        _fixed)."""
        mine = self._config()
        if state.get("shards") != mine["shards"]:  # named, not listed: a full run has 1024
            old, new = state.get("shards") or [], mine["shards"]
            gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            raise ValueError(f"the data folder's training shards are not the checkpoint's: {len(gone)} gone "
                             f"{gone[:3]}, {len(added)} added {added[:3]}; resume with the same shards")
        changed = [(name, a, b) for name, a, b in zip(mine["shards"], state.get("sizes", mine["sizes"]), mine["sizes"])
                   if a != b]  # (a checkpoint from before sizes were kept has none: its shards are taken as they are)
        for name, a, b in list(changed):
            fault = next((f for f in faults if f["shard"] == name), None)
            if fault and self._fixed(name, fault):
                changed.remove((name, a, b))
        if changed:
            name, a, b = changed[0]
            raise ValueError(f"{len(changed)} training shard(s) changed since the checkpoint, {name} from {a:,} to "
                             f"{b:,} bytes: the run would go on with other data; restore them, or start a new run")
        keys = ("seed", "pack", "max_length", "shuffle_buffer", "block_docs")
        for key in keys + ("rank", "world_size") if same_ranks else keys:
            if state.get(key) != mine[key]:
                raise ValueError(f"the checkpoint's loader had {key}={state.get(key)!r} but this one has "
                                 f"{mine[key]!r}; resume with the same data, seed, sequence settings and number of "
                                 "processes")

    def _fault_record(self, message):
        """What a resume checks of the shard that stopped the stream (_fixed), or None if the message names none: its
        bad lines and its cut, found reading it whole (seconds a C4 shard), and the lines that its fix keeps."""
        found = _fault_in(message, self.shards)
        if found is None:
            return None
        path, line, cut = found
        bad, cut = _shard_faults(path, cut)
        return {"shard": path.name, "line": line, "bad": bad, "cut": cut, "kept": _kept_lines(path, set(bad), cut)}

    def _fixed(self, name, fault):
        """Whether training shard `name` changed as the fix of the fault that stopped the run: every line as it was
        but its bad ones, fixed in place, and (cut) those from the cut on, downloaded again. Else refused. A shard
        is read once, though every rank's state of a checkpoint from another number of processes is checked."""
        if name in self.fixed:
            return True
        if _kept_lines(self.shards[[p.name for p in self.shards].index(name)], set(fault["bad"]), fault["cut"]) \
                == fault["kept"]:
            self.fixed.append(name)
            return True
        bad = fault["bad"]
        lines = ", ".join(map(str, bad[:5])) + " ..." * (len(bad) > 5)
        fixes = [f"its bad line{'s' * (len(bad) > 1)} {lines} fixed in place"] if bad else []
        if fault["cut"] is not None:
            fixes.append(f"downloaded again whole (the lines before its cut at line {fault['cut']} as they were)")
        raise ValueError(f"training shard {name} stopped the run and has changed since, but not as its fix: it must "
                         f"be {' and '.join(fixes)}, every other line as it was (deleting a line moves the documents "
                         "after it); fix it so, or start a new run")

    def __iter__(self):
        epoch, shard, block, offset = self._pos
        blocks = _Blocks(self, (epoch, shard, block))
        if self.num_workers > 0:
            blocks = DataLoader(blocks, batch_size=None, num_workers=self.num_workers, prefetch_factor=4,
                                worker_init_fn=_leave_signals_to_main)
        before = signal.getsignal(signal.SIGCHLD) if hasattr(signal, "SIGCHLD") else None
        stream = iter(blocks)
        if before is not None and signal.getsignal(signal.SIGCHLD) is not before:
            # torch's SIGCHLD handler raises a worker's death wherever the main process is (mid-backward, mid-step:
            # nothing whole to save); without it the death is raised by next(), between updates (train.py saves)
            with suppress(ValueError):  # (signal handlers are set from the main thread only)
                signal.signal(signal.SIGCHLD, before)
        stop = getattr(stream, "_shutdown_workers", None)
        if stop:  # at exit too, for an iterator never closed: multiprocessing's own exit would SIGTERM and wait
            atexit.register(stop)
        try:
            need = self.batch_size * (self.max_length + 1 if self.pack else 1)  # rows, or tokens when packed
            parts, have = [], 0  # [epoch, shard, block, units used, units left] per block, in stream order
            while True:
                while have < need:
                    try:
                        e, p, b, units = next(stream)
                    except ValueError as err:  # a bad line or a cut shard: what its fix must keep, for the checkpoint
                        self.fault = self._fault_record(one_line(err))
                        raise
                    skip = offset if (e, p, b) == (epoch, shard, block) else 0  # into the block we resume in
                    parts.append([e, p, b, skip, units[skip:]])
                    have += len(units) - skip
                got, take = [], need
                while take:
                    part = parts[0]
                    n = min(take, len(part[4]))
                    got.append(part[4][:n])
                    part[3], part[4], take = part[3] + n, part[4][n:], take - n
                    if len(part[4]) == 0 and len(parts) > 1:
                        parts.pop(0)  # the last block stays, used up, to mark the position when nothing is left over
                have -= need
                self._pos = tuple(parts[0][:4])  # set before yielding, so state_dict() after a batch resumes after it
                yield _batch(torch.cat(got), self.batch_size, self.pad_id, self.pack)
        finally:  # stop the workers now, by their queue: they ignore SIGTERM, so a later terminate() would not
            if stop:
                stop()
                atexit.unregister(stop)


# ----------------------------------------------------------------------------- validation

def validation_batches(data_dir, tokenizer_path, batch_size, max_length=256, eval_tokens=10_000_000, pack=False,
                       rank=0, world_size=1):
    """The first eval_tokens non-pad tokens of the validation shards, to the end of the row (--pack: the window) that
    reaches them (file order, no shuffle; all of them if there are fewer), as (x, y) batches with the training
    layout (a Validation: a list, with the set's sha256, its tokens, and whether the shards ran out before
    eval_tokens: short).
    The last batch is filled up with rows of padding, which have no targets: every batch has one shape, so a
    compiled model (train.py --compile) compiles its evaluation once, where a short last batch would compile it
    again. The set does not depend on batch_size or world_size. Under DDP rank r gets batches r, r+w, ...: sum the
    loss over targets (y >= 0) and count targets on each rank, all_reduce both, and divide, for a token-weighted
    mean."""
    enc = _Encoder(tokenizer_path, max_length, _cpus())
    texts, chunks, total = _texts(find_shards(data_dir, "validation")), [], 0
    goal = -(-eval_tokens // (max_length + 1)) * (max_length + 1) if pack else eval_tokens  # whole windows
    while total < goal and (part := list(itertools.islice(texts, 1024))):
        units = torch.from_numpy(enc.packed(part) if pack else enc.paper(part))
        counts = torch.ones(len(units), dtype=torch.long) if pack else (units >= 0).sum(1)
        n = int(torch.searchsorted(counts.cumsum(0), goal - total)) + 1  # units needed to reach the goal
        chunks.append(units[:n])
        total += int(counts[:n].sum())
    if total == 0:
        raise ValueError(f"the validation shards in {data_dir} hold no documents; download them again")
    if pack and total < max_length + 1:  # packed batches are whole windows: not even one would be left to score
        raise ValueError(f"the validation shards in {data_dir} hold {total} tokens, fewer than one window of "
                         f"max_length+1 = {max_length + 1}; lower --max_length or add validation shards")
    units = torch.cat(chunks)
    if pack:
        units = units[:len(units) // (max_length + 1) * (max_length + 1)].view(-1, max_length + 1)
    sha256 = hashlib.sha256(units.numpy().tobytes()).hexdigest()
    pad_id = max(enc.sp.pad_id(), 0)
    batches = [_batch(u, len(u), pad_id, pack) for u in units.split(batch_size)]
    x, y = batches[-1]
    if len(x) < batch_size:  # rows of pad tokens without targets: the loss and the count of targets are unchanged
        fill = (batch_size - len(x), x.size(1))
        batches[-1] = torch.cat([x, x.new_full(fill, pad_id)]), torch.cat([y, y.new_full(fill, -1)])
    tokens = units.numel() if pack else total  # whole windows, or the rows' non-pad tokens
    return Validation(batches[rank::world_size], sha256, tokens, short=total < goal)


class Validation(list):
    """validation_batches' batches, and sha256: a digest of the whole set's tokens, the same at any batch size and
    on every rank, which a resumed run compares with its checkpoint's (train.py); tokens: the set's, as eval_tokens
    counts them; short: the shards held fewer than eval_tokens, so the set is all of them (train.py says so)."""

    def __init__(self, batches, sha256, tokens=None, short=False):
        super().__init__(batches)
        self.sha256, self.tokens, self.short = sha256, tokens, short


# ----------------------------------------------------------------------------- tokenizer training

def _alive(pid):
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def train_tokenizer(data_dir, out_prefix, vocab_size=32000, max_docs=100_000):
    """Train a unigram sentencepiece model on the first max_docs training documents, laid out as T5's
    (pad 0, eos 1, unk 2, no bos), so the repo runs with no download at all. Returns the .model path."""
    shards = find_shards(data_dir, "train")
    texts = itertools.islice(_texts(shards), max_docs)
    lines = (line for t in texts for line in t.split("\n") if line.strip())  # paragraphs fit max_sentence_length
    first = next(lines, None)
    if first is None:
        raise ValueError(f"the train shards of {data_dir} hold no text; download them again (python data.py download "
                         f"--out {data_dir})")
    failed = []

    def checked():  # a bad line raises inside sentencepiece, which would keep only its own source line of it
        try:
            yield first
            yield from lines
        except ValueError as e:
            failed.append(e)
            raise

    out = Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    # written in a folder of its own beside the result, then renamed: a kill or a full disk leaves no half-written
    # PREFIX.model for a run to read. A later call removes the folder a killed one left (its pid is in the name)
    for stale in out.parent.glob(f".{out.name}.*.training"):
        pid = stale.name[len(out.name) + 2:].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".training", dir=out.parent))
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=checked(), model_prefix=str(work / "spm"),
                                       vocab_size=vocab_size, model_type="unigram", pad_id=0, eos_id=1, unk_id=2,
                                       bos_id=-1, num_threads=_cpus(), minloglevel=2)
        os.replace(work / "spm.vocab", f"{out}.vocab")
        os.replace(work / "spm.model", f"{out}.model")  # last: a .model present is a whole pair
    except RuntimeError:
        if failed:
            raise failed[0] from None
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Path(f"{out}.model")


# ----------------------------------------------------------------------------- commands

class Unbroken:
    """stdout (or stderr) that, once its reader is gone (`python train.py | tee log` with tee ended by the job's
    signal, `| head`, a closed terminal), sends what follows to /dev/null instead of raising in the middle of the
    work. For the commands that write files as they print (train.py, export.py, analyze.py, bench.py, suite.py,
    download and train-tokenizer): the stop a run is answering still saves its checkpoint, every output asked for is
    written, and the command exits as its work says. One that writes no file takes SIGPIPE's default instead and
    ends with its reader, at once; a command that writes files it would kill part way (its outputs unwritten, a
    temporary left)."""

    def __init__(self, stream):
        self.stream = stream

    def _gone(self):
        with suppress(OSError):  # fd 1 itself now leads nowhere: the stream's buffer flushes there, at exit too
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            self._gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self._gone()
            with suppress(OSError):
                self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


SHOWN = 10  # bad lines said per shard by stats; the count of the rest follows


def stats(data_dir, tokenizer_path, max_length=256):
    """Read and tokenize every document of every shard (a full check of a folder), one line per shard."""
    sp = load_tokenizer(tokenizer_path)
    shards = find_shards(data_dir, "train") + find_shards(data_dir, "validation")  # both, before any reading
    print(f"{'shard':<48} {'docs':>8} {'tokens':>12} {'tok/doc':>8} {'paper tok/doc':>13} {'truncated':>9}")
    bad = 0
    for path in shards:
        lines = []  # the shard's bad lines: each is said (the first SHOWN), and the reading goes on past them

        def good():
            for lineno, raw in _lines(path):
                try:
                    yield _text(path, lineno, raw)
                except ValueError as e:
                    lines.append(str(e))
        try:
            n = np.array([len(x) for t in _chunks(good(), 1024) for x in sp.encode(t, num_threads=_cpus())])
            if len(n) == 0 and not lines:
                raise ValueError(f"{path} holds no documents; remove it or download it again")
        except ValueError as e:  # a shard that cannot be read on: a finding, not a crash; the next shard is read
            lines.append(str(e))
            n = np.array([])
        for line in lines[:SHOWN]:
            print(f"{path.name:<48} {line}")
        if len(lines) > SHOWN:
            print(f"{path.name:<48} ... and {len(lines) - SHOWN} more bad lines")
        bad += bool(lines)
        if len(n):
            print(f"{path.name:<48} {len(n):>8,} {n.sum():>12,} {n.mean():>8.1f} "
                  f"{np.minimum(n + 1, max_length).mean():>13.1f} {(n + 1 > max_length).mean():>9.1%}")
    return bad


def bench(data_dir, tokenizer_path, batch_size=64, max_length=256, pack=False, num_workers=0, seconds=10.0):
    """Non-pad tokens per second delivered by TrainLoader, counted after the first batch."""
    loader = TrainLoader(data_dir, tokenizer_path, batch_size, max_length, pack=pack, num_workers=num_workers)
    print(f"bench: {len(loader.shards)} train shards, batch {batch_size}, max_length {max_length}, "
          f"{'packed' if pack else 'paper'} mode, {num_workers} workers, {_cpus()} cpus, {seconds:g} s")
    t0 = time.perf_counter()
    batches = iter(loader)
    next(batches)
    t1 = time.perf_counter()
    tokens, rows = 0, 0
    while time.perf_counter() - t1 < seconds:
        x, y = next(batches)
        tokens += int((y >= 0).sum()) + len(y)  # targets plus each row's first token = non-pad tokens
        rows += len(y)
    dt = time.perf_counter() - t1
    print(f"first batch after {t1 - t0:.2f} s; then {rows / dt:,.0f} rows/s, ending in pass {loader.epoch + 1} "
          "of the shards")  # loader.epoch counts from 0
    print(f"tokens/s {tokens / dt:.0f}")


def main(argv=None):
    p = argparse.ArgumentParser(description="C4 shards and tokenizer for train.py (see the docstring of data.py)",
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", metavar="{download,train-tokenizer,stats,bench}")
    d = sub.add_parser("download", help="fetch C4 shards and T5's spiece.model from Hugging Face (resumable)",
                       allow_abbrev=False)
    d.add_argument("--out", default=DEFAULT_DATA_DIR, help="folder for the shards")
    d.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="where to put spiece.model ('' to skip it)")
    d.add_argument("--train_shards", type=int, default=None, help="fetch the first N train shards (of 1024; default 1)")
    d.add_argument("--validation_shards", type=int, default=None,
                   help="fetch the first N validation shards (of 8; default 1)")
    d.add_argument("--shards", nargs="+", help="exact shard names instead, e.g. c4-train.00007-of-01024.json.gz")
    d.add_argument("--base_url", default=None, help=f"mirror to fetch from (default $HF_ENDPOINT or {HF_ENDPOINT})")
    t = sub.add_parser("train-tokenizer", help="train a sentencepiece model on the training shards (offline)",
                       allow_abbrev=False)
    t.add_argument("--data_dir", default=DEFAULT_DATA_DIR, help="folder of shards")
    t.add_argument("--out", default="data/spm", help="output prefix: writes PREFIX.model and PREFIX.vocab")
    t.add_argument("--vocab_size", type=int, default=32000, help="number of pieces (T5: 32000)")
    t.add_argument("--max_docs", type=int, default=100_000, help="train on the first N training documents")
    t.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model and PREFIX.vocab")
    for name, what in (("stats", "docs and tokens per document of every shard (reads every line)"),
                       ("bench", "loader throughput; last line 'tokens/s N'")):
        c = sub.add_parser(name, allow_abbrev=False, help=what)
        c.add_argument("--data_dir", default=DEFAULT_DATA_DIR, help="folder of shards")
        c.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="sentencepiece model file")
        c.add_argument("--max_length", type=int, default=256, help="sequence length (paper: 256)")
    c.add_argument("--batch_size", type=int, default=64, help="rows per batch")
    c.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes")
    c.add_argument("--pack", action="store_true", help="packed mode instead of the paper's padded rows")
    c.add_argument("--seconds", type=float, default=10.0, help="how long to measure")
    args = p.parse_args(argv)
    paths = {"download": ("--out",),  # (its --tokenizer '' is its own: fetch no tokenizer)
             "train-tokenizer": ("--data_dir", "--out")}.get(args.command, ("--data_dir", "--tokenizer"))
    if refusal := empty_path_refusal(args, paths):
        p.error(refusal)
    check_args(p, args)
    if args.command == "download":
        try:  # named shards are checked and replaced if bad: the fix that a truncated shard's message gives
            download(args.out, args.tokenizer or None, args.shards, args.base_url, recheck=bool(args.recheck))
        except (ConnectionError, ValueError) as e:
            raise SystemExit(str(e)) from None
        except KeyboardInterrupt as e:  # the files fetched whole stay; a cut one's .part is resumed (fetch's message)
            raise SystemExit(f"download: interrupted; {str(e) or 'run the same command again to go on'}") from None
    elif args.command == "train-tokenizer":
        try:
            print(f"trained {train_tokenizer(args.data_dir, args.out, args.vocab_size, args.max_docs)}")
        except (OSError, ValueError) as e:
            raise SystemExit(f"train-tokenizer: {e}") from None
        except RuntimeError as e:  # sentencepiece's, e.g. too many pieces for the text
            message = str(e).strip().splitlines()[-1].rsplit("] ", 1)[-1]  # without sentencepiece's source line
            raise SystemExit(f"train-tokenizer: {message}") from None
    elif args.command == "stats":
        try:
            bad = stats(args.data_dir, args.tokenizer, args.max_length)
        except (OSError, ValueError) as e:  # no folder, no tokenizer: nothing to read
            raise SystemExit(str(e)) from None
        if bad:
            raise SystemExit(f"{bad} shard(s) failed; see the lines above")
    elif args.command == "bench":
        try:
            bench(args.data_dir, args.tokenizer, args.batch_size, args.max_length, args.pack, args.num_workers,
                  args.seconds)
        except (OSError, ValueError) as e:  # a worker's carries its traceback: the message is its last line
            raise SystemExit(one_line(e)) from None
        except SharedMemoryFull as e:
            raise SystemExit(f"{one_line(e)}: free some, or use --num_workers 0") from None
    else:
        p.print_help()  # a bare `python data.py` explains itself rather than doing something surprising


def check_args(p, args):
    """Every number checked before any work (or network): a bad one is one line naming the fix."""
    if args.command == "download":
        if args.shards and (args.train_shards is not None or args.validation_shards is not None):
            p.error("--shards names the shards to fetch, --train_shards and --validation_shards count them: pass one "
                    "or the other")
        args.train_shards = 1 if args.train_shards is None else args.train_shards
        args.validation_shards = 1 if args.validation_shards is None else args.validation_shards
    at_least = {"download": dict(train_shards=0, validation_shards=0), "train-tokenizer": dict(max_docs=1),
                "stats": dict(max_length=2), "bench": dict(max_length=2, batch_size=1, num_workers=0)}
    for name, low in at_least.get(args.command, {}).items():
        if getattr(args, name) < low:
            p.error(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.command in ("stats", "bench"):
        from model import length_refusal  # here only: the loader's workers import this module
        if refusal := length_refusal(args.max_length):
            p.error(refusal)
    if args.command == "bench":
        from estimate_memory import memory_there
        there = memory_there(torch.device("cpu"))
        row = 3 * 8 * (args.max_length + 1)  # x, y and the row they are cut from, of int64 tokens, at least
        if there and args.batch_size * row > there[1] * there[0]:
            available, share, where = there
            p.error(f"--batch_size {args.batch_size} rows of {args.max_length + 1} tokens need about "
                    f"{args.batch_size * row / 1e9:.1f} GB, more than {share:.0%} of {where}; pass --batch_size "
                    f"{int(share * available // row)} or less")
        if args.num_workers > _cpus():
            p.error(f"--num_workers must be at most {_cpus()}, the CPUs this process may use, got {args.num_workers}")
    if args.command == "train-tokenizer" and args.vocab_size < 4:  # pad, eos, unk and one piece
        p.error(f"--vocab_size must be at least 4 (pad, eos, unk and a piece), got {args.vocab_size}")
    if args.command == "train-tokenizer" and (args.out.endswith(("/", os.sep)) or Path(args.out).is_dir()):
        # a prefix, not a folder: "dir/" wrote dir.model beside the folder, not in it
        p.error(f"--out {args.out} is a folder, and --out is a prefix (it writes PREFIX.model and PREFIX.vocab); pass "
                f"one in it, such as {Path(args.out) / 'spm'}")
    if args.command == "train-tokenizer" and Path(f"{args.out}.model").exists() and not args.overwrite:
        p.error(f"--out {args.out}: {args.out}.model exists, and runs trained with it are checked against it (their "
                "checkpoints keep its sha256); pass another --out, or --overwrite to replace it")
    if args.command == "bench" and not 0 < args.seconds < float("inf"):  # inf measured forever; `not <`: NaN too
        p.error(f"--seconds must be a positive number of seconds, got {args.seconds}")
    if args.command == "download":
        args.recheck = args.shards is not None
        try:
            args.shards = args.shards or shard_names(args.train_shards, args.validation_shards)
        except ValueError as e:
            p.error(f"{e}: pass --train_shards and --validation_shards within them")


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    if sys.argv[1:2] in (["stats"], ["bench"]):  # they write no file: a reader that stops (| head) ends them at once
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    else:  # download and train-tokenizer write files while they print: they go on (Unbroken)
        sys.stdout = Unbroken(sys.stdout)
    main()
