"""
Tests of sample.py and export.py on a tiny SLTrain model trained here; the Hugging Face check runs when transformers
is installed (it is not a dependency of the repo).

    python -m pytest -q test_export.py
"""

import copy
import gc
import json
import os
import shutil
import signal
import sys

import pytest
import torch

import analyze
import bench
import checkpoint
import data
import export
import sample
import suite
import train
from checkpoint import load_model
from model import LLaMA, config_for
from test_data import quiet, read_then_stop
from test_train import (base_args, corpus, disk_full_from, eval_args, file_size_limit,  # noqa: F401  (fixtures)
                        other_tokenizer)


@pytest.fixture(scope="module")
def sl_ckpt(corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sl")
    train.main(base_args(corpus, out, 6, "--method", "sltrain", "--lr", "1e-2", "--eval_tokens", "300"))
    return str(out / "ckpt.pt")


def test_the_tools_take_a_run_folder_as_train_py_does(sl_ckpt):
    folder = os.path.dirname(sl_ckpt)
    assert sample.sample(folder, "the", max_new_tokens=3, temperature=0) == \
        sample.sample(sl_ckpt, "the", max_new_tokens=3, temperature=0)


def test_sample_is_deterministic_under_a_seed(sl_ckpt):
    a = sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=12, seed=3)
    b = sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=12, seed=3)
    c = sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=12, seed=4)
    assert a == b and a != c
    assert all(t.startswith("the") and len(t) > len("the") for t in a)
    greedy = sample.sample(sl_ckpt, "", num_samples=2, max_new_tokens=8, temperature=0)
    assert greedy[0] == greedy[1], "greedy decoding draws nothing"


def test_samples_are_drawn_a_batch_at_a_time_and_each_batch_shown_as_it_ends(sl_ckpt, monkeypatch, capsys):
    """--num_samples 10^8 once built one batch of all of them (a cache and logits of terabytes). Drawn --batch_size at
    a time: one batch's memory for any number, the same draws for a seed at the same batch size, greedy text the same
    at any; each batch printed before the next is drawn."""
    a = sample.sample(sl_ckpt, "the", num_samples=5, max_new_tokens=8, seed=3, batch_size=2)
    assert len(a) == 5 and a == sample.sample(sl_ckpt, "the", num_samples=5, max_new_tokens=8, seed=3, batch_size=2)
    greedy = sample.sample(sl_ckpt, "the", num_samples=3, max_new_tokens=8, temperature=0)
    assert greedy == sample.sample(sl_ckpt, "the", num_samples=3, max_new_tokens=8, temperature=0, batch_size=1)
    batches, real_generate = [], sample.generate

    def spy(model, idx, *args, **kwargs):  # what was printed when each batch began
        batches.append((idx.size(0), capsys.readouterr().out.count("-" * 40)))
        return real_generate(model, idx, *args, **kwargs)
    monkeypatch.setattr(sample, "generate", spy)
    sample.main([sl_ckpt, "--prompt", "the", "--num_samples", "5", "--max_new_tokens", "3", "--batch_size", "2"])
    assert batches == [(2, 0), (2, 2), (1, 2)] and capsys.readouterr().out.count("-" * 40) == 1
    monkeypatch.undo()
    long = " ".join(["the"] * 40)  # past the 31 positions the run trained (its --max_length is 32)
    n = len(sample.load_tokenizer(load_model(sl_ckpt)[1]["args"]["tokenizer"]).encode(long))
    sample.sample(sl_ckpt, long, max_new_tokens=2)
    assert f"sample.py: note: the prompt is {n} tokens, more than the 31 positions the model was trained on; it sees " \
        "the last 31" in capsys.readouterr().err and n > 31
    sample.sample(sl_ckpt, "the", max_new_tokens=2)
    assert "note" not in capsys.readouterr().err
    for prompt in ("", "   "):  # nothing to continue: the padded run never trained the position after an EOS
        sample.sample(sl_ckpt, prompt, max_new_tokens=2)
        assert "sample.py: note: no prompt, so each sample starts after an end of document, a position the run's " \
            "padded rows never trained" in capsys.readouterr().err


def test_sample_refuses_a_batch_that_cannot_fit_before_the_merge(sl_ckpt, monkeypatch):
    """The cache and logits of a batch beyond the memory there are refused in one line naming a batch that fits,
    before the merge (minutes at 7b); the default batch of a huge --num_samples fits."""
    model, ckpt = load_model(sl_ckpt)
    context = ckpt["args"]["max_length"] - 1
    one = sample.batch_bytes(model.config, 1, context, torch.float32)
    weights = sum(p.nbytes for p in model.parameters())
    assert one == 2 * 2 * context * 64 * 4 + context * model.config.vocab_size * 4 + model.config.vocab_size * 4
    monkeypatch.setattr(sample, "memory_there", lambda device: ((2 * weights + 3.5 * one) / 0.8, 0.8, "a 1 GB box"))
    monkeypatch.setattr(sample, "merged", lambda m: pytest.fail("merged before the batch was checked"))
    with pytest.raises(SystemExit, match=r"^sample.py: a batch of 4 samples holds a KV cache and logits of about "
                                         r"0.0 GB, beside the weights, more than 80% of a 1 GB box; pass --batch_size "
                                         r"3$"):
        sample.main([sl_ckpt, "--num_samples", "5", "--batch_size", "4"])
    monkeypatch.undo()
    monkeypatch.setattr(sample, "generate", lambda model, idx, *a, **k: torch.cat([idx, idx], 1))
    texts = sample.samples(sl_ckpt, "the", num_samples=10 ** 8)
    assert [next(texts) for _ in range(3)] == ["the the"] * 3  # drawn as read: 10^8 rows were never built


@pytest.mark.parametrize("method,device,gb,fits", [("full", "cpu", 32, True), ("full", "cuda", 24, True),
                                                   ("sltrain_ft", "cpu", 16, False), ("relora", "cpu", 16, False),
                                                   ("sltrain", "cpu", 20, True), ("sltrain", "cpu", 16, False)])
def test_the_batch_check_counts_the_weights_generated_from(monkeypatch, method, device, gb, fits):
    """check_batch took every model for an SLTrain one to be merged, twice its parameters: a 7b full-rank (or merged)
    model in bf16, 13.5 GB, was refused on a 32 GB machine and a 24 GB GPU, where it and a batch of 16 (2.4 GB) fit;
    and 7b ReLoRA and SLTrain-FT ones, whose W0 (13 GB) is a buffer, passed on a 16 GB machine, where they do not;
    an SLTrain one fits there with --keep_factors (6.3 GB), not merged (13.5 GB)."""
    model = LLaMA(config_for("7b", method=method), device="meta").to(torch.bfloat16)
    free = gb * 1e9 - (13.5e9 if device == "cuda" else 0)  # a GPU's free memory, after the load
    monkeypatch.setattr(sample, "memory_there", lambda d: (free, 0.8, f"a {gb} GB {device}"))
    if fits:
        sample.check_batch(model, 16, 255, torch.device(device))
    else:
        with pytest.raises(ValueError, match=f"more than 80% of a {gb} GB {device}"):
            sample.check_batch(model, 16, 255, torch.device(device))
    if method == "sltrain":  # --keep_factors: generated from as trained, the model takes what it took loaded
        sample.check_batch(model, 16, 255, torch.device(device), merge=False)


def test_sample_keeps_the_factors_when_asked(sl_ckpt, monkeypatch):
    """--keep_factors generates from the weights as trained: the same greedy text (float32), from an SLTrain model."""
    merged = sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=12, temperature=0)
    methods = []
    real_merged = sample.merged
    monkeypatch.setattr(sample, "merged", lambda m: methods.append(m.config.method) or real_merged(m))
    sample.main([sl_ckpt, "--prompt", "the", "--num_samples", "2", "--max_new_tokens", "3", "--keep_factors"])
    assert methods == [], "--keep_factors merged the weights"
    assert sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=12, temperature=0, merge=False) == merged


