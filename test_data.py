"""
Tests for data.py: tiny C4-style shards and a sentencepiece model trained here, and the real samples in
../shared/data when they are present (the downloads are test_download.py's).

    python -m pytest -q test_data.py
"""
import gzip
import io
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

import data
import download

REAL = Path(__file__).resolve().parent.parent / "shared" / "data"
needs_real = pytest.mark.skipif(not (REAL / "t5_spiece.model").exists(), reason=f"no real data in {REAL}")
L = 16  # max_length for the tiny corpus: most documents get truncated, some get padded
TRAIN_SIZES = {"c4-train.00000-of-01024.json.gz": 60, "c4-train.00001-of-01024.json.gz": 36,
               "olmo-c4-sample.00000-of-00001.jsonl": 24}  # multiples of 6, so 1, 2 or 3 ranks split evenly


def make_docs(first, n, rng):
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(1 + i % 3)) for i in range(400)]
    docs = [f"doc {i} " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 50)))
            for i in range(first, first + n)]
    i = n // 2  # a long run without spaces: the paper-mode prefix is too short and the whole text is encoded
    docs[i] = docs[i][:len(f"doc {first + i}")] + " " + "kalo" * 100 + docs[i][len(f"doc {first + i}"):]
    return docs


def write_shard(path, docs, key="timestamp"):
    lines = "".join(json.dumps({"text": t, key: "2019-04-25T12:57:54Z", "url": "x"}) + "\n" for t in docs)
    path.write_bytes(gzip.compress(lines.encode()) if path.name.endswith(".gz") else lines.encode())


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    folder, rng, docs = tmp_path_factory.mktemp("c4"), random.Random(0), {}
    for name, n in TRAIN_SIZES.items():
        docs[name] = make_docs(sum(map(len, docs.values())), n, rng)
        write_shard(folder / name, docs[name], key="date" if "olmo" in name else "timestamp")
    docs["validation"] = make_docs(1000, 50, rng)
    write_shard(folder / "c4-validation.00000-of-00008.json.gz", docs["validation"])
    return folder, docs


@pytest.fixture(scope="session")
def tok(corpus, tmp_path_factory):
    return data.train_tokenizer(corpus[0], tmp_path_factory.mktemp("tok") / "spm", vocab_size=300)


def ref_row(sp, text, max_length):
    """The paper's sequence, straight from the definition: doc[:max_length-1] + EOS, -1 for padding."""
    ids = sp.encode(text)[:max_length - 1] + [sp.eos_id()]
    return tuple(ids + [-1] * (max_length - len(ids)))


def rows_of(batches):
    """Paper-mode sequences back from (x, y): seq = x[:, :1] followed by y; without the rows of padding that fill up
    the last validation batch (the pad token throughout, no targets)."""
    return [tuple(r) for x, y in batches for r, xr in zip(torch.cat([x[:, :1], y], 1).tolist(), x)
            if not ((xr == xr[0]).all() and r[1:].count(-1) == len(r) - 1)]


def take(loader, n):
    return list(itertools.islice(iter(loader), n))


def assert_same(got, want):
    assert len(got) == len(want), f"{len(got)} batches vs {len(want)}"
    for i, ((x, y), (x2, y2)) in enumerate(zip(got, want)):
        assert torch.equal(x, x2) and torch.equal(y, y2), f"batch {i} differs: {(x != x2).sum()} inputs differ"


def train_loader(corpus, tok, **kw):
    kw = {"batch_size": 4, "max_length": L, "block_docs": 8, **kw}
    return data.TrainLoader(corpus[0], tok, **kw)


def all_train_docs(corpus):
    return [t for name in TRAIN_SIZES for t in corpus[1][name]]


# ----------------------------------------------------------------------------- files and tokenizer

def test_find_shards_split_rule(corpus, tmp_path):
    folder = corpus[0]
    assert [p.name for p in data.find_shards(folder, "train")] == sorted(TRAIN_SIZES)  # the olmo sample is train
    assert [p.name for p in data.find_shards(folder, "validation")] == ["c4-validation.00000-of-00008.json.gz"]
    with pytest.raises(FileNotFoundError, match="--data_dir"):
        data.find_shards(tmp_path / "missing", "train")
    with pytest.raises(FileNotFoundError, match="--download"):
        data.find_shards(tmp_path, "train")
    write_shard(tmp_path / "c4-train.00000-of-01024.json.gz", ["a b"])
    (tmp_path / "c4-validation.00000-of-00008.json.gz.part").write_bytes(b"unfinished download")
    with pytest.raises(FileNotFoundError, match="contains 'validation'"):
        data.find_shards(tmp_path, "validation")
    with pytest.raises(ValueError, match="split"):
        data.find_shards(folder, "valid")
    shard = tmp_path / "c4-train.00000-of-01024.json.gz"  # a shard where its folder belongs
    with pytest.raises(FileNotFoundError, match=rf"^--data_dir {shard} is a file; pass the folder that holds the "
                                                rf"shards \({tmp_path}\?\)$"):
        data.find_shards(shard, "train")


def test_a_shard_there_gzipped_and_not_is_refused(tmp_path):
    """gunzip -k leaves a shard beside its .json.gz: both were read, every one of its documents twice a pass."""
    write_shard(tmp_path / "c4-train.00000-of-01024.json.gz", ["a b", "c d"])
    write_shard(tmp_path / "c4-train.00001-of-01024.json.gz", ["e f"])
    with gzip.open(tmp_path / "c4-train.00000-of-01024.json.gz", "rb") as f:
        (tmp_path / "c4-train.00000-of-01024.json").write_bytes(f.read())
    for split in ("train", "validation"):  # either split: the folder is one run's data
        with pytest.raises(ValueError, match=r"c4-train.00000-of-01024.json.gz also there unzipped "
                                             r"\(c4-train.00000-of-01024.json\): one shard twice; remove one"):
            data.find_shards(tmp_path, split)
    (tmp_path / "c4-train.00000-of-01024.json.gz").unlink()
    assert [p.name for p in data.find_shards(tmp_path, "train")] == ["c4-train.00000-of-01024.json",
                                                                     "c4-train.00001-of-01024.json.gz"]


def test_tokenizer_layout_and_errors(tok, tmp_path):
    sp = data.load_tokenizer(tok)
    got = (sp.vocab_size(), sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id())
    assert got == (300, 0, 1, 2, -1), f"trained tokenizer layout {got}, want T5's (300, 0, 1, 2, -1)"
    assert data._Encoder(tok, L, 1).prefix_ok
    with pytest.raises(FileNotFoundError, match="train-tokenizer --data_dir data/c4 "):
        data.load_tokenizer(tmp_path / "none.model")
    with pytest.raises(FileNotFoundError, match="train-tokenizer --data_dir my/shards "):  # the run's data folder
        data.load_tokenizer(tmp_path / "none.model", "my/shards")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model"):
        data.load_tokenizer(tmp_path / "bad.model")


# ----------------------------------------------------------------------------- sequences