def test_a_prompt_that_is_not_utf8_is_one_line_before_the_model_loads(sl_ckpt, monkeypatch, capsys):
    """A shell passes the bytes typed in another encoding (Latin-1's é, 0xe9), which Python keeps as a lone
    surrogate that sentencepiece cannot take: a traceback, after the merge (minutes at 7b)."""
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    monkeypatch.setattr(sample, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=r"^sample.py: --prompt is not UTF-8 text \(byte 0xe9 at character 3\): "
                                         "pass it in UTF-8$"):
        sample.main([sl_ckpt, "--prompt", prompt])


def test_sample_takes_any_prompt_and_temperature(sl_ckpt, monkeypatch):
    """A prompt of spaces (it encodes to nothing) starts a document as an empty one does; a prompt is shown as typed,
    characters outside the vocabulary included; a tiny temperature is greedy, not NaN; the context never passes the
    positions training saw (its --max_length is 32: 31 in paper mode, 32 with --pack)."""
    assert len(sample.sample(sl_ckpt, "   ", num_samples=1, max_new_tokens=3)) == 1
    typed = "the naïve café 日本 🤗"
    assert all(t.startswith(typed) for t in sample.sample(sl_ckpt, typed, num_samples=2, max_new_tokens=3))
    tiny = sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=6, temperature=1e-45)
    assert tiny == sample.sample(sl_ckpt, "the", num_samples=2, max_new_tokens=6, temperature=0)
    model, ckpt = load_model(sl_ckpt)
    model = sample.merged(model)
    eos, seen = sample.load_tokenizer(ckpt["args"]["tokenizer"]).eos_id(), []

    class Spy:  # the model, recording the positions each call attends to: the cached ones and the new ones
        config, parameters, buffers, modules, state_dict = (model.config, model.parameters, model.buffers,
                                                            model.modules, model.state_dict)

        def __call__(self, idx, cache=None):
            seen.append((cache.pos if cache else 0) + idx.shape[1])
            logits, loss = model(idx, cache=cache)
            logits[..., eos] = float("-inf")  # the sample never ends its document, so the context fills up
            return logits, loss

    monkeypatch.setattr(sample, "load_model", lambda path, device: (Spy(), ckpt))
    sample.sample(sl_ckpt, "the", max_new_tokens=40)
    assert max(seen) == ckpt["args"]["max_length"] - 1 == 31, max(seen)
    seen.clear()
    ckpt["args"]["pack"] = True  # packed windows train on max_length positions: x = window[:-1] of max_length + 1
    sample.sample(sl_ckpt, "the", max_new_tokens=40)
    assert max(seen) == 32, max(seen)


@pytest.mark.parametrize("temperature", [0, 1.0], ids=["greedy", "drawn"])
def test_merged_cached_generation_gives_the_tokens_of_the_model_as_trained(sl_ckpt, temperature):
    """sample.py generates from the merged model with a KV cache; the tokens are those of the factored model run on
    its whole window at every step, past the context too (31 positions here: the cropped window starts over)."""
    model, _ = load_model(sl_ckpt)
    dense = sample.merged(copy.deepcopy(model))
    assert dense.config.method == "full" and model.config.method == "sltrain"
    idx = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, m, cache in (("trained", model, False), ("trained+cache", model, True), ("merged", dense, False),
                           ("merged+cache", dense, True)):
        g = torch.Generator().manual_seed(1)
        runs[name] = sample.generate(m, idx, 40, temperature, top_k=None, context=31, generator=g, cache=cache)
    assert runs["trained"].shape == (3, 45)
    assert all(torch.equal(run, runs["trained"]) for run in runs.values())
    windows = []

    def spy(window, cache=None):
        windows.append(window.shape[1])
        return dense(window, cache=cache)

    spy.config = dense.config
    sample.generate(spy, idx, 40, temperature=0, context=31)
    assert windows == [5] + [1] * 26 + [31] * 13, "within the context a step runs one position; past it, the window"


@pytest.mark.parametrize("method", ["full", "lowrank", "relora", "sltrain"])
def test_merging_for_generation_keeps_the_function(method):
    """sample.merged makes SLTrain and ReLoRA weights dense; full and low-rank models (which never form W) are left
    as they are. B is drawn at random first: it starts at zero, where BA would go unchecked."""
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method=method, vocab_size=256)).eval()
    for name, p in model.named_parameters():
        if name.endswith(".B"):
            torch.nn.init.normal_(p.data, std=0.1)
    model.autocast = torch.bfloat16
    trained = copy.deepcopy(model)
    dense = sample.merged(model)
    assert dense is model, "the merge is in place"
    assert dense.autocast == torch.bfloat16, "the merged model computes as the model did"
    trained.autocast = dense.autocast = None
    assert dense.config.method == ("full" if method in ("relora", "sltrain") else method)
    merged = [type(m).__name__ for m in dense.modules() if isinstance(m, export.MERGED)]
    assert merged == (["SLLinear"] * 14 if method == "lowrank" else []), "a layer left as trained, or a low-rank merged"
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert (dense(idx)[0] - trained(idx)[0]).abs().max() < 1e-5


def live_cpu_bytes():
    """The bytes of every CPU tensor storage the process holds, each storage once."""
    storages = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
            storage = o.untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # _cdata: fake tensors (other tests') have no data_ptr
    return sum(storages.values())


def most_held_while_merging(monkeypatch, run):
    """The most CPU tensor bytes held at any layer's merge (its new weight made, the layer not yet replaced) while
    run() goes, and after it."""
    held = []
    for cls in export.MERGED:
        def spy(self, real=cls.merged_weight):
            W = real(self)
            held.append(live_cpu_bytes())
            return W
        monkeypatch.setattr(cls, "merged_weight", spy)
    run()
    held.append(live_cpu_bytes())
    return max(held)


def layer_bytes(model):
    """[(dense weight bytes, bytes as trained)] of each merged layer, in merge order."""
    return [(m.in_features * m.out_features * m.A.element_size(),
             sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers())))
            for m in model.modules() if isinstance(m, export.MERGED)]


def merge_bound(layers):
    """What merging in place holds above the model as trained, at its worst layer k: the dense weights of layers
    0..k, less the factors of layers 0..k-1, which are gone, plus the float32 copy of layer k being merged."""
    return max(sum(d for d, _ in layers[:k + 1]) - sum(f for _, f in layers[:k]) + layers[k][1]
               for k in range(len(layers)))


@pytest.mark.parametrize("method", ["sltrain", "relora"])
def test_the_merge_never_holds_both_models(method, monkeypatch):
    """densify replaces a layer at a time and frees its factors, so the merge holds the dense model and one layer
    more, never the dense weights beside the factors (which it did: up to the model as trained + all its dense
    weights; 7b: 6.74G + 3.14G parameters)."""
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method=method, vocab_size=256, n_layers=4))
    layers = layer_bytes(model)
    gc.collect()
    before = live_cpu_bytes()
    held = most_held_while_merging(monkeypatch, lambda: export.densify(model)) - before
    assert held <= merge_bound(layers) + 4096, (held, merge_bound(layers), sum(d for d, _ in layers))
    assert held < sum(d for d, _ in layers), "not a single layer's factors were freed"


def test_export_frees_the_checkpoint_before_it_merges(sl_ckpt, tmp_path, monkeypatch):
    """export.py keeps only the run's args and step of the checkpoint it reads: its tensors as trained (which the
    model shares, and which would outlive the merge) and the optimizer's state go before the merge."""
    model, _ = load_model(sl_ckpt)
    as_trained = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    layers = layer_bytes(model)
    del model, _
    gc.collect()
    before = live_cpu_bytes()
    held = most_held_while_merging(monkeypatch, lambda: export.main([sl_ckpt, "--merged", str(tmp_path / "d.pt")]))
    assert held - before <= as_trained + merge_bound(layers) + 4096, (held - before, as_trained + merge_bound(layers))


def test_sample_refuses_unusable_checkpoints(sl_ckpt, tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint at"):
        sample.main([str(tmp_path / "missing.pt")])
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")  # not written by train.py
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / "foreign.pt")])
    assert str(e.value) == (f"sample.py: {tmp_path / 'foreign.pt'} has no checksum, so it was not written by "
                            "train.py; pass a checkpoint that train.py or export.py --merged wrote (a run's ckpt.pt, "
                            "or its folder); a Hugging Face export is not read back"), e.value
    checkpoint.save(str(tmp_path / "other.pt"), {"weights": torch.zeros(2)})  # whole, but holds no model
    with pytest.raises(SystemExit, match="no 'model' and 'model_config'"):
        sample.main([str(tmp_path / "other.pt")])
    (tmp_path / "cut.pt").write_bytes(open(sl_ckpt, "rb").read()[:1000])  # a copy cut short, as by a full disk
    with pytest.raises(SystemExit, match="cannot be read"):
        sample.main([str(tmp_path / "cut.pt")])


@pytest.mark.parametrize("setting, message", [
    (dict(num_samples=0), "num_samples must be positive and at most 2\\^63 - 1, got 0"),
    (dict(max_new_tokens=-1), "max_new_tokens must be positive and at most 2\\^63 - 1, got -1"),
    (dict(batch_size=0), "batch_size must be positive and at most 2\\^63 - 1, got 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(top_k=-3), "top_k must be >= 0, got -3"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(seed=2 ** 64), "seed must fit in 64 bits, got 18446744073709551616"),
])
def test_sample_from_python_refuses_what_the_command_line_does(monkeypatch, setting, message):
    """sample.sample and sample.samples, called from Python, refuse the settings the command line refuses, in the
    same words less the flag's dashes, before the checkpoint loads: num_samples=0 was range()'s 'arg 3 must not be
    zero' after the load and merge, temperature NaN multinomial's traceback."""
    monkeypatch.setattr(sample, "load_model", lambda *a, **k: pytest.fail("loaded before the settings were checked"))
    monkeypatch.setattr(sample, "check_tokenizer", lambda *a: None)
    with pytest.raises(ValueError, match=f"^{message}$"):
        sample.sample("any.pt", **setting)


def test_greedy_generation_checks_its_logits_without_a_sync_a_token():
    """Greedy generation without EOS (bench.py --only generate times it) issued no host sync; the check of its logits
    for NaN or inf reads one flag, once, at the end: the same syncs for 2 tokens as for 6. A NaN it saw is refused
    there, naming the weight that holds it."""
    from hostsync import HostSyncs
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="sltrain")).eval()
    idx = torch.randint(model.config.vocab_size, (2, 5))
    counts = []
    for n in (2, 6):
        syncs = HostSyncs()
        with syncs.watch():
            out = sample.generate(model, idx, n, temperature=0)
        counts.append(sum(syncs.counts.values()))
        assert out.shape == (2, 5 + n)
    assert counts[0] == counts[1] <= 1, counts
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match="^the model: lm_head.weight holds NaN or inf"):
        sample.generate(model, idx, 4, temperature=0)


@pytest.mark.parametrize("temperature", ["0.8", "0"])
def test_sample_refuses_weights_or_logits_that_are_not_finite(sl_ckpt, tmp_path, monkeypatch, temperature):
    """A checkpoint with a NaN in its sparse values (a diverged run's) ended in multinomial's RuntimeError, a
    traceback, and at temperature 0 printed token 0's empty text as each sample; finite float16 weights whose
    activations overflow did the same. Each is one line naming the fix, the NaN's before the merge."""
    state = checkpoint.load(sl_ckpt)
    state["model"]["layers.1.mlp.up_proj.values"][3] = float("nan")
    checkpoint.save(str(tmp_path / "nan.pt"), state)
    argv = ["--device", "cpu", "--num_samples", "1", "--max_new_tokens", "4", "--temperature", temperature]

    def refuse_to_merge(model):
        raise AssertionError("a model with a NaN weight was merged")
    with monkeypatch.context() as m:
        m.setattr(sample, "merged", refuse_to_merge)
        with pytest.raises(SystemExit) as e:
            sample.main([str(tmp_path / "nan.pt"), *argv])
    assert str(e.value) == f"sample.py: {tmp_path / 'nan.pt'}: layers.1.mlp.up_proj.values holds NaN or inf (the " \
        "run diverged); sample an earlier checkpoint", e.value
    state = checkpoint.load(sl_ckpt)  # logits of about 10^5, past float16's 65504, from weights in its range
    state["model"]["norm.weight"] *= 300
    state["model"]["lm_head.weight"] *= 3000
    checkpoint.save(str(tmp_path / "large.pt"), state)
    export.main([str(tmp_path / "large.pt"), "--merged", str(tmp_path / "half.pt"), "--dtype", "float16"])
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / "half.pt"), *argv])
    assert str(e.value) == "sample.py: the model's logits hold NaN or inf though its weights are finite: its " \
        "torch.float16 activations overflow; sample a float32 copy of it (export.py CKPT --merged dense.pt --dtype " \
        "float32)", e.value


def test_a_file_that_is_no_checkpoint_is_not_called_damaged(sl_ckpt, tmp_path):
    """The export's weights, a run's metrics.jsonl: each was "damaged ... restore it from a copy", in every tool."""
    hf = tmp_path / "hf"
    export.main([sl_ckpt, "--out", str(hf)])
    metrics = os.path.join(os.path.dirname(sl_ckpt), "metrics.jsonl")
    for path in (hf / "model.safetensors", hf / "config.json", metrics):
        for tool in (lambda: sample.main([str(path)]), lambda: analyze.main(["spectrum", str(path)]),
                     lambda: export.main([str(path), "--merged", str(tmp_path / "d.pt")])):
            with pytest.raises(SystemExit) as e:
                tool()
            assert f"{path} is not a checkpoint (not a torch zip file); pass a checkpoint that train.py or " \
                   "export.py --merged wrote" in str(e.value) and "damaged" not in str(e.value), e.value


def test_a_checkpoint_that_may_not_be_read_is_not_called_damaged(sl_ckpt, tmp_path, monkeypatch):
    """A checkpoint without read permission (another user's run) was "damaged ... restore it from a copy, or start a
    fresh run": torch.load's PermissionError is named, with its fix. (torch.load raises it as open does: as root, a
    mode of 0 does not stop a read, so the test raises it.)"""
    locked = tmp_path / "locked.pt"
    shutil.copy(sl_ckpt, locked)

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(SystemExit) as e:
        export.main([str(locked), "--merged", str(tmp_path / "d.pt")])
    assert str(e.value) == f"export.py: checkpoint {locked} cannot be read (Permission denied); ask for read access " \
        "to it, or pass a copy you can read", e.value
    assert sorted(os.listdir(tmp_path)) == ["locked.pt"]