def test_paper_rows_cover_each_document_once_per_pass(corpus, tok):
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), all_train_docs(corpus)
    batches = take(train_loader(corpus, tok), 2 * len(docs) // 4)  # two passes of 30 batches
    for x, y in batches:
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (4, L - 1), f"{x.dtype} {x.shape}"
        pad = y[:, :-1] < 0
        assert torch.equal(x[:, 1:][~pad], y[:, :-1][~pad]), "y is not x shifted by one"
        assert (x[:, 1:][pad] == sp.pad_id()).all(), "inputs under ignored targets must be the pad id"
    want = Counter(ref_row(sp, t, L) for t in docs)
    first, second = rows_of(batches[:30]), rows_of(batches[30:])
    assert Counter(first) == want, f"pass 0 differs from the reference in {len(Counter(first) - want)} rows"
    assert Counter(second) == want, f"pass 1 differs from the reference in {len(Counter(second) - want)} rows"
    assert first != second, "the second pass must be reshuffled"
    assert rows_of(take(train_loader(corpus, tok), 30)) == first, "same seed, different batches"
    assert rows_of(take(train_loader(corpus, tok, seed=7), 30)) != first, "a different seed gave the same order"


def test_packed_windows_are_the_document_stream(corpus, tok):
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), all_train_docs(corpus)
    batches = take(train_loader(corpus, tok, pack=True), 150)
    for x, y in batches:
        assert x.shape == y.shape == (4, L) and (y >= 0).all() and torch.equal(x[:, 1:], y[:, :-1])
    stream = torch.cat([torch.cat([x, y[:, -1:]], 1).flatten() for x, y in batches]).tolist()
    seqs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == sp.eos_id():
            seqs.append(tuple(cur))
            cur = []
    want = Counter(tuple(sp.encode(t) + [sp.eos_id()]) for t in docs)
    assert len(seqs) > len(docs), f"test needs more batches: {len(seqs)} documents seen"
    assert Counter(seqs[:len(docs)]) == want, "the first pass of packed windows is not every document + EOS once"


def test_paper_fast_path_matches_full_encoding(corpus, tok):
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), all_train_docs(corpus)
    for max_length in (4, L, 64):
        rows = data._Encoder(tok, max_length, 2).paper(docs)
        want = [ref_row(sp, t, max_length) for t in docs]
        bad = [i for i, (r, w) in enumerate(zip(map(tuple, rows.tolist()), want)) if r != w]
        assert not bad, f"max_length {max_length}: documents {bad} differ from encode-then-truncate"


# ----------------------------------------------------------------------------- order, ranks, resume

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_partition_the_documents(corpus, tok, world_size):
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), all_train_docs(corpus)
    doc_of = {ref_row(sp, t, L): i for i, t in enumerate(docs)}
    assert len(doc_of) == len(docs), "test corpus rows must be unique"
    share = len(docs) // world_size  # every shard size is a multiple of 6
    per_rank = [{doc_of[r] for r in rows_of(take(train_loader(corpus, tok, batch_size=1, rank=r,
                                                              world_size=world_size), share))}
                for r in range(world_size)]
    assert set().union(*per_rank) == set(range(len(docs))), "the ranks together miss documents"
    for a, b in itertools.combinations(range(world_size), 2):
        assert not per_rank[a] & per_rank[b], f"ranks {a} and {b} share documents {per_rank[a] & per_rank[b]}"
    # uneven shard sizes: the per-shard split still covers every line exactly once
    path = corpus[0] / "c4-train.00001-of-01024.json.gz"
    for n in (35, 36, 37):
        lines = [[ln for ln, _ in data._shard_docs(path, 42, 1, 0, r, world_size, n)] for r in range(world_size)]
        got = sorted(itertools.chain(*lines))
        assert got == list(range(1, 37)), f"buffer {n}: lines {Counter(got) - Counter(range(1, 37))} repeated"


def doc_shard(tmp_path, n):
    """A plain JSON-lines shard of n one-word documents: _shard_docs gives line numbers 1..n."""
    path = tmp_path / f"c4-train.{n:05d}-of-01024.json"
    if not path.exists():
        write_shard(path, [f"d{i}" for i in range(n)])
    return path


def shard_order(path, seed, buffer, epoch=0, pos=0):
    """The shard's documents (0-based file index) in the order one rank of one reads them."""
    return [ln - 1 for ln, _ in data._shard_docs(path, seed, epoch, pos, 0, 1, buffer)]


def test_shuffle_reaches_every_permutation_evenly():
    """_shuffle is Fisher-Yates: each of the 4! orders equally likely, orders that leave an item in place included.
    (Sattolo's variant, j < i, reaches only the 3! cycles and never leaves an item in place.) Fixed seeds: the
    counts are the same every run, and the bounds sit far outside what uniform counts give."""
    seeds = 4800
    counts = Counter(tuple(data._shuffle(list(range(4)), random.Random(f"perm/{s}"))) for s in range(seeds))
    assert len(counts) == 24, f"{len(counts)} of 24 permutations reached: {sorted(counts)}"
    expected = seeds / 24
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 70, f"chi-square {chi2:.1f} over 23 degrees of freedom (mean 23), counts {dict(counts)}"
    stays = sum(c for p, c in counts.items() if p[0] == 0) / seeds
    assert 0.2 < stays < 0.3, f"item 0 stays first in {stays:.3f} of the shuffles, want ~1/4"


def test_a_shard_within_the_buffer_is_shuffled_uniformly(tmp_path):
    """With a buffer at least the shard's size every document waits in it, so the order is the final shuffle of the
    buffer alone: that shuffle must happen (else every pass reads the shard in file order) and be uniform."""
    n, seeds, path = 10, 1000, doc_shard(tmp_path, 10)
    for buffer in (n, 3 * n):
        orders = [shard_order(path, s, buffer) for s in range(seeds)]
        in_file_order = sum(o == list(range(n)) for o in orders)
        assert in_file_order <= 1, f"buffer {buffer}: {in_file_order} of {seeds} seeds read the shard in file order"
        at = Counter((doc, i) for o in orders for i, doc in enumerate(o))
        worst = max(((doc, i) for doc in range(n) for i in range(n)), key=lambda k: abs(at[k] - seeds / n))
        assert abs(at[worst] - seeds / n) < 50, (f"buffer {buffer}: document {worst[0]} at position {worst[1]} in "
                                                 f"{at[worst]} of {seeds} seeds, want ~{seeds // n}")


def test_the_sliding_buffer_draws_from_every_slot(tmp_path):
    """A buffer smaller than the shard: each new document swaps out a uniformly drawn slot, the last one included.
    The first `buffer` documents fill the slots, so each leaves while the shard still streams (position < n - buffer)
    in 1 - (7/8)^32 ~ 98.6% of seeds; a draw that skips a slot keeps its document to the final shuffle."""
    n, buffer, seeds, path = 40, 8, 2000, doc_shard(tmp_path, 40)
    position = [[0] * n for _ in range(seeds)]
    for s in range(seeds):
        for i, doc in enumerate(shard_order(path, s, buffer)):
            position[s][doc] = i
    for doc in range(buffer):
        early = sum(p[doc] < n - buffer for p in position) / seeds
        mean = sum(p[doc] for p in position) / seeds
        assert early > 0.95, (f"document {doc} (slot {doc}) leaves before the final shuffle in {early:.3f} of "
                              f"seeds, want ~0.986 (mean position {mean:.1f})")