def test_a_merged_checkpoint_of_any_name_loads_and_an_exports_weights_are_not_read_whole(sl_ckpt, tmp_path,
                                                                                         monkeypatch):
    """torch.load reads a path ending in .safetensors as a safetensors file (where that package is installed; else it
    says to install it): a --merged dense.safetensors, just written, was "damaged" in every tool. And an export's
    model.safetensors (13.5 GB at 7b) was read whole, twice (the tokenizer's quick look, then the load), to be
    refused, with another message where the package was installed."""
    dense = tmp_path / "dense.safetensors"
    export.main([sl_ckpt, "--merged", str(dense)])
    (model, _), (merged, _) = load_model(sl_ckpt), load_model(str(dense))
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        err = (merged(idx)[0] - model(idx)[0]).abs().max().item()
    assert err < 1e-5, f"the merged model's logits differ by {err:.2e}"
    weights = tmp_path / "hf" / "model.safetensors"
    export.main([sl_ckpt, "--out", str(weights.parent)])
    read = torch.load

    def by_name(f, *args, **kwargs):  # as torch.load does with the safetensors package: every tensor read
        if isinstance(f, (str, os.PathLike)) and os.path.samefile(f, weights):
            pytest.fail(f"{f} was read whole")
        return read(f, *args, **kwargs)
    monkeypatch.setattr(torch, "load", by_name)
    for tool, name in [(sample.main, "sample.py"), (lambda argv: export.main(argv + ["--out", str(tmp_path / "o")]),
                                                    "export.py")]:
        with pytest.raises(SystemExit) as e:
            tool([str(weights)])
        assert str(e.value).startswith(f"{name}: {weights} is not a checkpoint (not a torch zip file)"), e.value


@pytest.mark.parametrize("flag", ["--out", "--merged"])
def test_export_that_cannot_write_is_one_line_and_leaves_no_partial_file(sl_ckpt, tmp_path, flag):
    """A write the filesystem refuses (here a file past the process's size limit, EFBIG) is one line naming the
    file, and leaves no partial weights behind that a reader could take for whole ones."""
    target = tmp_path / ("hf" if flag == "--out" else "dense.pt")
    name = "model.safetensors" if flag == "--out" else "dense.pt"
    with file_size_limit(4096), pytest.raises(SystemExit, match=r"^export.py: .*File too large") as e:
        export.main([sl_ckpt, flag, str(target)])
    assert "\n" not in str(e.value) and str(target / name if flag == "--out" else target) in str(e.value)
    left = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert not any(n.startswith(name) for n in left), left
    export.main([sl_ckpt, flag, str(target)])  # without the limit it is written whole
    if flag == "--out":
        assert {"model.safetensors", "config.json"} <= set(os.listdir(target))
    else:
        assert load_model(str(target))[0].config.method == "full"


def test_an_export_whose_reader_is_gone_writes_both_outputs_and_exits_0(sl_ckpt, tmp_path):
    """`python export.py ... --out hf --merged dense.pt | tee log`, and tee ends: the line said after the folder
    failed ("export.py: [Errno 32] Broken pipe", exit 1), and --merged was never written. The lines go nowhere now."""
    status, err = read_then_stop(["export.py", sl_ckpt, "--out", str(tmp_path / "hf"), "--merged",
                                  str(tmp_path / "dense.pt")])
    assert status == 0 and quiet(err), (status, err)
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(export.HF_FILES)
    assert load_model(str(tmp_path / "dense.pt"))[0].config.method == "full"


def test_samples_read_by_a_reader_that_stops_end_quietly(sl_ckpt):
    """`python sample.py ckpt --num_samples 20 | head`: the next sample failed with "sample.py: [Errno 32] Broken
    pipe", exit 1. It writes no file, so the reader's end ends it (SIGPIPE's default)."""
    status, err = read_then_stop(["sample.py", sl_ckpt, "--prompt", "the", "--num_samples", "20", "--batch_size", "1",
                                  "--max_new_tokens", "4"])
    assert quiet(err) and status in (0, -signal.SIGPIPE), (status, err)


@pytest.mark.parametrize("at", ["open", "fsync"])
def test_a_hugging_face_export_is_replaced_all_or_none(sl_ckpt, tmp_path, monkeypatch, at):
    """export_hf wrote its four files one at a time, each atomic: a disk that filled after model.safetensors (or a
    Ctrl-C there) left, with --overwrite, this export's weights beside an earlier export's config. Every file is now
    written and synced before any replaces an earlier one: a write that fails leaves the earlier export as it was."""
    out = tmp_path / "hf"
    export.main([sl_ckpt, "--out", str(out), "--dtype", "bfloat16"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    disk_full_from(monkeypatch, 2, at)  # room for the weights alone (the new ones are float32: another config too)
    with pytest.raises(SystemExit, match=r"^export.py: .*No space left on device.*; none of the export's files was "
                                         r"replaced") as e:
        export.main([sl_ckpt, "--out", str(out), "--overwrite"])
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    replaced = sorted(name for name in before if after.get(name) != before[name])
    assert after.keys() == before.keys() and not replaced, f"replaced: {replaced}; in the folder: {sorted(after)}"
    monkeypatch.undo()
    export.main([sl_ckpt, "--out", str(out), "--overwrite"])  # with room, every file is replaced
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after.keys() == before.keys() and all(after[n] != before[n] for n in ("config.json", "model.safetensors"))


class Scripted:
    """A model that greedily says a fixed script per row, over and over (row b's k-th new token is scripts[b][k])."""

    def __init__(self, scripts, vocab_size):
        self.scripts, self.calls = scripts, 0
        self.config = type("Config", (), {"vocab_size": vocab_size, "n_layers": 1, "dim": 8, "method": "full"})

    def parameters(self):
        return iter([torch.zeros(8)])

    def buffers(self):
        return iter([])

    def state_dict(self):
        return {"weight": torch.zeros(8)}

    def __call__(self, idx, cache=None):
        logits = torch.zeros(*idx.shape, self.config.vocab_size)  # (B, T, vocab)
        for b, script in enumerate(self.scripts):
            logits[b, -1, script[self.calls % len(script)]] = 1.0
        self.calls += 1
        return logits, None


def test_sample_ends_each_row_at_its_first_eos(sl_ckpt, monkeypatch):
    """Training never shows a token after EOS: what would follow is a second document, so it is not generated."""
    _, ckpt = load_model(sl_ckpt)
    sp = sample.load_tokenizer(ckpt["args"]["tokenizer"])
    eos, first, second = sp.eos_id(), sp.encode("the kaba dufo."), sp.encode("the mesi ra.")
    for prompt, scripts in (("", [first + [eos] + second, first + second + [eos] + first]),
                            ("the", [[eos] + second + second, second + [eos] + first + first])):
        model = Scripted(scripts, sp.get_piece_size())
        monkeypatch.setattr(sample, "load_model", lambda path, device: (model, ckpt))
        texts = sample.sample(sl_ckpt, prompt, num_samples=2, max_new_tokens=100, temperature=0)
        ended = [sp.decode(sp.encode(prompt) + s[:s.index(eos)]) for s in scripts]
        assert texts == ended, f"{texts} should end at EOS: {ended}"
        assert model.calls == scripts[1].index(eos) + 1, "generation goes on after every row has ended"
    idx = torch.tensor([[eos]])
    model = Scripted([[eos] * 10], sp.get_piece_size())
    assert sample.generate(model, idx, 10, temperature=0).shape == (1, 11), "without eos_id, no stop"


@pytest.mark.parametrize("device,message", [("tpu", "expected cpu, cuda or cuda:N"),
                                            ("cuda:x", "expected cpu, cuda or cuda:N"),
                                            ("cuda", "this machine has no usable CUDA GPU; pass --device cpu")])
def test_sample_refuses_a_device_it_cannot_use(sl_ckpt, capsys, device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        sample.main([str(sl_ckpt), "--device", device])
    err = capsys.readouterr().err
    assert f"--device {device}: {message}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("top_k,top_p,kept", [(None, None, [0, 1, 2, 3]), (None, 0.7, [0, 1]), (None, 0.5, [0]),
                                              (None, 0.96, [0, 1, 2, 3]), (None, 1e-9, [0]), (3, 0.9, [0, 1, 2]),
                                              (2, 0.9, [0, 1]), (0, None, [0, 1, 2, 3]), (0, 0.7, [0, 1])])
def test_draws_come_from_the_top_k_then_the_nucleus(top_k, top_p, kept):
    """Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled across the vocabulary): top_p keeps the most likely tokens up to
    and including the one whose cumulative probability reaches it (0.7: two; 0.5: one; 0.96: all four), after top_k;
    the kept ones are drawn in proportion to their probabilities. top_k 0 is no cut, as sample.py's --top_k 0 (it
    raised a RuntimeError from the Python API)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    where = torch.tensor([5, 2, 7, 0])  # token ids of the four, in a vocabulary of 8 with the rest impossible
    logits = torch.full((4000, 8), float("-inf"))
    logits[:, where] = probs.log()
    ids = sample.draw(logits, 1.0, top_k, top_p, torch.Generator().manual_seed(0))[:, 0]
    counts = torch.bincount(ids, minlength=8)[where].float()
    assert counts[kept].sum() == 4000 and counts.sum() == 4000, counts
    expected = probs[kept] / probs[kept].sum() * 4000
    assert ((counts[kept] - expected).abs() <= 5 * expected.sqrt() + 1).all(), (counts, expected)


@pytest.mark.parametrize("temperature", [1e-45, 1e-46, 1e-50, 5e-324])
def test_a_temperature_below_float32s_smallest_draws_the_likeliest_token(temperature):
    """The logits are float32, in which a temperature under 1.4e-45 is 0: the max's 0/0 was NaN, and
    --temperature 1e-50 ended in multinomial's RuntimeError, a traceback."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.2]])
    for top_k, top_p in ((None, None), (2, 0.5)):
        ids = sample.draw(logits, temperature, top_k, top_p, torch.Generator().manual_seed(0))
        assert ids[:, 0].tolist() == [1, 0], (temperature, top_k, top_p, ids)


def refuse_to_load(path, *args, **kwargs):
    raise AssertionError(f"{path} was loaded before the arguments were checked")


@pytest.mark.parametrize("argv,message", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1"),
    (["--top_k", "-1"], "--top_k must be >= 0, got -1"),
    (["--top_p", "0"], "--top_p must be in (0, 1], got 0.0"),
    (["--top_p", "1.5"], "--top_p must be in (0, 1], got 1.5"),
    (["--top_p", "nan"], "--top_p must be in (0, 1], got nan"),
    (["--temperature", "0", "--top_p", "0.5"], "--temperature 0 takes the likeliest token, which --top_p keeps "
                                              "anyway: drop it, or pass a --temperature above 0 to draw"),
    (["--temperature", "0", "--top_k", "5", "--top_p", "1"], "which --top_k and --top_p keep anyway: drop them"),
    (["--seed", str(2**70)], f"--seed must fit in 64 bits, got {2**70}"),
    (["--seed", str(-2**63 - 1)], f"--seed must fit in 64 bits, got {-2**63 - 1}"),
    (["--batch_size", "0"], "--batch_size must be positive and at most 2^63 - 1, got 0"),
    (["--num_samples", str(2 ** 63)], f"--num_samples must be positive and at most 2^63 - 1, got {2 ** 63}"),
    (["--max_new_tokens", "-3"], "--max_new_tokens must be positive and at most 2^63 - 1, got -3"),
])
def test_sample_refuses_bad_numbers_before_loading(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sample, "load_model", refuse_to_load)
    with pytest.raises(SystemExit):
        sample.main([str(tmp_path / "ckpt.pt"), "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("tool,argv,flag", [
    (sample.main, ["", "--device", "cpu"], "ckpt"), (sample.main, ["ckpt.pt", "--tokenizer", " "], "--tokenizer"),
    (export.main, ["", "--merged", "m.pt"], "ckpt"), (export.main, ["ckpt.pt", "--out", ""], "--out"),
    (export.main, ["ckpt.pt", "--merged", ""], "--merged"),
    (export.main, ["ckpt.pt", "--out", "hf", "--tokenizer", ""], "--tokenizer"),
    (analyze.main, ["spectrum", "ckpt.pt", "--figures", ""], "--figures"),
    (analyze.main, ["prune", "ckpt.pt", "--data_dir", ""], "--data_dir"),
    (analyze.main, ["prune", "ckpt.pt", "--tokenizer", ""], "--tokenizer"),
    (analyze.main, ["curves", "run", "", "--out", "c.svg"], "metrics"),
    (analyze.main, ["curves", "run", "--out", ""], "--out"),
    (data.main, ["download", "--out", ""], "--out"), (data.main, ["train-tokenizer", "--data_dir", ""], "--data_dir"),
    (data.main, ["train-tokenizer", "--out", ""], "--out"), (data.main, ["stats", "--tokenizer", ""], "--tokenizer"),
    (data.main, ["bench", "--data_dir", ""], "--data_dir"),
    ("suite.py", ["tiny", "--only", "program", "--data_dir", ""], "--data_dir"),
    ("suite.py", ["tiny", "--out", ""], "--out"), ("bench.py", ["--out", ""], "--out")])
def test_every_tool_refuses_an_empty_path_before_any_work(tool, argv, flag, tmp_path, monkeypatch, capsys):
    """"$CKPT" of an unset variable, given to a tool: sample.py and export.py took the run's tokenizer for
    --tokenizer "", export.py said "nothing to write" for --out "", analyze.py wrote no figures for --figures "", and
    data.py read the current folder for --data_dir "". Each is one line naming the flag, before any work."""
    monkeypatch.chdir(tmp_path)  # what a tool might make or read here is not the repo's
    for module in (sample, export, analyze):
        monkeypatch.setattr(module, "load_model", refuse_to_load)
    monkeypatch.setattr(data, "download", lambda *a, **k: pytest.fail("downloaded"))
    if isinstance(tool, str):  # suite.py's and bench.py's main() read sys.argv
        monkeypatch.setattr(sys, "argv", [tool, *argv])
    with pytest.raises(SystemExit):
        {"suite.py": suite.main, "bench.py": bench.main}[tool]() if isinstance(tool, str) else tool(argv)
    err = capsys.readouterr().err
    said = f"{flag} is empty (an unset variable?): pass a path" + (f", or drop {flag}" if flag[0] == "-" else "")
    assert said in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


def test_data_download_takes_an_empty_tokenizer_as_its_own_skip(tmp_path, monkeypatch):
    """download's --tokenizer '' is documented: fetch the shards, no tokenizer (not an empty path refused)."""
    fetched = []
    monkeypatch.setattr(data, "download", lambda out, tokenizer, *a, **k: fetched.append((out, tokenizer)))
    data.main(["download", "--out", str(tmp_path), "--tokenizer", ""])
    assert fetched == [(str(tmp_path), None)]


def test_export_checks_output_paths_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(export, "load_model", refuse_to_load)
    (tmp_path / "a_file").write_text("")
    cases = [(["--out", str(tmp_path / "a_file")], "is a file; pass a folder"),
             (["--out", str(tmp_path / "hf"), "--merged", str(tmp_path / "nodir" / "x.pt")],
              f"no folder {tmp_path / 'nodir'}; create it or pass a file in an existing folder"),
             (["--merged", str(tmp_path)], f"is a folder; pass a file in it, such as {tmp_path / 'dense.pt'}"),
             (["--out", str(tmp_path / "a_file" / "hf")], "cannot make or write into the folder (Not a directory); "
                                                           "pass a folder you can write to"),
             (["--merged", str(tmp_path / "m.pt"), "--tokenizer", str(tmp_path / "t.model")],
              "--tokenizer is for the Hugging Face folder: add --out FOLDER, or drop --tokenizer"),
             (["--out", str(tmp_path / "a_file"), "--tokenizer", str(tmp_path / "t.model")], "is a file"),
             (["--out", str(tmp_path / "hf2"), "--tokenizer", str(tmp_path / "t.model")], "--tokenizer: tokenizer"),
             (["--merged", str(tmp_path / "a_file")], "exists: pass another file, or --overwrite to replace it"),
             # a folder once the export is written, where --merged failed ("Is a directory") after all the work
             (["--out", str(tmp_path / "hf"), "--merged", str(tmp_path / "hf")], "is a folder that --out makes; pass "
              f"a file in it, such as {tmp_path / 'hf' / 'dense.pt'}"),
             (["--out", str(tmp_path / "new" / "hf"), "--merged", str(tmp_path / "new") + "/"],
              "is a folder that --out makes")]
    if os.path.isdir("/proc/self/fdinfo"):  # a folder there that no one writes into, root included
        cases.append((["--out", "/proc/self/fdinfo"], "--out /proc/self/fdinfo: cannot make or write into the folder"))
        # it failed to save after the load and the merge (minutes at 7b), the --out folder written already
        cases.append((["--merged", "/proc/self/fdinfo/dense.pt"], "--merged /proc/self/fdinfo/dense.pt: cannot write "
                      "into /proc/self/fdinfo (No such file or directory); pass a file in a folder you can write to"))
    for argv, message in cases:
        with pytest.raises(SystemExit):
            export.main([str(tmp_path / "ckpt.pt"), *argv])
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"], "nothing is written before the checks"