def test_each_pass_reshuffles_a_shard(tmp_path):
    """The shard's own order is seeded by the epoch too: the same shard at the same position reads differently in the
    next pass, through the sliding buffer and through the final shuffle alike, and the same in a rerun."""
    path = doc_shard(tmp_path, 40)
    for seed, pos, buffer in itertools.product((0, 42), (0, 2), (8, 40)):
        first, second = (shard_order(path, seed, buffer, epoch, pos) for epoch in (0, 1))
        assert first == shard_order(path, seed, buffer, 0, pos), "same seed, epoch and position, different order"
        assert first != second, f"seed {seed}, position {pos}, buffer {buffer}: epochs 0 and 1 both read {first}"


def test_each_pass_reorders_the_shards(corpus, tok):
    """The shard order is reshuffled every pass, not only the documents inside each shard: with a fixed shard order
    every pass would, e.g., end on the same shard. Three shards have 6 orders; over 6 seeds some seed must read them
    in a different order in pass 1 than in pass 0."""
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    shard_of = {ref_row(sp, t, L): name for name in TRAIN_SIZES for t in corpus[1][name]}
    per_pass = sum(TRAIN_SIZES.values())  # rows: 30 batches of 4
    orders = []
    for seed in range(6):
        rows = rows_of(take(train_loader(corpus, tok, seed=seed), 2 * per_pass // 4))
        orders.append([list(dict.fromkeys(shard_of[r] for r in rows[e * per_pass:(e + 1) * per_pass])) for e in (0, 1)])
        assert all(sorted(o) == sorted(TRAIN_SIZES) for o in orders[-1]), f"seed {seed}: {orders[-1]}"
    assert any(a != b for a, b in orders), f"every seed reads the shards in the same order in both passes: {orders}"
    assert len({tuple(a) for a, _ in orders}) > 1, f"every seed reads the shards in the same order: {orders}"


@pytest.mark.parametrize("pack", [False, True])
def test_same_batches_for_any_number_of_workers(corpus, tok, pack):
    want = take(train_loader(corpus, tok, pack=pack), 45)  # past the end of the first pass
    for workers in (1, 2):
        assert_same(take(train_loader(corpus, tok, pack=pack, num_workers=workers), 45), want)


@pytest.mark.parametrize("pack,workers", [(False, 0), (False, 2), (True, 0), (True, 2)])
def test_resume_gives_the_uninterrupted_batches(corpus, tok, pack, workers):
    want = take(train_loader(corpus, tok, pack=pack), 40)
    cuts = [17] if workers else [0, 1, 5, 17, 29, 30, 31, 39]  # mid-block, at and after the end of a pass
    for cut in cuts:
        first = train_loader(corpus, tok, pack=pack, num_workers=workers)
        assert_same(take(first, cut), want[:cut])
        buf = io.BytesIO()
        torch.save({"loader": first.state_dict()}, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)["loader"]
        resumed = train_loader(corpus, tok, pack=pack, num_workers=workers)
        resumed.load_state_dict(state)
        got = take(resumed, 40 - cut)
        assert len(got) == 40 - cut
        for i, ((x, y), (x2, y2)) in enumerate(zip(got, want[cut:])):
            assert torch.equal(x, x2) and torch.equal(y, y2), f"resumed at {cut}: batch {cut + i} differs"


def test_state_dict_checks(corpus, tok):
    loader = train_loader(corpus, tok)
    take(loader, 3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed"):
        train_loader(corpus, tok, seed=1).load_state_dict(state)
    ranks = [train_loader(corpus, tok, rank=r, world_size=2) for r in range(2)]
    for ld in ranks:
        take(ld, 2 + ld.rank)
    states = [ld.state_dict() for ld in ranks]  # what train.py gathers from every rank
    fresh = train_loader(corpus, tok, rank=1, world_size=2)
    fresh.load_state_dict(states)
    assert fresh.state_dict() == states[1]
    with pytest.raises(ValueError, match="rank=0 but this one has 1"):  # one rank's position alone, of another world
        fresh.load_state_dict(train_loader(corpus, tok).state_dict())
    with pytest.raises(ValueError, match="seed"):  # every rank's, of another run: refused, not taken on
        train_loader(corpus, tok).load_state_dict([dict(state, seed=1) for state in states])


def pairs(loader, doc_of, n=None, through=None):
    """(pass, document) of each row a batch_size-1 loader gives from its position on: n of them, or every one
    through pass `through`."""
    got = []
    for batch in loader:
        epoch = loader.state_dict()["epoch"]  # the pass of the row just given
        if through is not None and epoch > through:
            return got
        got += [(epoch, doc_of[row]) for row in rows_of([batch])]
        if len(got) == n:
            return got


def resumed_on(corpus, tok, states, world, **kw):
    """A run of `world` batch_size-1 ranks resumed from states, every rank's, as train.py gathers them."""
    ranks = [train_loader(corpus, tok, rank=r, world_size=world, batch_size=1, shuffle_buffer=16, **kw)
             for r in range(world)]
    for ld in ranks:
        ld.load_state_dict(states)
        assert ld.regathered == ranks[0].regathered and ld.state_dict()["world_size"] == world
    return ranks


def assert_counted_again(corpus, tok, states, world, trained, doc_of, **kw):
    """The documents that a resumed run, gone on to the end of the last pass begun, trains on and that some run
    before it had trained on (`trained`: (pass, document)) are as many as its resume counted."""
    ranks, through = resumed_on(corpus, tok, states, world, **kw), max(e for e, _ in trained)
    again = {pair for ld in ranks for pair in pairs(ld, doc_of, through=through)} & set(trained)
    assert len(again) == ranks[0].regathered["seen_again"], (len(again), ranks[0].regathered)
    return ranks[0].regathered


@pytest.mark.parametrize("worlds", [(5, 2), (7, 3), (2, 5), (5, 3, 2), (3, 7, 1)])
@pytest.mark.parametrize("taken", [0, 1, 5, 13, 27])
def test_a_run_resumed_on_another_number_of_ranks_trains_on_every_document(corpus, tok, worlds, taken):
    """A run on worlds[0] ranks, resumed on worlds[1] (then on worlds[2]): every document of every pass is trained
    on, and at each resume the documents trained on before that come again are the ones it counted (checked by a
    copy of the resumed run gone on to the end of the last pass begun). Shards of 60, 36 and 24 documents split
    unevenly over 5 or 7 ranks, which then stand at different places of the stream (one a shard further on). A
    shuffle buffer smaller than the shards: documents are dealt as the buffer draws them, and from the buffer's end."""
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), all_train_docs(corpus)
    doc_of = {ref_row(sp, t, L): i for i, t in enumerate(docs)}
    states, trained, again = None, Counter(), 0
    for i, world in enumerate(worlds):
        if states:
            ranks = resumed_on(corpus, tok, states, world)
            assert ranks[0].regathered["processes"] == len(states)
            if trained:
                again += assert_counted_again(corpus, tok, states, world, trained, doc_of)["seen_again"]
        else:
            ranks = [train_loader(corpus, tok, rank=r, world_size=world, batch_size=1, shuffle_buffer=16)
                     for r in range(world)]
        for ld in ranks:
            if i < len(worlds) - 1:  # a run stopped after `taken` rows a rank
                trained.update(pairs(ld, doc_of, n=taken) if taken else [])
            else:  # the last goes on to the end of the last pass any rank had begun
                trained.update(pairs(ld, doc_of, through=max(s["epoch"] for s in states)))
        states = [ld.state_dict() for ld in ranks]
    passes = max(e for e, _ in trained) + 1
    assert set(trained) == {(e, d) for e in range(passes) for d in range(len(docs))}, "documents were left out"
    if taken >= 5 and worlds[0] in (5, 7):  # ranks out of step: some documents are trained on twice
        assert sum(trained.values()) > len(trained) and again > 0


def test_a_second_change_of_processes_counts_what_the_run_before_the_first_had_trained(corpus, tok):
    """Five ranks, one of them 30 documents further on than the others; resumed on two, which stop (and resume on
    two) after reaching few of the documents that one had trained on; then on three: the rest come again in the third
    run, and its resume counts them, though the checkpoint's two ranks had not trained on them."""
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), all_train_docs(corpus)
    doc_of = {ref_row(sp, t, L): i for i, t in enumerate(docs)}
    five = [train_loader(corpus, tok, rank=r, world_size=5, batch_size=1, shuffle_buffer=16) for r in range(5)]
    trained = Counter(pair for ld in five for pair in pairs(ld, doc_of, n=36 if ld.rank == 4 else 6))
    two = resumed_on(corpus, tok, [ld.state_dict() for ld in five], 2)
    first = assert_counted_again(corpus, tok, [ld.state_dict() for ld in five], 2, trained, doc_of)
    trained.update(pair for ld in two for pair in pairs(ld, doc_of, n=1))
    two = resumed_on(corpus, tok, [ld.state_dict() for ld in two], 2)  # stopped and resumed on as many: as it was
    assert two[0].regathered is None
    trained.update(pair for ld in two for pair in pairs(ld, doc_of, n=1))
    third = assert_counted_again(corpus, tok, [ld.state_dict() for ld in two], 3, trained, doc_of)
    assert first["seen_again"] >= third["seen_again"] >= 20, (first, third)  # rank 4's, still ahead


def test_a_rank_that_used_up_its_share_of_a_shard_stands_at_the_next_one(corpus, tok):
    """A rank that has trained on all its documents of a shard and not yet begun the next stands at the next shard's
    start: the run goes on from the first document there that no rank had trained on, none trained on twice. At the
    end of a pass, the next pass's first document."""
    n0 = TRAIN_SIZES[train_loader(corpus, tok).order(0)[0].name]  # the first shard of pass 0: 60 documents
    ranks = [train_loader(corpus, tok, rank=r, world_size=2, batch_size=1, block_docs=100) for r in range(2)]
    take(ranks[0], n0 // 2 + 2)  # rank 0: documents 0 and 2 of the next shard
    take(ranks[1], n0 // 2)  # rank 1: all of its share of the first shard, nothing more
    one = train_loader(corpus, tok, batch_size=1, block_docs=100)
    one.load_state_dict([ld.state_dict() for ld in ranks])
    assert one.regathered == dict(processes=2, epoch=0, shard=1, document=1, seen_again=1, begun_again=0)
    every = sum(TRAIN_SIZES.values())
    ranks = [train_loader(corpus, tok, rank=r, world_size=2, batch_size=1, block_docs=100) for r in range(2)]
    for ld in ranks:
        take(ld, every // 2)  # the whole pass between them
    one = train_loader(corpus, tok, batch_size=1, block_docs=100)
    one.load_state_dict([ld.state_dict() for ld in ranks])
    assert one.regathered == dict(processes=2, epoch=1, shard=0, document=0, seen_again=0, begun_again=0)


@pytest.mark.parametrize("worlds", [(5, 2), (2, 3), (7, 3)])
@pytest.mark.parametrize("taken", [1, 5, 13])
def test_a_packed_run_resumed_on_another_number_of_ranks_reads_each_block_begun_again(corpus, tok, worlds, taken,
                                                                                    monkeypatch):
    """Packed windows cut documents, so a rank's block begun is dealt again whole: every document is dealt, and those
    dealt twice are the ones counted. Documents as the ranks draw them (pass, shard, line), a block at a time."""
    drawn, real = [], data._shard_docs

    def drawing(path, seed, epoch, *args):
        for line, raw in real(path, seed, epoch, *args):
            drawn.append((epoch, path.name, line))
            yield line, raw
    monkeypatch.setattr(data, "_shard_docs", drawing)
    old = [train_loader(corpus, tok, rank=r, world_size=worlds[0], pack=True) for r in range(worlds[0])]
    for ld in old:
        take(ld, taken)
    begun, states, drawn[:] = set(drawn), [ld.state_dict() for ld in old], []
    last = max(s["epoch"] for s in states)
    for r in range(worlds[1]):
        ld = train_loader(corpus, tok, rank=r, world_size=worlds[1], pack=True)
        ld.load_state_dict(states)
        for _ in ld:
            if ld.state_dict()["epoch"] > last:
                break
    after = {doc for doc in drawn if doc[0] <= last}
    assert begun | after == {(e, name, line) for e in range(last + 1) for name, n in TRAIN_SIZES.items()
                             for line in range(1, n + 1)}
    assert len(begun & after) == ld.regathered["seen_again"] + ld.regathered["begun_again"] > 0
    if taken == 1:  # a window a rank: each rank's first block begun, none finished, so none counted as trained on
        assert ld.regathered["seen_again"] == 0, ld.regathered


def test_a_regathered_run_resumes_on_as_many_ranks_exactly(corpus, tok):
    """After a resume on another number of ranks, a checkpoint of the new run resumes as any other: the same batches
    as without the stop."""
    ranks = [train_loader(corpus, tok, rank=r, world_size=5) for r in range(5)]
    for ld in ranks:
        take(ld, 2)
    states = [ld.state_dict() for ld in ranks]
    straight, stopped = (train_loader(corpus, tok, rank=1, world_size=2) for _ in range(2))
    for ld in (straight, stopped):
        ld.load_state_dict(states)
    want = take(straight, 20)
    got = take(stopped, 7)
    resumed = train_loader(corpus, tok, rank=1, world_size=2)
    resumed.load_state_dict([None, stopped.state_dict()])
    assert resumed.regathered is None
    assert_same(got + take(resumed, 13), want)


# ----------------------------------------------------------------------------- validation

def test_validation_set_is_fixed(corpus, tok):
    sp, docs = spm.SentencePieceProcessor(model_file=str(tok)), corpus[1]["validation"]
    want = [ref_row(sp, t, L) for t in docs]
    rows = rows_of(data.validation_batches(corpus[0], tok, 3, L, eval_tokens=300))
    tokens = [sum(t >= 0 for t in r) for r in rows]
    assert rows == want[:len(rows)], "validation must be the first documents in file order"
    assert sum(tokens) >= 300 > sum(tokens[:-1]), f"{sum(tokens)} tokens is not the first 300"
    for batch_size, world_size in ((5, 1), (2, 3)):
        parts = [data.validation_batches(corpus[0], tok, batch_size, L, 300, rank=r, world_size=world_size)
                 for r in range(world_size)]
        merged = [b for group in itertools.zip_longest(*parts) for b in group if b is not None]
        assert rows_of(merged) == rows, f"batch_size {batch_size}, world_size {world_size} changed the set"
    assert rows_of(data.validation_batches(corpus[0], tok, 8, L, 10**9)) == want, "short data: use all of it"
    half, more = len(rows) // 2 + 1, len(rows) + 1  # neither divides the rows, nor 4 and 7 the 18 packed windows
    for batch_size, pack in ((half, False), (more, False), (4, True), (7, True)):  # a short last batch, filled up
        batches = data.validation_batches(corpus[0], tok, batch_size, L, 300, pack=pack)
        width = L if pack else L - 1  # a packed window is max_length + 1 tokens, a paper row max_length
        assert {(tuple(x.shape), tuple(y.shape)) for x, y in batches} == {((batch_size, width),) * 2}, "one shape"
        x, y = batches[-1]
        filled = (y == -1).all(1)
        assert filled.any() and (x[filled] == max(spm.SentencePieceProcessor(model_file=str(tok)).pad_id(), 0)).all()
    packed = data.validation_batches(corpus[0], tok, 4, L, eval_tokens=300, pack=True)
    stream = torch.cat([torch.cat([x, y[:, -1:]], 1)[(y != -1).any(1)].flatten() for x, y in packed]).tolist()
    ref = [t for d in docs for t in sp.encode(d) + [sp.eos_id()]]
    assert len(stream) == 18 * (L + 1) and stream == ref[:len(stream)], "packed validation: 18 whole windows"


# ----------------------------------------------------------------------------- bad input

def test_a_shards_fault_record_holds_every_bad_line_and_a_later_cut(tok, tmp_path, monkeypatch):
    """A shard of more lines than the shuffle buffer meets a bad line long before a cut further on (a real C4 shard:
    356k lines, a buffer of 10k). What the checkpoint records of the fault covers both, and all its bad lines: the
    shard downloaded again whole is taken by the resume (with a bad line left as it was too: the run stops there
    again, saying so); one with a line deleted, or another line changed, is refused."""
    rng = random.Random(3)
    good = [json.dumps({"text": t}) + "\n" for t in make_docs(0, 400, rng)]
    broken = list(good)
    broken[20], broken[60] = "not json\n", '{"date": 1}\n'
    folder = tmp_path / "c4"
    folder.mkdir()
    shard = folder / "c4-train.00000-of-01024.json.gz"
    whole = gzip.compress("".join(broken).encode())
    shard.write_bytes(whole[:len(whole) * 3 // 4])  # cut about line 300
    ld = data.TrainLoader(folder, tok, 4, L, shuffle_buffer=8, block_docs=8)
    state = ld.state_dict()
    two = [data.TrainLoader(folder, tok, 4, L, rank=r, world_size=2, shuffle_buffer=8, block_docs=8).state_dict()
           for r in range(2)]  # a run on two processes, resumed on one below
    with pytest.raises(ValueError, match=r":21: not a JSON object"):
        take(ld, 1000)
    fault = ld.fault
    assert fault["line"] == 21 and fault["bad"] == [21, 61] and 250 < fault["cut"] < 400, fault
    changed = good[:5] + [json.dumps({"text": "another document"}) + "\n"] + good[6:]
    for lines, taken in ((good, True), (broken, True), (good[:20] + good[21:], False), (changed, False)):
        shard.write_bytes(gzip.compress("".join(lines).encode()))
        resumed = data.TrainLoader(folder, tok, 4, L, shuffle_buffer=8, block_docs=8)
        if taken:
            resumed.load_state_dict([{**state, "fault": fault}])
            assert resumed.fixed == [shard.name]
            reads = []  # on another number of processes every rank's state is checked; the shard is read once
            kept = data._kept_lines
            monkeypatch.setattr(data, "_kept_lines", lambda *a: (reads.append(a), kept(*a))[1])
            regathered = data.TrainLoader(folder, tok, 4, L, shuffle_buffer=8, block_docs=8)
            regathered.load_state_dict([{**two[0], "fault": fault}, two[1]])
            monkeypatch.undo()
            assert regathered.fixed == [shard.name] and len(reads) == 1, reads
            continue
        with pytest.raises(ValueError, match=f"training shard {shard.name} stopped the run and has changed since, but "
                                             "not as its fix: it must be its bad lines 21, 61 fixed in place and "
                                             "downloaded again whole"):
            resumed.load_state_dict([{**state, "fault": fault}])
    shard.write_bytes(gzip.compress("".join(good).encode()))  # another change than the fix, with no fault recorded
    with pytest.raises(ValueError, match="1 training shard\\(s\\) changed since the checkpoint"):
        data.TrainLoader(folder, tok, 4, L, shuffle_buffer=8, block_docs=8).load_state_dict([state])


def test_bad_input_names_file_line_and_fix(tok, tmp_path):
    rng = random.Random(1)
    good = [json.dumps({"text": t}) for t in make_docs(0, 300, rng)]
    cases = {  # file content -> message expected, raised on construction (first line) or when reading
        "not_json": ("\n".join(good[:2] + ["{oops"] + good[2:]),
                     r"\.json\.gz:3: not a JSON object.*fix that line in place"),
        "no_text": ("\n".join(good[:1] + ['{"date": "2019"}'] + good[1:]), r'\.json\.gz:2: no "text"'),
        "first_line": ("\n".join(["[1, 2]"] + good), r'\.json\.gz:1: no "text"'),
        "surrogate": ("\n".join(good[:3] + ['{"text": "half a pair \\ud800 of surrogates"}'] + good[3:]),
                      r"\.json\.gz:4: the text is not valid Unicode \(surrogates not allowed at character 12\)"),
    }
    for name, (content, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress(content.encode()))
        with pytest.raises(ValueError, match=message):
            take(data.TrainLoader(folder, tok, 4, L), 100)
        (folder / "c4-train.00000-of-01024.json.gz").rename(folder / "c4-validation.00000-of-00008.json.gz")
        with pytest.raises(ValueError, match=message):
            data.validation_batches(folder, tok, 4, L)
    folder = tmp_path / "truncated"
    folder.mkdir()
    whole = gzip.compress("\n".join(good).encode())
    (folder / "c4-train.00000-of-01024.json.gz").write_bytes(whole[:len(whole) // 2])
    loader = data.TrainLoader(folder, tok, 4, L)  # the first lines read fine: the damage shows when reached
    with pytest.raises(ValueError, match=r"c4-train.00000-of-01024.json.gz: cannot read past line \d+.*download"):
        take(loader, 1000)
    (folder / "c4-train.00000-of-01024.json.gz").write_bytes(b"plain text, not gzip")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        data.TrainLoader(folder, tok, 4, L)  # before any work
    (folder / "c4-train.00000-of-01024.json.gz").rename(folder / "my-shard.json.gz")  # a name download refuses
    with pytest.raises(ValueError, match=r"my-shard.json.gz: .*truncated or corrupt: replace it with a whole copy, or "
                                         r"remove it for a new run$"):
        data.TrainLoader(folder, tok, 4, L)
    (folder / "my-shard.json.gz").rename(folder / "c4-train.00000-of-01024.json.gz")
    (folder / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress(b"\n"))
    with pytest.raises(ValueError, match="no documents"):
        data.TrainLoader(folder, tok, 4, L)
    with pytest.raises(ValueError, match="rank"):
        data.TrainLoader(folder, tok, 4, L, rank=2, world_size=2)


def test_packed_validation_shorter_than_a_window_names_the_fix(tok, tmp_path):
    """Fewer validation tokens than one packed window left no row at all, and a reshape crashed."""
    write_shard(tmp_path / "c4-validation.00000-of-00008.json.gz", ["doc one", "doc two"])
    assert data.validation_batches(tmp_path, tok, 4, L), "paper mode scores the short documents"
    with pytest.raises(ValueError, match=rf"hold \d+ tokens, fewer than one window of max_length\+1 = {L + 1}; "
                                         r"lower --max_length or add validation shards"):
        data.validation_batches(tmp_path, tok, 4, L, pack=True)


def test_too_many_ranks_is_an_error(tok, tmp_path):
    write_shard(tmp_path / "c4-train.00000-of-01024.json.gz", ["one document"])
    with pytest.raises(ValueError, match="rank 1 of 2 got no documents"):
        take(data.TrainLoader(tmp_path, tok, 1, L, rank=1, world_size=2), 1)


# ----------------------------------------------------------------------------- tokenizer training

def test_train_tokenizer_replaces_a_model_only_when_asked_and_whole(corpus, tmp_path, capsys):
    """A tokenizer that runs were trained with is kept unless --overwrite says otherwise (their checkpoints hold its
    sha256: a new one would stop them); the new pair is trained aside and renamed, so a failure (here sentencepiece
    refusing too many pieces for the text) leaves the old pair whole and nothing else behind."""
    prefix = tmp_path / "spm"
    argv = ["train-tokenizer", "--data_dir", str(corpus[0]), "--out", str(prefix), "--vocab_size", "200"]
    data.main(argv)
    old = {s: (tmp_path / f"spm.{s}").read_bytes() for s in ("model", "vocab")}
    with pytest.raises(SystemExit):
        data.main(argv)
    assert f"--out {prefix}: {prefix}.model exists" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="Vocabulary size too high"):
        data.main(argv[:-1] + ["5000", "--max_docs", "20", "--overwrite"])
    assert {s: (tmp_path / f"spm.{s}").read_bytes() for s in ("model", "vocab")} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.model", "spm.vocab"]
    (tmp_path / ".spm.999999999.abc.training").mkdir()  # left by a training killed part way (no such pid now)
    data.main(argv[:-1] + ["150", "--overwrite"])
    assert data.load_tokenizer(prefix.with_suffix(".model")).vocab_size() == 150
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.model", "spm.vocab"]


def test_a_folder_for_the_tokenizer_or_its_prefix_names_a_file_in_it(corpus, tmp_path, monkeypatch, capsys):
    """--tokenizer DIR said "not found; fetch T5's (python data.py download --tokenizer DIR)", which download then
    refused (a folder): the message says it is a folder and names a file in it that download fetches to. And
    train-tokenizer --out DIR/ (or DIR) wrote DIR.model beside the folder: --out is a prefix, so it is refused."""
    folder = tmp_path / "tokdir"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match=f"tokenizer {folder} is a folder; pass the sentencepiece model file, "
                                                f"such as {folder / 'spiece.model'}") as e:
        data.load_tokenizer(folder)
    named = Path(re.search(r"download --train_shards 0 --validation_shards 0 --tokenizer (\S+) fetches",
                           str(e.value)).group(1))
    fetched = []
    monkeypatch.setattr(download, "fetch", lambda url, dest, *a, **kw: fetched.append(Path(dest)))  # no network
    download.download(tmp_path / "c4", named, shards=[])  # the command the message names is one download takes
    assert fetched == [folder / "spiece.model"], fetched
    for out in (f"{folder}{os.sep}", str(folder)):
        with pytest.raises(SystemExit):
            data.main(["train-tokenizer", "--data_dir", str(corpus[0]), "--out", out, "--vocab_size", "100"])
        err = capsys.readouterr().err
        assert f"is a folder, and --out is a prefix (it writes PREFIX.model and PREFIX.vocab); pass one in it, such " \
               f"as {folder / 'spm'}" in err, err
    assert list(tmp_path.iterdir()) == [folder] and list(folder.iterdir()) == [], "nothing is written"


def test_an_unreadable_tokenizer_names_a_command_that_fetches_it(tmp_path, monkeypatch):
    """A --tokenizer file that is no sentencepiece model (a failed fetch's error page, a file named by mistake) said
    "fetch T5's (python data.py download --tokenizer PATH)": download keeps a file already there, so that command
    fetched a train and a validation shard into data/c4 and left the file as it was. The message now says to move it
    aside first, and its command fetches the tokenizer alone."""
    bad = tmp_path / "spiece.model"
    bad.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(ValueError, match="is not a readable sentencepiece model") as e:
        data.load_tokenizer(bad)
    if "move it aside" in str(e.value):  # as the message says, before its command
        bad.rename(tmp_path / "spiece.model.bad")
    argv = re.search(r"\(python data\.py (download [^)]*)\)", str(e.value)).group(1).split()
    fetched = []
    monkeypatch.setattr(download, "fetch", lambda url, dest, *a, **kw: fetched.append(Path(dest)))  # no network
    monkeypatch.chdir(tmp_path)  # download's default --out, data/c4, is made here
    data.main(argv)
    assert fetched == [bad], f"the message's command fetched {fetched}, not {bad}"


def read_then_stop(argv, stderr_too=False):
    """`python ARGV | head -0`, or `| tee log` with tee ended: a command whose stdout's reader closes it before the
    first line, so that every line the command prints meets the closed pipe (a reader that stops after a few lines,
    as head does, is the same for the lines after them, but leaves to chance which those are). Unbuffered
    (PYTHONUNBUFFERED, as many job scripts set), so that each print meets it as it is made, not only the flush at
    exit. stderr_too: stderr is that pipe too (`2>&1 | tee log`). Returns the exit status and stderr (else "")."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, env=env,
                            stderr=subprocess.STDOUT if stderr_too else subprocess.PIPE,
                            cwd=Path(__file__).resolve().parent)
    proc.stdout.close()
    err = proc.communicate(timeout=300)[1]
    return proc.returncode, err.decode() if err else ""


def quiet(err):
    """No traceback and no broken pipe said: what a command that a reader stopped may print on stderr."""
    return "Traceback" not in err and "Broken pipe" not in err and "BrokenPipe" not in err


# ----------------------------------------------------------------------------- commands

def test_commands(corpus, tok, capsys):
    data.main(["stats", "--data_dir", str(corpus[0]), "--tokenizer", str(tok), "--max_length", str(L)])
    out = capsys.readouterr().out
    for name, n in {**TRAIN_SIZES, "c4-validation.00000-of-00008.json.gz": 50}.items():
        assert re.search(rf"{re.escape(name)}\s+{n}\s", out), f"no line '{name} {n}' in\n{out}"
    data.main(["bench", "--data_dir", str(corpus[0]), "--tokenizer", str(tok), "--seconds", "0.2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"tokens/s \d+", last), last
    help_text = subprocess.run([sys.executable, "data.py", "--help"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent).stdout
    for command in ("download", "train-tokenizer", "stats", "bench"):
        assert command in help_text, f"{command} missing from --help:\n{help_text}"


@pytest.mark.parametrize("command", ["stats", "bench"])
def test_a_command_read_by_a_reader_that_stops_ends_quietly(corpus, tok, command):
    """`python data.py stats | head -3`: stats and bench write no file, so the reader's end ends them (SIGPIPE's
    default); they said "[Errno 32] Broken pipe" and exited 1, stats after reading every shard on."""
    argv = ["data.py", command, "--data_dir", str(corpus[0]), "--tokenizer", str(tok), "--max_length", str(L)]
    status, err = read_then_stop(argv + (["--seconds", "0.2"] if command == "bench" else []))
    assert quiet(err) and status in (0, -signal.SIGPIPE), (status, err)


def test_train_tokenizer_read_by_a_reader_that_is_gone_keeps_its_model_and_exits_0(corpus, tmp_path):
    """train-tokenizer writes its model, then says so: with the reader gone, the line goes nowhere, not to a
    "train-tokenizer: [Errno 32] Broken pipe" and exit 1 after a model written whole."""
    status, err = read_then_stop(["data.py", "train-tokenizer", "--data_dir", str(corpus[0]), "--out",
                                  str(tmp_path / "spm"), "--vocab_size", "100"])
    assert status == 0 and quiet(err), (status, err)
    assert data.load_tokenizer(tmp_path / "spm.model").vocab_size() == 100


@pytest.mark.parametrize("argv,message", [
    (["download", "--train_shards", "2000"], "C4 en has 1024 train and 8 validation shards, asked for 2000 and 1"),
    (["download", "--validation_shards", "-1"], "--validation_shards must be at least 0, got -1"),
    (["train-tokenizer", "--max_docs", "0"], "--max_docs must be at least 1, got 0"),
    (["train-tokenizer", "--vocab_size", "2"], "--vocab_size must be at least 4"),
    (["train-tokenizer", "--vocab_size", "5000", "--max_docs", "20"], "train-tokenizer: Vocabulary size too high"),
    (["train-tokenizer", "--data_dir", "MISSING"], "does not exist; pass --data_dir"),
    (["stats", "--max_length", "0"], "--max_length must be at least 2, got 0"),
    (["bench", "--batch_size", "0"], "--batch_size must be at least 1, got 0"),
    (["bench", "--seconds", "0"], "--seconds must be a positive number of seconds, got 0.0"),
    (["bench", "--seconds", "inf"], "--seconds must be a positive number of seconds, got inf"),  # it measured forever
    (["bench", "--seconds", "nan"], "--seconds must be a positive number of seconds, got nan"),
    (["stats", "--max_length", str(10 ** 20)], "--max_length must be at most 2^24 = 16,777,216, the positions a model "
                                               f"tells apart (its rotary positions are float32, exact to 2^24), got "
                                               f"{10 ** 20}"),
    (["bench", "--max_length", str(2 ** 24 + 1)], "--max_length must be at most 2^24 = 16,777,216"),
    (["bench", "--batch_size", str(10 ** 11)], f"--batch_size {10 ** 11} rows of 257 tokens need about 616800.0 GB, "
                                               "more than 80% of this machine's"),
    (["bench", "--num_workers", str(os.cpu_count() + 1)], f"--num_workers must be at most {data._cpus()}, the "
                                                          "CPUs this process may use"),
    (["bench", "--data_dir", "MISSING"], "does not exist; pass --data_dir"),
    (["download", "--shards", "c4-train.00005-of-01024.json.gz", "--train_shards", "3"],
     "--shards names the shards to fetch, --train_shards and --validation_shards count them: pass one or the other"),
    (["download", "--out", "A_FILE"], "is a file; pass a folder for the shards"),
    (["download", "--tokenizer", "A_FOLDER"], "is a folder; pass the file to write, such as"),
    (["download", "--tokenizer", "A_FILE/spiece.model"], "is a file where a folder of the paths should be"),
])
def test_bad_command_input_is_one_line_before_any_work(corpus, tok, tmp_path, capsys, argv, message):
    """Bad numbers are refused before any work (the download's before any network); what the work raises, a missing
    folder or sentencepiece's error, is one line too."""
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    paths = {"MISSING": tmp_path / "missing", "A_FILE": tmp_path / "a_file", "A_FOLDER": tmp_path / "a_folder"}
    argv = [str(paths[a.split("/")[0]]) + a[len(a.split("/")[0]):] if a.split("/")[0] in paths else a for a in argv]
    folder = [] if "--data_dir" in argv or argv[0] == "download" else ["--data_dir", str(corpus[0])]
    defaults = {"--out": str(tmp_path / "c4"), "--tokenizer": ""}  # what the case does not name itself
    where = {"download": [x for flag, value in defaults.items() if flag not in argv for x in (flag, value)],
             "train-tokenizer": ["--out", str(tmp_path / "spm")],
             "stats": ["--tokenizer", str(tok)], "bench": ["--tokenizer", str(tok)]}[argv[0]]
    with pytest.raises(SystemExit) as e:
        data.main(argv + folder + where)
    said = capsys.readouterr().err + (e.value.code if isinstance(e.value.code, str) else "")
    assert message in said and "Traceback" not in said and len(said.strip().splitlines()) <= 2, said
    assert not (tmp_path / "c4").exists()


# ----------------------------------------------------------------------------- real data

@needs_real
def test_real_samples_token_counts_and_fast_path():
    sp = data.load_tokenizer(REAL / "t5_spiece.model")
    assert (sp.vocab_size(), sp.pad_id(), sp.eos_id(), sp.encode("Hello world")) == (32000, 0, 1, [8774, 296])
    enc = data._Encoder(REAL / "t5_spiece.model", 256, 2)
    assert enc.prefix_ok
    tokens = {"c4-train.00000-of-01024.head1000.json.gz": 512_612, "olmo-c4-sample.00000-of-00001.json.gz": 506_135,
              "c4-validation.subset2000.json.gz": 993_287}  # SOURCES.md
    for name, want in tokens.items():
        texts = list(data._texts([REAL / "c4" / name]))
        ids = sp.encode(texts, num_threads=2)
        assert sum(map(len, ids)) == want, f"{name}: {sum(map(len, ids))} T5 tokens, SOURCES.md says {want}"
        ref = [tuple(x[:255] + [1] + [-1] * (255 - len(x[:255]))) for x in ids]
        bad = [i for i, (r, w) in enumerate(zip(map(tuple, enc.paper(texts).tolist()), ref)) if r != w]
        assert not bad, f"{name}: paper rows of documents {bad[:10]} differ from encode-then-truncate"


@needs_real
def test_real_samples_loader_and_validation():
    folder, tokenizer = REAL / "c4", REAL / "t5_spiece.model"
    assert [p.name for p in data.find_shards(folder, "train")] == [
        "c4-train.00000-of-01024.head1000.json.gz", "olmo-c4-sample.00000-of-00001.json.gz"]
    for x, y in take(data.TrainLoader(folder, tokenizer, 8, num_workers=1), 3):
        assert x.shape == y.shape == (8, 255) and 0 <= x.min() and x.max() < 32000
    batches = data.validation_batches(folder, tokenizer, 16, eval_tokens=20_000)
    tokens = sum(int((y >= 0).sum()) + len(y) for _, y in batches)
    assert 20_000 <= tokens < 20_256, f"{tokens} validation tokens for eval_tokens=20,000"


def test_stats_reports_a_bad_line_without_a_traceback(tok, tmp_path, capsys):
    write_shard(tmp_path / "c4-train.00000-of-00002.json.gz", make_docs(0, 20, random.Random(0)))
    write_shard(tmp_path / "c4-validation.00000-of-00001.json.gz", make_docs(0, 20, random.Random(1)))
    bad = tmp_path / "c4-train.00001-of-00002.json.gz"
    bad.write_bytes(gzip.compress(b'{"text": "fine"}\nnot json\n{"text": 5}\n' + b"[]\n" * 12 + b'{"text": "ok"}\n'))
    with pytest.raises(SystemExit, match=r"1 shard\(s\) failed"):
        data.main(["stats", "--data_dir", str(tmp_path), "--tokenizer", str(tok)])
    out = capsys.readouterr().out
    assert f"{bad}:2: not a JSON object" in out and "c4-validation.00000-of-00001.json.gz" in out
    # every bad line of a shard is found, not only its first: 10 said, the count of the others, and its 2 good ones
    assert f'{bad}:3: no "text" string' in out and "... and 4 more bad lines" in out, out
    rows = [line for line in out.splitlines() if line.startswith(bad.name)]
    assert len(rows) == 12 and rows[-1].split()[1] == "2", out


def refuse_shared_memory(monkeypatch):
    """/dev/shm full, as torch says it (a forked worker inherits the patch)."""
    def full(self):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device "
                           "(28)")
    monkeypatch.setattr(torch.Tensor, "share_memory_", full)


def test_bench_says_a_full_dev_shm_in_one_line_naming_the_fix(corpus, tok, monkeypatch):
    """bench's workers hand their blocks over through /dev/shm: a full one is one line, with the fix, not a hang."""
    refuse_shared_memory(monkeypatch)
    with pytest.raises(SystemExit) as e:
        data.main(["bench", "--data_dir", str(corpus[0]), "--tokenizer", str(tok), "--num_workers", "1",
                   "--seconds", "5"])
    said = str(e.value.code)
    assert re.fullmatch(r"/dev/shm has no room for a data worker's block of [\d.]+ [KM]iB( \(.* free of .*\))?: "
                        r"free some, or use --num_workers 0", said), said


def test_bench_says_which_pass_it_ended_in(corpus, tok, capsys):
    """bench said "over 0 passes" while in its first pass, and "over 2" in its third (loader.epoch counts from 0):
    it says the pass it ended in, counted from 1, which a run long enough to wrap around the shards shows."""
    argv = ["bench", "--data_dir", str(corpus[0]), "--tokenizer", str(tok), "--batch_size", "4", "--max_length", "16"]
    data.main(argv + ["--seconds", "0.001"])  # a batch or two of the 30 in a pass
    assert "ending in pass 1 of the shards" in capsys.readouterr().out
    data.main(argv + ["--seconds", "3"])
    said = int(re.search(r"ending in pass (\d+) of the shards", capsys.readouterr().out).group(1))
    assert said > 1, "the tiny corpus is read through more than once in 3 s"


def test_data_commands_say_a_bad_shard_in_one_line(tok, tmp_path, capsys):
    """bench with workers (whose errors carry their traceback), train-tokenizer (sentencepiece wraps what the reading
    raises), stats (an empty shard, which training refuses, and both splits looked up before any reading)."""
    rng = random.Random(3)
    bad, empty, no_val = tmp_path / "bad", tmp_path / "empty", tmp_path / "no_val"
    for folder in (bad, empty, no_val):
        folder.mkdir()
    good = [json.dumps({"text": t}) for t in make_docs(0, 200, rng)]
    (bad / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress("\n".join(good[:150] + ["{oops"]).encode()))
    write_shard(bad / "c4-validation.00000-of-00008.json.gz", make_docs(0, 10, rng))
    (empty / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress(b"\n"))
    write_shard(empty / "c4-validation.00000-of-00008.json.gz", make_docs(0, 10, rng))
    write_shard(no_val / "c4-train.00000-of-01024.json.gz", make_docs(0, 10, rng))
    line = r".*c4-train.00000-of-01024.json.gz:151: not a JSON object"
    for argv, message in [
        (["bench", "--data_dir", str(bad), "--tokenizer", str(tok), "--num_workers", "2", "--batch_size", "64",
          "--seconds", "5"], line),
        (["train-tokenizer", "--data_dir", str(bad), "--out", str(tmp_path / "spm"), "--vocab_size", "60"],
         "train-tokenizer: " + line),
        (["train-tokenizer", "--data_dir", str(empty), "--out", str(tmp_path / "spm"), "--vocab_size", "60"],
         "train-tokenizer: the train shards of .* hold no text; download them again"),
        (["stats", "--data_dir", str(no_val), "--tokenizer", str(tok)], "no validation shards in"),
        (["stats", "--data_dir", str(empty), "--tokenizer", str(tok)], r"1 shard\(s\) failed")]:
        with pytest.raises(SystemExit) as e:
            data.main(argv)
        said = str(e.value.code)
        assert re.match(message, said) and "\n" not in said and "Traceback" not in said, said
        out = capsys.readouterr().out
        if argv[0] == "stats":
            assert "c4-train" not in out or "holds no documents; remove it or download it again" in out, out
    assert not list(tmp_path.glob("spm*")), "a tokenizer trained on part of the data was left"


def test_a_shard_link_to_nothing_is_refused(tok, tmp_path):
    """A shard that links into an unmounted store is said, not dropped from training."""
    write_shard(tmp_path / "c4-train.00000-of-01024.json.gz", make_docs(0, 20, random.Random(0)))
    (tmp_path / "c4-train.00001-of-01024.json.gz").symlink_to(tmp_path / "store" / "missing.json.gz")
    with pytest.raises(FileNotFoundError, match=r"c4-train.00001-of-01024.json.gz link\(s\) to nothing; mount"):
        data.TrainLoader(tmp_path, tok, 4, L)


def test_modules_import_where_the_os_lacks_sighup_and_sigusr():
    """Windows has SIGTERM and SIGINT only: data.py (and the tools that read data with it) must still import."""
    here = str(Path(__file__).resolve().parent)
    code = ("import signal\nfor name in ('SIGHUP', 'SIGQUIT', 'SIGUSR1', 'SIGUSR2'):\n    delattr(signal, name)\n"
            "import data, analyze, export, sample\nprint([s.name for s in data.STOP_SIGNALS])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=here)
    assert run.stdout.strip() == "['SIGTERM', 'SIGINT']", run.stderr[-2000:]


def test_loader_workers_end_with_a_script_that_never_closes_its_iterator(corpus, tok, tmp_path):
    """Workers ignore SIGTERM (the main process saves first); a script that leaves its iterator open at exit must
    still end, and promptly: multiprocessing's exit would SIGTERM them and wait forever."""
    script = tmp_path / "script.py"
    script.write_text(f"import data\nbatches = iter(data.TrainLoader({str(corpus[0])!r}, {str(tok)!r}, 4, 32, "
                      f"num_workers=2))\nx, y = next(batches)\nprint('got', tuple(x.shape))\n")
    here = str(Path(__file__).resolve().parent)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=here,
                         env={**os.environ, "PYTHONPATH": here})
    assert run.returncode == 0 and "got (4, 31)" in run.stdout, run.stderr[-2000:]