def test_merged_is_never_a_file_of_the_folder_and_may_go_in_a_new_one(sl_ckpt, tmp_path, monkeypatch, capsys):
    """A --merged that is one of the files the folder export writes (model.safetensors: the folder, written first,
    then lost its weights to a torch checkpoint) is refused before the load, however spelled; one beside them in an
    --out not yet made is written there (it was refused: "no folder")."""
    out = tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setattr(export, "load_model", refuse_to_load)
        for name in export.HF_FILES:
            for merged in (out / name, tmp_path / "x" / ".." / "hf" / name):
                with pytest.raises(SystemExit):
                    export.main([sl_ckpt, "--out", str(out), "--merged", str(merged)])
                err = capsys.readouterr().err
                assert f"is the {name} that --out writes; pass another name, such as" in err, err
    assert list(tmp_path.iterdir()) == [], "nothing is written before the checks"
    export.main([sl_ckpt, "--out", str(out), "--merged", str(out / "dense.pt")])
    assert sorted(p.name for p in out.iterdir()) == sorted([*export.HF_FILES, "dense.pt"])
    assert "model.embed_tokens.weight" in export.load_safetensors(out / "model.safetensors")
    assert torch.load(out / "dense.pt", weights_only=True)["args"]["merged_from"] == "sltrain"


def test_a_failed_export_leaves_no_empty_folder_it_made(tmp_path, sl_ckpt):
    """The --out folder is made before the checkpoint is read (so that one that cannot be made is refused first);
    when the export then fails, the folders it made go again, and a folder that was there stays."""
    with pytest.raises(SystemExit, match="export.py: "):
        export.main([str(tmp_path / "missing.pt"), "--out", str(tmp_path / "new" / "hf")])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    with pytest.raises(SystemExit, match="export.py: "):
        export.main([str(tmp_path / "missing.pt"), "--out", str(tmp_path / "old" / "hf")])
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and list((tmp_path / "old").iterdir()) == []
    (tmp_path / "t.model").write_bytes(b"not a tokenizer")
    with pytest.raises(SystemExit):  # refused before anything is made
        export.main([sl_ckpt, "--out", str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "t.model")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "t.model"]


def test_a_refused_or_failed_export_leaves_no_folder_behind_in_odd_paths(tmp_path):
    """A folder that cannot be made whole (a name too long below a new folder) is refused with nothing left; and
    through a symlink and "..", the folders the OS made (not those of the path read as text) go again."""
    with pytest.raises(SystemExit):
        export.main([str(tmp_path / "missing.pt"), "--out", str(tmp_path / "p" / ("q" * 300))])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "t" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "t" / "sub")
    with pytest.raises(SystemExit, match="export.py: "):
        export.main([str(tmp_path / "missing.pt"), "--out", str(tmp_path / "link" / ".." / "new" / "hf")])
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["sub"]


def test_safetensors_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.randn(2, 2, 2).half()}
    export.save_safetensors(tensors, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 8 == 0 and header["b"]["dtype"] == "BF16" and header["a"]["shape"] == [3, 5]
    back = export.load_safetensors(tmp_path / "t.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_export_merges_and_merged_checkpoint_matches(sl_ckpt, tmp_path):
    model, _ = load_model(sl_ckpt)
    export.main([sl_ckpt, "--out", str(tmp_path / "hf"), "--merged", str(tmp_path / "dense.pt")])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "model.safetensors", "spiece.model", "tokenizer.model", "tokenizer_config.json"]
    weights = export.load_safetensors(tmp_path / "hf" / "model.safetensors")
    q = model.layers[0].attn.q_proj
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], q.merged_weight())
    assert len(weights) == 2 + 9 * model.config.n_layers + 1  # embed, norm, head; 7 projections + 2 norms per layer
    dense, _ = load_model(str(tmp_path / "dense.pt"))
    assert dense.config.method == "full"
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    err = (dense(idx)[0] - model(idx)[0]).abs().max().item()
    assert err < 1e-5, f"merged model's logits differ by {err:.2e}"
    assert sample.sample(str(tmp_path / "dense.pt"), "the", max_new_tokens=4)  # sample.py reads it


def test_every_method_exports_merged_weights_rounded_once(corpus, tmp_path):  # noqa: F811
    """lowrank and relora too (relora's W0 + s·BA was written as its parts, and --merged failed to load), and a
    bf16 export of a float32 run is the float32 merge rounded once, not a product of factors rounded first."""
    for method in ("relora", "lowrank"):
        out = tmp_path / method
        train.main(base_args(corpus, out, 3, "--method", method, "--eval_tokens", "300"))
        ckpt = str(out / "ckpt.pt")
        model, _ = load_model(ckpt)
        export.main([ckpt, "--out", str(out / "hf"), "--merged", str(out / "dense.pt"), "--dtype", "bfloat16"])
        weights = export.load_safetensors(out / "hf" / "model.safetensors")
        assert len(weights) == 2 + 9 * model.config.n_layers + 1, sorted(weights)
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                exact = module.merged_weight()  # float32, as trained here
                hf = weights["model." + export.hf_name(name).removeprefix("model.") + ".weight"]
                assert hf.dtype == torch.bfloat16 and torch.equal(hf, exact.bfloat16()), name
        dense, _ = load_model(str(out / "dense.pt"))
        assert dense.config.method == "full" and dense.embed.weight.dtype == torch.bfloat16
        idx = torch.randint(0, model.config.vocab_size, (2, 16))
        err = (dense.float()(idx)[0] - model(idx)[0]).abs().max().item()
        assert err < 0.05, f"{method}: the bf16 merged model's logits differ by {err:.2e}"


def test_a_merged_checkpoint_records_the_dtype_of_its_weights(sl_ckpt, corpus, tmp_path, capsys):  # noqa: F811
    """--merged --dtype kept the run's dtype in the args it stores, which train.py --eval_only builds the model in: a
    float32 run exported in bf16 was evaluated in float32, and a bf16 run's exact float32 merge rounded to bf16 again.
    The args say the weights' dtype (float16, which train.py does not take, as float32, which holds it exactly), and
    an --amp run's bf16 export is a bf16 model (--amp's parameters are float32)."""
    state = checkpoint.load(sl_ckpt)
    checkpoint.save(tmp_path / "amp.pt", {**state, "args": dict(state["args"], amp=True)})  # --amp: float32 weights
    state["model"] = {k: v.bfloat16() if v.is_floating_point() else v for k, v in state["model"].items()}
    checkpoint.save(tmp_path / "bf16.pt", {**state, "args": dict(state["args"], dtype="bfloat16")})
    runs = {"float32": sl_ckpt, "amp": tmp_path / "amp.pt", "bf16": tmp_path / "bf16.pt"}
    without_out_dir = [a for a in eval_args(corpus, tmp_path) if a not in ("--out_dir", str(tmp_path))]
    cases = [("float32", "bfloat16", "bfloat16", False), ("float32", "float16", "float32", False),
             ("bf16", "float32", "float32", False), ("bf16", "bfloat16", "bfloat16", False),
             ("amp", "bfloat16", "bfloat16", False), ("amp", "float32", "float32", True)]
    for run, dtype, recorded, amp in cases:
        dense = tmp_path / f"{run}.{dtype}.pt"
        export.main([str(runs[run]), "--merged", str(dense), "--dtype", dtype])
        args = torch.load(dense, weights_only=True)["args"]
        assert (args["dtype"], args["amp"]) == (recorded, amp), (run, dtype, args["dtype"], args["amp"])
        capsys.readouterr()
        train.main([*without_out_dir, "--method", "full", "--resume", str(dense)])
        said = f"1 x cpu | {recorded}{' + bf16 autocast' if amp else ''} | --eval_only"
        assert said in capsys.readouterr().out, (run, dtype)


def test_export_never_writes_over_the_checkpoint_it_reads(sl_ckpt, capsys):
    """Named as a file or by its run's folder, and with --overwrite too (which another file's refusal names)."""
    before, folder = open(sl_ckpt, "rb").read(), os.path.dirname(sl_ckpt)
    for source in (sl_ckpt, folder):
        for extra in ([], ["--overwrite"]):
            with pytest.raises(SystemExit):
                export.main([source, "--merged", sl_ckpt, *extra])
            assert "is the checkpoint being exported" in capsys.readouterr().err, (source, extra)
            assert open(sl_ckpt, "rb").read() == before


def test_transformers_loads_the_export_with_our_logits(sl_ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, _ = load_model(sl_ckpt)
    export.main([sl_ckpt, "--out", str(tmp_path / "hf")])
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    idx = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(idx).logits
    err = (ours - theirs).abs().max().item()
    assert err < 1e-5, f"Hugging Face logits differ from ours by {err:.2e}"


def test_transformers_tokenizer_gives_our_ids(sl_ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")  # transformers reads a sentencepiece model through protobuf
    export.main([sl_ckpt, "--out", str(tmp_path / "hf")])
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = sample.load_tokenizer(str(tmp_path / "hf" / "tokenizer.model"))
    for text in ("the kaba dufo.", "Hello world, it's a test.\nTwo  spaces"):
        ids = sp.encode(text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, "the exported tokenizer must give our ids"
        assert tok(text)["input_ids"] == ids + [sp.eos_id()], "a document ends with EOS, as in training"


def test_the_tokenizer_is_in_every_file_transformers_reads_it_from(sl_ckpt, other_tokenizer, tmp_path):
    """tokenizer_config.json names T5Tokenizer, which reads spiece.model (its vocab_files_names): written as
    tokenizer.model alone, transformers 4.x's AutoTokenizer found no model in the folder ("Either model_file or
    model_proto must be specified"); 5.x reads tokenizer.model first, so an export over an earlier one (of another
    run, here) rewrites both. The class's name is the installed transformers' where there is one."""
    try:
        import transformers
        names = {transformers.T5Tokenizer.vocab_files_names["vocab_file"], "tokenizer.model"}
    except ImportError:
        names = {"spiece.model", "tokenizer.model"}
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in names:  # an earlier export's, of another run
        shutil.copy(other_tokenizer, hf / name)
    export.main([sl_ckpt, "--out", str(hf), "--overwrite"])
    assert json.loads((hf / "tokenizer_config.json").read_text())["tokenizer_class"] == "T5Tokenizer"
    trained_with = open(checkpoint.load(sl_ckpt)["args"]["tokenizer"], "rb").read()
    for name in sorted(names):
        assert (hf / name).is_file(), f"no {name} in the export: {sorted(os.listdir(hf))}"
        assert (hf / name).read_bytes() == trained_with, f"{name} is not the run's tokenizer"


@pytest.mark.parametrize("where", ["embed.weight", "layers.0.mlp.up_proj.values"])
def test_export_refuses_weights_past_float16s_range(sl_ckpt, tmp_path, where):
    """A weight past 65504 became inf in a float16 export, without a word: refused, naming the tensor and the dtypes
    that hold it, with no folder or file left; bf16 holds it. A sparse value is checked in its merged weight."""
    ckpt = checkpoint.load(sl_ckpt)
    assert where in ckpt["model"], sorted(ckpt["model"])
    ckpt["model"][where].view(-1)[0] = -1e5
    big = tmp_path / "big.pt"
    checkpoint.save(big, ckpt)
    name = where.replace(".values", ".weight")
    with pytest.raises(SystemExit, match=rf"^export.py: {name} holds a value of magnitude 1e\+05, past "
                                         r"torch.float16's largest, 65504: pass --dtype bfloat16 or float32$"):
        export.main([str(big), "--out", str(tmp_path / "hf"), "--dtype", "float16"])
    with pytest.raises(SystemExit, match="past torch.float16's largest"):
        export.main([str(big), "--merged", str(tmp_path / "dense.pt"), "--dtype", "float16"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"], "nothing is left of the refused exports"
    export.main([str(big), "--merged", str(tmp_path / "dense.pt"), "--dtype", "bfloat16"])
    assert torch.load(tmp_path / "dense.pt", weights_only=True)["model"][name].float().abs().max() > 65504


@pytest.mark.parametrize("where", ["norm.weight", "layers.0.attn.q_proj.values"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_export_refuses_weights_that_are_not_finite(sl_ckpt, tmp_path, where, value):
    """A diverged run's NaN was exported without a word, as a folder (or --merged file) of a model whose every logit
    is NaN; an inf too, and to float16 or bfloat16 it was "past the dtype's largest: pass --dtype bfloat16 or float32",
    a fix that holds no inf. Each is refused naming the tensor (a sparse value in its merged weight), nothing left."""
    ckpt = checkpoint.load(sl_ckpt)
    ckpt["model"][where].view(-1)[0] = value
    bad = tmp_path / "bad.pt"
    checkpoint.save(bad, ckpt)
    message = f"export.py: {where.replace('.values', '.weight')} holds NaN or inf (the run diverged); export an " \
        "earlier checkpoint"
    for argv in (["--out", str(tmp_path / "hf")], ["--merged", str(tmp_path / "dense.pt"), "--dtype", "bfloat16"],
                 ["--merged", str(tmp_path / "dense.pt"), "--dtype", "float16"]):
        with pytest.raises(SystemExit) as e:
            export.main([str(bad), *argv])
        assert str(e.value) == message, (argv, e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"], "nothing is left of the refused exports"


def test_a_value_past_bfloat16s_range_names_float32_alone(sl_ckpt, tmp_path):
    """float32's largest, 3.40e38, is past bfloat16's, 3.39e38: such a value was refused with "pass --dtype bfloat16
    or float32" to a --dtype bfloat16 export."""
    ckpt = checkpoint.load(sl_ckpt)
    ckpt["model"]["norm.weight"][0] = 3.4e38
    big = tmp_path / "big.pt"
    checkpoint.save(big, ckpt)
    with pytest.raises(SystemExit) as e:
        export.main([str(big), "--merged", str(tmp_path / "dense.pt"), "--dtype", "bfloat16"])
    assert str(e.value) == "export.py: norm.weight holds a value of magnitude 3.4e+38, past torch.bfloat16's " \
        "largest, 3.38953e+38: pass --dtype float32", e.value
    export.main([str(big), "--merged", str(tmp_path / "dense.pt")])  # float32 holds it


def test_the_export_pads_with_the_tokenizers_pad(tmp_path):
    """config.json and tokenizer_config.json said pad 0 whatever the tokenizer: the loader pads with its pad piece
    (T5's is 0), so the export names that one."""
    import sentencepiece as spm
    words = [a + b + c for a in "bdgklmnprst" for b in "aeiou" for c in "nrs"]
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(words[i:i + 12]) for i in range(0, len(words), 3)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "p3"), vocab_size=96,
                                   model_type="unigram", pad_id=3, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    model = LLaMA(config_for("tiny", method="full", vocab_size=96))
    export.export_hf(model, {"args": {}}, str(tmp_path / "hf"), str(tmp_path / "p3.model"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    tok = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    piece = spm.SentencePieceProcessor(model_file=str(tmp_path / "p3.model")).id_to_piece(3)
    assert config["pad_token_id"] == 3 and tok["pad_token"] == piece, (config["pad_token_id"], tok["pad_token"])


def test_export_refuses_a_tokenizer_of_another_size_before_writing(sl_ckpt, other_tokenizer, tmp_path):
    with pytest.raises(SystemExit, match="has 80 pieces but the model 96; pass the --tokenizer it was trained with"):
        export.main([sl_ckpt, "--out", str(tmp_path / "hf"), "--tokenizer", other_tokenizer])
    assert not (tmp_path / "hf").exists(), "nothing is written, and the folder made for the export is gone"


def test_the_tools_refuse_a_tokenizer_of_the_same_size_but_not_the_runs(sl_ckpt, corpus, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """The same vocabulary size is not the same tokenizer: sample.py, export.py and analyze.py prune check the sha256
    train.py recorded, as train.py --eval_only does (a tokenizer trained on fewer documents: 96 pieces, other ids).
    Each checks it, and a missing one, at a quick look before it reads the checkpoint whole (at 7b, minutes)."""
    import analyze
    import checkpoint
    import data
    other = str(data.train_tokenizer(corpus[0], tmp_path / "tok" / "spm", vocab_size=96, max_docs=60))
    assert data.load_tokenizer(other).get_piece_size() == 96
    dense = tmp_path / "dense.pt"
    export.main([sl_ckpt, "--merged", str(dense)])
    moved = tmp_path / "moved.pt"  # a run whose tokenizer is gone from where it was
    ckpt = checkpoint.load(sl_ckpt)
    ckpt["args"]["tokenizer"] = str(tmp_path / "gone.model")
    checkpoint.save(moved, ckpt)
    monkeypatch.setattr(checkpoint, "load", lambda path: pytest.fail(f"{path} read whole before the tokenizer check"))
    with pytest.raises(FileNotFoundError, match="gone.model not found"):
        sample.sample(str(moved), "the", max_new_tokens=2)
    with pytest.raises(SystemExit, match="gone.model not found"):
        export.main([str(moved), "--out", str(tmp_path / "hf")])
    refusal = "is not the one the checkpoint was trained with .*; pass --tokenizer with that one"
    with pytest.raises(ValueError, match=refusal):
        sample.sample(sl_ckpt, "the", max_new_tokens=2, tokenizer=other)
    with pytest.raises(SystemExit, match=refusal):
        export.main([sl_ckpt, "--out", str(tmp_path / "hf"), "--tokenizer", other])
    assert not (tmp_path / "hf").exists()
    with pytest.raises(SystemExit, match=refusal):
        analyze.main(["prune", str(dense), "--tokenizer", other])


def test_a_checkpoint_names_its_tokenizer_wherever_the_tools_run(corpus, tmp_path, monkeypatch):  # noqa: F811
    folder, tokenizer = corpus
    monkeypatch.chdir(os.path.dirname(tokenizer))  # trained with --tokenizer spm.model, relative
    train.main(base_args((folder, os.path.basename(tokenizer)), tmp_path / "run", 2))
    monkeypatch.chdir(tmp_path)  # then sampled from another folder
    assert sample.sample(str(tmp_path / "run" / "ckpt.pt"), "the", max_new_tokens=2, temperature=0)


def test_merged_again_replaces_only_when_asked_and_keeps_its_origin(sl_ckpt, tmp_path, capsys):
    dense = tmp_path / "dense.pt"
    export.main([sl_ckpt, "--merged", str(dense)])
    capsys.readouterr()
    export.main([str(dense), "--merged", str(dense.with_name("again.pt"))])  # a merged model, merged again
    assert torch.load(dense.with_name("again.pt"), weights_only=True)["args"]["merged_from"] == "sltrain"
    said = capsys.readouterr().out  # what is recorded, not the method of the file read ("full")
    assert said == f"wrote {dense.with_name('again.pt')}: full-rank, merged from sltrain\n", said
    export.main([sl_ckpt, "--merged", str(dense), "--overwrite", "--dtype", "bfloat16"])
    assert torch.load(dense, weights_only=True)["model"]["lm_head.weight"].dtype == torch.bfloat16


def test_export_again_with_the_folders_own_tokenizer(sl_ckpt, tmp_path, capsys):
    """Re-exporting into a folder is refused without --overwrite (the files are of an earlier export, perhaps of
    another run); with it, and its own tokenizer.model as --tokenizer (the run's may be gone), every file is rewritten
    whole."""
    hf = tmp_path / "hf"
    export.main([sl_ckpt, "--out", str(hf)])
    spm, weights = (hf / "tokenizer.model").read_bytes(), (hf / "model.safetensors").read_bytes()
    again = [sl_ckpt, "--out", str(hf), "--tokenizer", str(hf / "tokenizer.model"), "--dtype", "bfloat16"]
    with pytest.raises(SystemExit):
        export.main(again)
    assert f"--out {hf} holds an export already (config.json, model.safetensors, tokenizer.model, spiece.model, " \
           "tokenizer_config.json): pass another folder, or --overwrite to replace it" in capsys.readouterr().err
    assert (hf / "model.safetensors").read_bytes() == weights
    export.main(again + ["--overwrite"])
    assert (hf / "tokenizer.model").read_bytes() == spm
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert export.load_safetensors(str(hf / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    assert sorted(os.listdir(hf)) == sorted(export.HF_FILES)


def test_an_export_into_a_folder_with_other_files_names_only_its_own(sl_ckpt, tmp_path, capsys):
    """Into the run's own folder, say: it listed every file there (the lock, ckpt.pt, metrics.jsonl) as written."""
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(sl_ckpt), run)
    before = sorted(os.listdir(run))
    capsys.readouterr()
    export.main([str(run), "--out", str(run)])
    assert capsys.readouterr().out == f"wrote {run}: {', '.join(export.HF_FILES)}\n"
    assert sorted(os.listdir(run)) == sorted(before + list(export.HF_FILES))


def test_sample_shows_the_prompt_without_the_whitespace_the_model_never_saw(sl_ckpt):
    plain = sample.sample(sl_ckpt, "the", num_samples=1, max_new_tokens=4, temperature=0)
    assert plain[0].startswith("the") and len(plain[0]) > 3
    for prompt in ("the ", "the  ", "the\n"):
        assert sample.sample(sl_ckpt, prompt, num_samples=1, max_new_tokens=4, temperature=0) == plain, prompt
    assert sample.sample(sl_ckpt, " the", num_samples=1, max_new_tokens=4, temperature=0) == [" " + plain[0]]


def test_a_checkpoint_whose_model_config_is_incomplete_or_foreign_is_refused(sl_ckpt, tmp_path):
    """A field missing from model_config would take its default (alpha and n_heads change no weight's shape, only
    what the model computes), and a method name no model has would build a layer of another kind: both refused."""
    state = checkpoint.load(sl_ckpt)
    for name, edit, message in [("no_alpha", lambda c: c.pop("alpha"), r"missing model_config fields \['alpha'\]"),
                                ("typo", lambda c: c.update(method="sltrian"), "method 'sltrian' is none of")]:
        config = dict(state["model_config"])
        edit(config)
        path = str(tmp_path / f"{name}.pt")
        checkpoint.save(path, {k: v for k, v in state.items() if k != "sha256"} | {"model_config": config})
        with pytest.raises(ValueError, match=message):
            load_model(path)
