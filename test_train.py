"""
End-to-end tests of train.py on the tiny size: tiny C4-style shards and a sentencepiece model made here. The runs,
their resume, DDP, the flags and the memory check are here; what a run does when the world faults (signals, kills,
full disks, bad data, divergence) is test_faults.py's, which takes its fixtures and helpers from here.

    python -m pytest -q test_train.py
"""

import atexit
import errno
import gc
import gzip
import inspect
import json
import os
import random
import re
import resource
import runpy
import shutil
import subprocess
import sys
import time
import weakref
from contextlib import contextmanager, suppress
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import torch

import checkpoint
import data
import download
import export
import flags
import train
from hostsync import HostSyncs
from test_hostsync import mark_pinning
from model import SIZES, LLaMA, LLaMAConfig, config_for, slow_width

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Shards of simple, learnable sentences and a 96-piece tokenizer trained on them. 100 words, where sentencepiece
    0.2.3 could make at most 141 pieces (60 words: 96 here, 86 under the GPU machine's sentencepiece)."""
    folder, rng = tmp_path_factory.mktemp("c4"), random.Random(0)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(2)) for _ in range(100)]
    nouns, verbs, adjs = words[:50], words[50:75], words[75:]

    def doc():
        return " ".join(f"the {rng.choice(adjs)} {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}."
                        for _ in range(rng.randint(2, 8)))

    for name, n in [("c4-train.00000-of-00002.json.gz", 150), ("c4-train.00001-of-00002.json.gz", 150),
                    ("c4-validation.00000-of-00001.json.gz", 40)]:
        lines = "".join(json.dumps({"text": doc(), "timestamp": "2019-04-25T12:57:54Z"}) + "\n" for _ in range(n))
        (folder / name).write_bytes(gzip.compress(lines.encode()))
    tokenizer = data.train_tokenizer(folder, tmp_path_factory.mktemp("tok") / "spm", vocab_size=96)
    return str(folder), str(tokenizer)


@pytest.fixture(scope="module")
def other_tokenizer(corpus, tmp_path_factory):
    """A tokenizer of another size (80 pieces) on the same corpus: what a run was not trained with."""
    return str(data.train_tokenizer(corpus[0], tmp_path_factory.mktemp("tok80") / "spm", vocab_size=80))


def base_args(corpus, out, steps, *extra):
    folder, tokenizer = corpus
    return ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--out_dir", str(out),
            "--total_batch_size", "8", "--batch_size", "4", "--max_length", "32", "--num_training_steps", str(steps),
            "--log_every", "1", "--eval_every", str(steps), "--save_every", "1000", "--eval_tokens", "3000",
            "--workers", "0", *extra]


def eval_args(corpus, out, *extra):
    """--eval_only's command line for base_args' run: its model, data and batch (training flags are refused)."""
    folder, tokenizer = corpus
    return ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--out_dir", str(out), "--batch_size",
            "4", "--max_length", "32", "--eval_tokens", "3000", "--eval_only", *extra]


def metrics(out):
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def final_state(out):
    return torch.load(Path(out) / "ckpt.pt", weights_only=True)


def test_loss_falls_and_metrics_are_recorded(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 40, "--eval_every", "10", "--lr", "1e-2"))
    logs, evals = metrics(tmp_path)
    assert [r["step"] for r in logs] == list(range(1, 41)), "one log row per update, exactly 40 updates"
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gb"} <= set(logs[0])
    first, last = sum(r["loss"] for r in logs[:5]) / 5, sum(r["loss"] for r in logs[-5:]) / 5
    assert last < first - 1.5, f"loss {first:.3f} -> {last:.3f}"
    assert [r["step"] for r in evals] == [10, 20, 30, 40]
    assert evals[-1]["val_ppl"] < 0.5 * evals[0]["val_ppl"], f"val ppl {evals[0]['val_ppl']} -> {evals[-1]['val_ppl']}"
    out = capsys.readouterr().out
    assert "step 40/40 | loss" in out and "| lr " in out and "tok/s | mem" in out and "| eta " in out
    assert "sltrain LLaMA:" in out and "low-rank" in out  # the parameter breakdown at start
    assert final_state(tmp_path)["step"] == 40


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adam8bit"], ["--per_layer"],
                                   ["--optimizer", "adam8bit_per_layer"], ["--pack", "--method", "lowrank"],
                                   ["--amp", "--optimizer", "adam8bit_per_layer"], ["--dtype", "bfloat16"],
                                   ["--dtype", "bfloat16", "--optimizer", "adam8bit_per_layer"]],
                         ids=["adamw", "adam8bit", "per-layer", "adam8bit-per-layer", "packed-lowrank", "amp",
                              "bf16-adamw", "bf16-adam8bit-per-layer"])  # bf16: a GPU's default, here on the CPU
def test_resume_is_bit_exact(corpus, tmp_path, extra):
    # total 8 = batch 4 x 2 micro-batches, so the per-layer runs accumulate too
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(base_args(corpus, straight, 6, *extra))
    train.main(base_args(corpus, split, 6, "--stop_after", "3", *extra))
    assert final_state(split)["step"] == 3
    train.main(base_args(corpus, split, 6, "--resume", *extra))
    a, b = metrics(straight)[0], metrics(split)[0]
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b], f"losses differ: {a} vs {b}"
    sa, sb = final_state(straight), final_state(split)
    for name, t in sa["model"].items():
        assert torch.equal(t, sb["model"][name]), f"{name} differs by {(t - sb['model'][name]).abs().max()}"
    assert metrics(straight)[1] == metrics(split)[1]


def test_packed_supports_train_as_flat_ones_and_a_run_resumes_in_either_format(corpus, tmp_path, capsys):
    """--packed_support changes how the supports are stored, not the run: the losses, weights and supports of a
    flat run, to the bit. A run resumed without it (or evaluated) goes on from the packed checkpoint as the
    straight run does."""
    flat, packed, switched = tmp_path / "flat", tmp_path / "packed", tmp_path / "switched"
    extra = ("--optimizer", "adam8bit_per_layer")
    train.main(base_args(corpus, flat, 6, *extra))
    train.main(base_args(corpus, packed, 6, *extra, "--packed_support"))
    train.main(base_args(corpus, switched, 6, *extra, "--packed_support", "--stop_after", "3"))
    capsys.readouterr()
    train.main(base_args(corpus, switched, 6, *extra, "--resume"))
    assert "changed and honored: packed_support True -> False" in capsys.readouterr().out
    runs = [metrics(out) for out in (flat, packed, switched)]
    assert [r["loss"] for r in runs[0][0]] == [r["loss"] for r in runs[1][0]] == [r["loss"] for r in runs[2][0]]
    assert runs[0][1] == runs[1][1] == runs[2][1]
    a, b, c = (final_state(out)["model"] for out in (flat, packed, switched))
    supports = [name for name in a if name.endswith("indices")]
    assert supports and all(b[name].dtype == torch.uint8 and c[name].dtype == torch.int32 for name in supports)
    unpacked = LLaMA(LLaMAConfig(**final_state(flat)["model_config"]))  # flat supports
    unpacked.load_state_dict(b)  # the packed run's, unpacked on loading
    for name, t in a.items():
        assert torch.equal(t, c[name]) and torch.equal(t, unpacked.state_dict()[name]), name
    capsys.readouterr()
    train.main(eval_args(corpus, packed))  # a packed checkpoint, evaluated with flat supports
    assert f"at step 6 | val loss {runs[1][1][-1]['val_loss']:.4f}" in capsys.readouterr().out
    model, _ = checkpoint.load_model(packed)  # as sample.py, export.py and analyze.py read it: packed as saved
    layers = [m for m in model.modules() if hasattr(m, "packed")]
    assert len(layers) == 14 and all(m.packed for m in layers)  # tiny: 7 SLTrain projections a block, 2 blocks
    older = final_state(flat)  # a checkpoint from before --packed_support has no such field: its supports are flat
    del older["model_config"]["packed_support"], older["sha256"]
    checkpoint.save(tmp_path / "older.pt", older)
    model, _ = checkpoint.load_model(tmp_path / "older.pt")
    assert not model.config.packed_support and torch.equal(model.state_dict()[supports[0]], a[supports[0]])


@pytest.fixture
def deterministic_restored(monkeypatch):
    """--deterministic sets torch's mode and the cuBLAS variable for the whole process: both as before, after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def test_deterministic_is_set_for_the_run_changes_no_number_on_a_cpu_and_may_change_on_resume(
        corpus, tmp_path, capsys, deterministic_restored):
    """--deterministic turns on torch's deterministic algorithms and cuBLAS's fixed workspace, and says so; a run
    without it turns them off. A CPU run's numbers are the same either way, to the bit, although the mode fills the
    memory of torch.empty with NaN: no step reads memory it did not write. A resume may switch it, and says so; an
    evaluation takes it too."""
    extra = ("--optimizer", "adam8bit_per_layer", "--packed_support")
    runs = {}
    for name, flag in (("plain", ()), ("deterministic", ("--deterministic",)), ("again", ())):
        train.main(base_args(corpus, tmp_path / name, 3, *extra, *flag))
        said = capsys.readouterr().out
        assert torch.are_deterministic_algorithms_enabled() == bool(flag)
        assert (" | deterministic | 8-bit step:" in said) == bool(flag), said[-3000:]
        runs[name] = final_state(tmp_path / name)
        if flag:
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
            assert torch.empty(8).isnan().all() and torch.empty(8, dtype=torch.bfloat16).isnan().all()  # filled
    for name in ("deterministic", "again"):
        for rows, plain in zip(metrics(tmp_path / name), metrics(tmp_path / "plain")):  # logs, then evaluations
            assert [r.get("loss", r.get("val_loss")) for r in rows] == [r.get("loss", r.get("val_loss")) for r in plain]
        for key, t in runs["plain"]["model"].items():
            assert torch.equal(t, runs[name]["model"][key]), f"{name}: {key}"
        assert runs[name]["args"]["deterministic"] == (name == "deterministic")
    train.main(base_args(corpus, tmp_path / "plain", 4, *extra, "--resume", "--deterministic"))
    assert "changed and honored: num_training_steps 3 -> 4, eval_every 3 -> 4, deterministic False -> True" in \
        capsys.readouterr().out
    assert torch.are_deterministic_algorithms_enabled()
    train.main(eval_args(corpus, tmp_path / "plain", "--packed_support"))  # without it: off
    assert not torch.are_deterministic_algorithms_enabled()
    train.main(eval_args(corpus, tmp_path / "plain", "--packed_support", "--deterministic"))
    assert torch.are_deterministic_algorithms_enabled() and " | deterministic | " in capsys.readouterr().out


def test_deterministic_under_a_cublas_setting_that_is_not_is_refused(corpus, tmp_path, capsys, monkeypatch,
                                                                      deterministic_restored):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path, 2, "--deterministic"))
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--deterministic: CUBLAS_WORKSPACE_CONFIG=:0:0 leaves cuBLAS's GEMMs nondeterministic; unset it or set it "
        "to :4096:8")
    assert not os.path.exists(tmp_path / "metrics.jsonl") and not torch.are_deterministic_algorithms_enabled()
    for fine in (":16:8", ":4096:8"):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", fine)
        assert flags.get_args(base_args(corpus, tmp_path, 2, "--deterministic")).deterministic
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # not read without the flag
    assert not flags.get_args(base_args(corpus, tmp_path, 2)).deterministic


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [["--optimizer", "adam8bit_per_layer", "--packed_support"],
                                   ["--method", "full", "--grad_clipping", "1.0"], ["--cuda_graph"]],
                         ids=["sltrain-adam8bit-per-layer-packed", "full-adamw-clipped", "sltrain-cuda-graph"])
def test_on_a_gpu_deterministic_runs_agree_and_resume_to_the_bit(corpus, tmp_path, extra, deterministic_restored):
    """On a GPU, where index_add, the loss's scatter and the embedding's gradient may add in another order at each
    call, --deterministic makes a run of six updates of two micro-batches and the same run stopped after three and
    resumed agree to the bit: losses, evaluation and weights. Under --cuda_graph the sorting scatters are captured
    too, which fails on any host sync."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    args = ("--device", "cuda", "--deterministic", *extra)
    train.main(base_args(corpus, straight, 6, *args))
    train.main(base_args(corpus, split, 6, "--stop_after", "3", *args))
    train.main(base_args(corpus, split, 6, "--resume", *args))
    (logs, evals), (logs_split, evals_split) = metrics(straight), metrics(split)
    assert [r["loss"] for r in logs] == [r["loss"] for r in logs_split], (logs, logs_split)
    assert [r["val_loss"] for r in evals] == [r["val_loss"] for r in evals_split]
    split_model = final_state(split)["model"]
    for name, t in final_state(straight)["model"].items():
        assert torch.equal(t, split_model[name]), f"{name} differs by {(t - split_model[name]).abs().max()}"


def test_a_resume_without_the_runs_flags_takes_the_runs_own(corpus, tmp_path, capsys):
    """--resume alone continues the run as it was: the learning rate, schedule, betas, decay, clipping, length,
    intervals and micro-batch it was started with, not the size's or the device's defaults, nothing said changed;
    a flag given is honored. The memory check is made once, at the run's own micro-batch and dtype."""
    own = ["--lr", "1e-3", "--min_lr_ratio", "0.2", "--beta2", "0.95", "--weight_decay", "0.01", "--grad_clipping",
           "0.5", "--eval_every", "3", "--batch_size", "2"]  # 2 x 4 micro-batches, where the CPU's default is 8 x 1
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(base_args(corpus, straight, 6, *own))
    train.main(base_args(corpus, split, 6, "--stop_after", "2", *own))
    folder, tokenizer = corpus
    bare = ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--out_dir", str(split),
            "--total_batch_size", "8", "--max_length", "32", "--workers", "0"]
    capsys.readouterr()
    checked, check = [], flags.check_memory
    spy = lambda p, args, *rest, **kw: (checked.append((args.batch_size, args.dtype)),  # noqa: E731
                                        check(p, args, *rest, **kw))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(flags, "check_memory", spy)
        train.main(bare + ["--resume"])
    said = capsys.readouterr().out
    assert "resuming from" in said and "changed" not in said, said
    assert checked == [(2, "float32")], checked
    step = lambda rows: [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows[0]]  # noqa: E731
    assert step(metrics(straight)) == step(metrics(split)) and metrics(straight)[1] == metrics(split)[1]
    assert final_state(split)["args"]["lr"] == 1e-3
    train.main(bare + ["--resume", "--num_training_steps", "8", "--log_every", "4"])
    assert "changed and honored: num_training_steps 6 -> 8, log_every 1 -> 4" in capsys.readouterr().out
    assert final_state(split)["step"] == 8 and final_state(split)["args"]["beta2"] == 0.95
    train.main(bare + ["--resume", "--num_training_steps", "9", "--gradient_accumulation", "1"])  # given: honored
    assert "batch_size 2 -> 8, gradient_accumulation 4 -> 1" in capsys.readouterr().out


def test_a_resume_takes_the_runs_micro_batch_where_the_devices_default_does_not_divide_the_update(corpus, tmp_path,
                                                                                                 capsys):
    """A run of 24 sequences an update in micro-batches of 8 (or 2 processes' default of 12 each, resumed on one),
    resumed without --batch_size: the CPU's default of 16, which the resume was to replace with the run's 8, does not
    divide 24, and was refused naming --batch_size 12 or --total_batch_size 32 (which a resume refuses)."""
    folder, tokenizer = corpus
    bare = ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--out_dir", str(tmp_path),
            "--total_batch_size", "24", "--max_length", "32", "--num_training_steps", "2", "--workers", "0"]
    train.main(bare + ["--batch_size", "8", "--stop_after", "1"])
    capsys.readouterr()
    train.main(bare + ["--resume"])
    said = capsys.readouterr()
    assert "resuming from" in said.out and "changed" not in said.out and "error" not in said.err, said
    assert final_state(tmp_path)["args"]["batch_size"] == 8 and final_state(tmp_path)["step"] == 2


@pytest.mark.parametrize("optimizer", ["adamw", "adam8bit_per_layer"])
def test_a_resumed_run_frees_the_checkpoints_tensors_once_loaded(corpus, tmp_path, monkeypatch, optimizer):
    """The checkpoint's model weights and optimizer state, once loaded into the model and optimizer, are not held
    through the run (at 7b on a GPU they were the whole checkpoint in host memory, on every rank, to the end)."""
    train.main(base_args(corpus, tmp_path, 4, "--optimizer", optimizer, "--stop_after", "2"))
    held, build, run_training = [], train.build, train.train

    def spy_build(args, config, device, dtype, ddp, ckpt):
        held.extend(weakref.ref(t) for t in ckpt["model"].values())
        return build(args, config, device, dtype, ddp, ckpt)

    def spy_train(*a):
        gc.collect()
        alive = [r for r in held if r() is not None]
        assert held and not alive, f"{len(alive)} of the checkpoint's {len(held)} weights alive in the run"
        return run_training(*a)
    monkeypatch.setattr(train, "build", spy_build)
    monkeypatch.setattr(train, "train", spy_train)
    train.main(base_args(corpus, tmp_path, 4, "--optimizer", optimizer, "--resume"))
    assert final_state(tmp_path)["step"] == 4


def test_a_resumed_warmup_is_checked_against_the_runs_own_updates(corpus, tmp_path):
    """--warmup_steps on a resume without --num_training_steps is checked against the run's updates, not the size's
    default (tiny's 1000): a warmup within a long run is taken, one past a short run's end refused."""
    def resume(out, *extra):  # base_args less --num_training_steps and --eval_every: the run's own
        argv = base_args(corpus, out, 0, "--resume", *extra)
        for flag in ("--num_training_steps", "--eval_every"):
            argv = argv[:argv.index(flag)] + argv[argv.index(flag) + 2:]
        return argv
    long, short = tmp_path / "long", tmp_path / "short"
    train.main(base_args(corpus, long, 2000, "--stop_after", "1"))
    train.main(resume(long, "--warmup_steps", "1500", "--stop_after", "1"))  # one update more
    args = final_state(long)["args"]
    assert final_state(long)["step"] == 2 and (args["warmup_steps"], args["num_training_steps"]) == (1500, 2000)
    train.main(base_args(corpus, short, 6, "--stop_after", "2"))
    with pytest.raises(SystemExit, match=r"^--resume: --warmup_steps must be in \[0, 6\] \(the run's "
                                         r"--num_training_steps\), got 10$"):
        train.main(resume(short, "--warmup_steps", "10"))
    assert final_state(short)["step"] == 2


@pytest.mark.parametrize("before,warmup,total,ended", [(2, 5, 6, "its warmup"), (2, 1, 6, "its warmup"),
                                                      (2, 8, 12, "its warmup"), (5, 2, 12, "the new warmup")])
def test_a_resume_past_a_warmups_end_keeps_the_runs_warmup(corpus, tmp_path, before, warmup, total, ended):
    """At update 3 of a run warming up over 2, a new --warmup_steps 5 or 8 climbed a second ramp from 3/5 and then
    dropped to the old cosine where it stood (with a raised --num_training_steps); 1, or 2 for a run warming up over
    5, jumped the learning rate. Each refused, with or without new steps; the run's own warmup goes on."""
    train.main(base_args(corpus, tmp_path, 6, "--warmup_steps", str(before), "--stop_after", "3"))
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, total, "--resume", "--warmup_steps", str(warmup)))
    assert str(e.value) == (f"--resume: {tmp_path}/ckpt.pt is at update 3, past the end of {ended}, and "
                            f"--warmup_steps {warmup} is not the run's {before}: a warmup can be changed only while "
                            "both are still ahead; drop --warmup_steps"), e.value
    assert final_state(tmp_path)["step"] == 3
    train.main(base_args(corpus, tmp_path, total, "--resume", "--warmup_steps", str(before)))
    assert final_state(tmp_path)["step"] == total


def test_a_decay_a_resumed_bf16_run_cannot_take_is_refused(corpus, tmp_path):
    """On a CPU a new run's parameters are float32, where any decay acts; a resume without --dtype takes the run's
    bf16, where --weight_decay 0.1 at lr 3e-3 rounds away: refused once the run's dtype is known, before any update,
    as at the start of a bf16 run. --amp's float32 parameters are another dtype, which this resume refuses too (naming
    --amp, not a --dtype it was not given), so the refusal names fixes the resume takes: --weight_decay 0, or one at
    the bound it names."""
    train.main(base_args(corpus, tmp_path, 4, "--dtype", "bfloat16", "--lr", "3e-3", "--stop_after", "2"))
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 4, "--resume", "--weight_decay", "0.1"))
    found = re.search(r"^--resume: .*ckpt.pt holds bf16 parameters, and --weight_decay 0.1 with bf16 parameters: .* "
                      r"would do nothing; (.*)$", str(e.value))
    assert found and "pass --amp" not in found[1], e.value  # --amp is refused on this resume: no fix to name
    bound = re.fullmatch(r".*: pass --weight_decay 0, or one of at least ([\d.]+) at --lr 0.003", found[1])
    assert bound, found[1]
    with pytest.raises(SystemExit, match=r"dtype bfloat16 \(now float32, by --amp: drop --amp\)"):
        train.main(base_args(corpus, tmp_path, 4, "--resume", "--weight_decay", "0.1", "--amp"))
    assert final_state(tmp_path)["step"] == 2
    train.main(base_args(corpus, tmp_path, 4, "--resume", "--weight_decay", bound[1]))  # lr x bound >= 2^-9: it acts
    assert final_state(tmp_path)["step"] == 4 and final_state(tmp_path)["args"]["weight_decay"] == float(bound[1])


def test_an_amp_run_resumed_without_amp_on_a_gpu_is_refused_naming_amp(corpus, tmp_path, monkeypatch):
    """An --amp run's parameters are float32; resumed on a GPU (faked) without --amp, the device's pure bf16 is
    another dtype: refused, naming --amp, the flag that made the difference."""
    train.main(base_args(corpus, tmp_path, 4, "--amp", "--stop_after", "2"))
    one_gpu(monkeypatch, 70e9)
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 4, "--resume", "--device", "cuda"))
    assert "dtype float32 (now bfloat16, the run's was --amp's: pass --amp)" in str(e.value), e.value
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 4, "--resume", "--device", "cuda", "--dtype", "bfloat16"))
    assert "the run's was --amp's: pass --amp instead of --dtype" in str(e.value), e.value


def test_a_float32_run_with_a_decay_resumes_on_a_gpu_in_float32(corpus, tmp_path, monkeypatch):
    """A resume without --dtype takes the run's own, also on a GPU (faked), whose default is bf16: a float32 run's
    --weight_decay 0.1 at lr 3e-3, which bf16 would round away, is checked against the run's float32, not refused
    as bf16's, whether the command line repeats it or not."""
    train.main(base_args(corpus, tmp_path, 4, "--lr", "3e-3", "--weight_decay", "0.1", "--stop_after", "2"))
    one_gpu(monkeypatch, 70e9)
    for extra in ([], ["--weight_decay", "0.1"]):
        args = train.get_args(base_args(corpus, tmp_path, 4, "--resume", "--device", "cuda", *extra))
        args.dtype = flags.run_dtype(args, torch.device("cuda"))  # as train.setup: the device's default, bf16
        args.tokenizer_sha256 = final_state(tmp_path)["args"]["tokenizer_sha256"]
        train.load_for_resume(args, 96, 1, torch.device("cuda"), dtype_given=False, given=flags.given_flags(
            base_args(corpus, tmp_path, 4, "--resume", "--device", "cuda", *extra)))
        assert (args.dtype, args.weight_decay) == ("float32", 0.1), (extra, args.dtype, args.weight_decay)


def test_a_resume_without_dtype_takes_the_runs_own(corpus, tmp_path):
    """A bf16 run (a GPU's default) resumed on a CPU, whose default is float32, goes on in bf16 when --dtype is not
    given, and its memory is checked in bf16; given, another dtype is refused."""
    train.main(base_args(corpus, tmp_path, 4, "--stop_after", "2", "--dtype", "bfloat16"))
    with pytest.raises(SystemExit, match=r"dtype bfloat16 \(now float32\)"):
        train.main(base_args(corpus, tmp_path, 4, "--resume", "--dtype", "float32"))
    checked, check = [], flags.check_memory
    with pytest.MonkeyPatch.context() as m:
        m.setattr(flags, "check_memory", lambda p, args, *rest, **kw: (checked.append(args.dtype),
                                                                      check(p, args, *rest, **kw)))
        train.main(base_args(corpus, tmp_path, 4, "--resume"))
    assert checked == ["bfloat16"], checked
    state = final_state(tmp_path)
    assert state["step"] == 4 and state["args"]["dtype"] == "bfloat16"
    assert {t.dtype for k, t in state["model"].items() if k.endswith(".A")} == {torch.bfloat16}


def run_torchrun(args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "train.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adam8bit_per_layer"]], ids=["adamw", "adam8bit-per-layer"])
def test_torchrun_two_processes_match_one(corpus, tmp_path, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    train.main(base_args(corpus, one, 5, "--batch_size", "8", *extra))  # one process, the whole global batch
    out = run_torchrun(base_args(corpus, two, 5, "--batch_size", "4", *extra))  # two ranks of 4
    assert "\n2 x cpu (DDP: gloo) | " in out  # the header says what the gradients go through
    assert_same_updates(one, two)


def assert_same_updates(one, two):
    """Two runs of the same updates on other numbers of processes: every logged loss and the validation loss within
    1e-5 relative, the parameters within 1e-4 (the sums go over other ranks)."""
    a, b = metrics(one), metrics(two)
    for ra, rb in zip(a[0], b[0], strict=True):
        assert abs(ra["loss"] - rb["loss"]) < 1e-5 * ra["loss"], f"step {ra['step']}: {ra['loss']} vs {rb['loss']}"
    assert abs(a[1][0]["val_loss"] - b[1][0]["val_loss"]) < 1e-5 * a[1][0]["val_loss"]
    sa, sb = final_state(one)["model"], final_state(two)["model"]
    diff = max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
    assert diff < 1e-4, f"parameters differ by {diff}"


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_number_of_processes(corpus, tmp_path, capsys, before, after):
    """Stopped on one number of processes, resumed on another: the same updates (the global batch is the same
    documents, dealt anew), so the losses are the straight run's as in the test above, the loss of the update before
    the stop carried into the next log row. The resume says the change and where the data goes on."""
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train.main(base_args(corpus, straight, 5, "--batch_size", "8", "--log_every", "2"))
    said = []
    for n, extra in ((before, ("--stop_after", "3")), (after, ("--resume",))):
        args = base_args(corpus, moved, 5, "--batch_size", str(8 // n), "--log_every", "2", *extra)
        if n == 1:
            train.main(args)
            said.append(capsys.readouterr().out)
        else:
            said.append(run_torchrun(args, nproc=n))
    assert f"changed and honored: batch_size {8 // before} -> {8 // after}, processes {before} -> {after}" in said[1]
    assert (f"the data goes on from document 24 of shard 0 of pass 0, the first that no run had trained on, dealt "
            f"anew to this run's {after} process{'es' * (after > 1)} (the checkpoint's: {before}): 0 documents trained "
            "on before come again, none is left out") in said[1]
    assert [r["step"] for r in metrics(moved)[0]] == [2, 4, 5]  # 4's row: updates 3 (before the stop) and 4
    assert final_state(moved)["world"] == after and len(final_state(moved)["data"]) == after
    assert_same_updates(straight, moved)

@pytest.mark.parametrize("world,counts", [(3, "2 or 4"), (16, "8")])
def test_a_resume_on_processes_the_update_does_not_split_over_names_the_processes_it_does(corpus, tmp_path,
                                                                                           monkeypatch, capsys, world,
                                                                                           counts):
    """A job requeued on 3 processes, its update of 8 sequences kept (a resume refuses another --total_batch_size):
    the refusal named --total_batch_size 12, which the resume would then refuse as another run's."""
    torchrun_variables(monkeypatch, rank=0, local_rank=0, world=world)
    for extra in ((), ("--batch_size", "1"), ("--gradient_accumulation", "1")):
        with pytest.raises(SystemExit):
            train.get_args(base_args(corpus, tmp_path, 4, "--resume", *extra))
        err = capsys.readouterr().err
        assert (f"--resume on {world} processes: the run's update of --total_batch_size 8 sequences, which a resume "
                f"keeps, does not split into {world} equal shares; resume on {counts} processes") in err, err
        assert "pass --total_batch_size" not in err, err


@pytest.mark.parametrize("extra,world,message,fixed", [
    (["--gradient_accumulation", "1", "--batch_size", "4"], 1, "= 4, not --total_batch_size 8; drop "
     "--gradient_accumulation or drop --batch_size", ["--gradient_accumulation"]),
    (["--gradient_accumulation", "2", "--batch_size", "3"], 2, "= 12, not --total_batch_size 8; drop --batch_size",
     ["--batch_size"]),
    (["--gradient_accumulation", "3", "--batch_size", "3"], 2, "= 18, not --total_batch_size 8; drop "
     "--gradient_accumulation and --batch_size", ["--gradient_accumulation", "--batch_size"]),
    (["--gradient_accumulation", "3"], 2, "--total_batch_size 8 is not a multiple of --gradient_accumulation 3 x 2 "
     "devices; drop --gradient_accumulation, or pass one that divides it", ["--gradient_accumulation"]),
])
def test_a_resume_whose_batch_flags_no_longer_make_the_update_names_a_fix_it_takes(corpus, tmp_path, monkeypatch,
                                                                                   capsys, extra, world, message,
                                                                                   fixed):
    """A job requeued on other processes with its script's --gradient_accumulation (2 ranks of 4 x 1, now one): the
    refusal named --total_batch_size 4, which the resume refuses as another run's, where the accumulation adapts."""
    torchrun_variables(monkeypatch, rank=0, local_rank=0, world=world)
    run = base_args(corpus, tmp_path, 4, "--resume")
    run = run[:run.index("--batch_size")] + run[run.index("--batch_size") + 2:] + extra  # the script's own
    with pytest.raises(SystemExit):
        train.get_args(run)
    err = capsys.readouterr().err
    assert message in err and "pass --total_batch_size" not in err, err
    for flag in fixed:
        run = run[:run.index(flag)] + run[run.index(flag) + 2:]
    args = train.get_args(run)
    assert args.batch_size * args.gradient_accumulation * world == args.total_batch_size == 8


def test_a_default_micro_batch_that_does_not_divide_the_update_is_said_to_be_the_default(capsys):
    """A new run given only --total_batch_size was refused naming "--batch_size 16", a value the user never gave:
    the line says it is the default (the refusal stands: the fix names a micro-batch, or a total, that works)."""
    with pytest.raises(SystemExit):
        train.get_args(["--size", "tiny", "--device", "cpu", "--total_batch_size", "20"])
    assert capsys.readouterr().err.rstrip().endswith(
        "--total_batch_size 20 is not a multiple of --batch_size 16 (the default) x 1 devices; pass --batch_size 10 or "
        "--total_batch_size 32")
    with pytest.raises(SystemExit):
        train.get_args(["--size", "tiny", "--device", "cpu", "--total_batch_size", "20", "--batch_size", "16"])
    assert "--batch_size 16 x 1 devices" in capsys.readouterr().err  # given: no "(the default)"


@pytest.mark.parametrize("world,batch,fits", [(1, 3, 2), (2, 3, 2), (1, 5, 4)])
def test_a_resume_whose_batch_size_does_not_divide_the_update_names_a_batch_size(corpus, tmp_path, monkeypatch,
                                                                               capsys, world, batch, fits):
    """--resume --batch_size 3 of a run of 8 sequences an update: the refusal named --total_batch_size 9 too, which
    the resume then refuses as another run's. It names the --batch_size that fits, which is taken, and so is dropping
    --batch_size (a resume's default is a micro-batch that divides the update)."""
    torchrun_variables(monkeypatch, rank=0, local_rank=0, world=world)
    run = base_args(corpus, tmp_path, 4, "--resume")
    run = run[:run.index("--batch_size")] + run[run.index("--batch_size") + 2:]
    with pytest.raises(SystemExit):
        train.get_args(run + ["--batch_size", str(batch)])
    err = capsys.readouterr().err
    assert f"is not a multiple of --batch_size {batch} x {world} devices; pass --batch_size {fits}" in err, err
    assert "--total_batch_size" not in err.split("; pass ")[-1], err
    for extra in (["--batch_size", str(fits)], []):
        args = train.get_args(run + extra)
        assert args.batch_size * args.gradient_accumulation * world == args.total_batch_size == 8


def test_a_packed_resume_on_another_number_of_processes_counts_the_blocks_begun_apart(corpus, capsys):
    """In --pack mode a rank's place within its block of documents is not kept: the resume line counts the documents
    of the blocks begun, read again whole, apart from those trained on."""
    folder, tokenizer = corpus
    args = SimpleNamespace(data_dir=folder, tokenizer=tokenizer, batch_size=2, max_length=32, seed=42, pack=True,
                           workers=0, size="tiny", resume=None, out_dir="out")
    ranks = [data.TrainLoader(folder, tokenizer, 2, max_length=32, rank=r, world_size=2, pack=True) for r in range(2)]
    for ld in ranks:
        next(iter(ld))  # a batch a rank: its first block begun (a block is 512 documents, more than its share)
    moved = train.train_loader(args, 0, 1, {"data": [ld.state_dict() for ld in ranks]}).regathered
    assert moved["seen_again"] == 0 and moved["begun_again"] == 150, moved  # the two shares of the first shard
    assert ("the data goes on from document 0 of shard 0 of pass 0, the first that no run had trained on, dealt anew "
            "to this run's 1 process (the checkpoint's: 2): 0 documents trained on before come again, and 150 of "
            "blocks begun, read again whole, none is left out") in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--per_layer", "--grad_clipping", "1.0"], "drop --grad_clipping or drop --per_layer"),
    # per-layer updates by the optimizer's name: no --per_layer to drop
    (["--optimizer", "adam8bit_per_layer", "--grad_clipping", "1.0"], "drop --grad_clipping or pass --optimizer "
                                                                      "adam8bit"),
    (["--optimizer", "adamw_per_layer", "--per_layer", "--grad_clipping", "1.0"], "drop --grad_clipping or pass "
                                                                                  "--optimizer adamw without "
                                                                                  "--per_layer"),
    (["--total_batch_size", "10"], "is not a multiple of --batch_size 4 x 1 devices; pass --batch_size 2 or "
                                   "--total_batch_size 12"),  # base_args' --batch_size 4
    (["--total_batch_size", "7", "--batch_size", "2"], "pass --batch_size 1 or --total_batch_size 8"),
    (["--delta", "1.5"], "delta must be in"),
    (["--rank", "64"], "--rank 64 must be below min(dim 64, ffn_dim 176) = 64, every projection's smaller side: pass "
                       "a smaller --rank"),
    (["--ffn_dim", "3"], "--size tiny's rank, 16, must be below min(dim 64, ffn_dim 3) = 3, every projection's smaller "
                         "side: pass a smaller --rank or a larger --ffn_dim"),  # the flag that made it too narrow
    (["--method", "relora", "--rank", "100"], "--rank 100 must be below min(dim 64, ffn_dim 176) = 64"),
    (["--model_config", "configs/llama_99m.json"], "expected configs/llama_<size>.json"),
    (["--model_config", "configs/llama_60m.json"], "is size 60m, --size says tiny: drop one"),  # base_args' --size
    (["--block_size", "2048"], "--block_size: not read by --method sltrain with --optimizer adamw; drop it, or pass an "
                               "8-bit --optimizer"),
    (["--optimizer", "adam8bit", "--block_size", "0"], "--block_size must be >= 1, got 0"),
    (["--optimizer", "adam8bit", "--block_size", "1000000000000"], "--block_size 1000000000000 is larger than any "
     "tensor of the tiny model (the largest has 2,048,000 entries), and each tensor's 8-bit moments fill whole blocks"),
    (["--adam8bit_kernel", "off"], "--adam8bit_kernel: not read by --method sltrain with --optimizer adamw; drop it, "
                                   "or pass an 8-bit --optimizer"),
    (["--optimizer", "adam8bit", "--adam8bit_kernel", "on"], "--adam8bit_kernel on: the one-kernel 8-bit step cannot "
                                                             "run here: it runs on a CUDA GPU, not on cpu; pass"),
    (["--optimizer", "galore_adam8bit", "--method", "full", "--adam8bit_kernel", "on"], "pass --adam8bit_kernel auto "
                                                                                        "(the kernel where it can "
                                                                                        "run) or off"),
])
def test_bad_flags_fail_before_any_work(corpus, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 4, *extra))
    assert message in str(e.value) + capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists(), "no work may start before the flags are checked"


@pytest.mark.parametrize("extra,message,fixed", [
    (["--total_batch_size", "8", "--gradient_accumulation", "16"], "--total_batch_size 8 is not a multiple of "
     "--gradient_accumulation 16 x 1 devices; pass --total_batch_size 16, or a --gradient_accumulation that divides it",
     ["--total_batch_size", "16"]),
    (["--total_batch_size", "100", "--gradient_accumulation", "3"], "pass --total_batch_size 102, or a",
     ["--total_batch_size", "102"]),
    (["--total_batch_size", "100", "--gradient_accumulation", "3", "--batch_size", "33"],
     "--gradient_accumulation 3 x --batch_size 33 x 1 devices = 99, not --total_batch_size 100; pass "
     "--total_batch_size 99", ["--total_batch_size", "99"]),
    (["--total_batch_size", "96", "--gradient_accumulation", "3", "--batch_size", "33"],
     "= 99, not --total_batch_size 96; pass --total_batch_size 99 or drop --batch_size", ["--batch_size", None]),
])
def test_the_batch_arithmetic_names_a_fix_that_is_taken(corpus, capsys, extra, message, fixed):
    """Micro-batch x accumulation x devices = total, exactly: a total the accumulation does not divide (once a
    ZeroDivisionError where the micro-batch came out 0) names a total that it does; three flags that disagree name
    the total the other two make, and dropping --batch_size where that works. Each named fix is then taken."""
    folder, tokenizer = corpus
    run = ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--device", "cpu", *extra]
    with pytest.raises(SystemExit):
        train.get_args(run)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    flag, value = fixed
    i = run.index(flag)
    args = train.get_args(run[:i] + run[i + 2:] + ([flag, value] if value else []))
    assert args.batch_size * args.gradient_accumulation == args.total_batch_size


def test_a_resume_reaching_the_data_through_a_link_is_the_same_run(corpus, tmp_path):
    """The data folder is compared as a folder, not as a path: a link to it (another mount point, a job's scratch
    link) resumes; another folder is refused."""
    train.main(base_args(corpus, tmp_path / "run", 4, "--stop_after", "2"))
    link = tmp_path / "linked_c4"
    link.symlink_to(corpus[0], target_is_directory=True)
    argv = base_args(corpus, tmp_path / "run", 4, "--resume")
    argv[argv.index("--data_dir") + 1] = str(link)
    train.main(argv)
    assert final_state(tmp_path / "run")["step"] == 4
    other = tmp_path / "copy_c4"
    shutil.copytree(corpus[0], other)
    argv[argv.index("--data_dir") + 1], argv[argv.index("--num_training_steps") + 1] = str(other), "6"
    with pytest.raises(SystemExit, match=r"written by another run: data_dir .*linked_c4 \(now .*copy_c4\)"):
        train.main(argv)


def test_block_size_is_honored_kept_by_resume_and_an_older_run_had_256(corpus, tmp_path):
    """--block_size 2048: the paper's 8-bit runs were made with bitsandbytes before 0.44, whose blocks were of 2048
    entries (256 since). One float32 scale per block in the saved state; a resume with another block size is refused,
    and a checkpoint from before the flag resumes as the 256 it had."""
    eight = ["--optimizer", "adam8bit", "--per_layer"]
    train.main(base_args(corpus, tmp_path / "a", 4, *eight, "--block_size", "2048", "--stop_after", "2"))
    state = final_state(tmp_path / "a")
    one = state["optimizer"]["optimizers"]["embed.weight"]["state"][0]  # 6144 entries: 8-bit
    assert state["args"]["block_size"] == 2048 and one["exp_avg_absmax"].numel() == -(-one["exp_avg_codes"].numel()
                                                                                      // 2048)
    with pytest.raises(SystemExit, match=r"written by another run: block_size 2048 \(now 256\)"):
        train.main(base_args(corpus, tmp_path / "a", 4, *eight, "--resume"))
    train.main(base_args(corpus, tmp_path / "a", 4, *eight, "--block_size", "2048", "--resume"))
    assert final_state(tmp_path / "a")["step"] == 4
    train.main(base_args(corpus, tmp_path / "b", 4, *eight, "--stop_after", "2"))
    old = final_state(tmp_path / "b")
    del old["args"]["block_size"], old["sha256"]
    checkpoint.save(tmp_path / "b" / "ckpt.pt", old)
    train.main(base_args(corpus, tmp_path / "b", 4, *eight, "--resume"))
    assert final_state(tmp_path / "b")["step"] == 4


def test_ffn_dim_builds_that_width_a_resume_keeps_it_and_an_older_run_had_its_sizes(corpus, tmp_path, capsys):
    """--ffn_dim: the MLPs' width (1b's 5461 is slow on a GPU: model.slow_width). It is in the checkpoint; a resume
    or --eval_only without it means the size's width, another model, and is refused; a checkpoint from before the
    flag resumes as its size's."""
    train.main(base_args(corpus, tmp_path / "a", 4, "--ffn_dim", "168", "--stop_after", "2"))
    state = final_state(tmp_path / "a")
    assert state["model_config"]["ffn_dim"] == 168 and state["args"]["ffn_dim"] == 168
    assert state["model"]["layers.0.mlp.up_proj.B"].shape[0] == 168 and "note: the MLP width" not in \
        capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"written by another run: ffn_dim 168 \(now 176\)"):
        train.main(base_args(corpus, tmp_path / "a", 4, "--resume"))
    with pytest.raises(SystemExit, match=r"holds another model: ffn_dim 168 \(now 176\); pass .*--ffn_dim"):
        train.main(eval_args(corpus, tmp_path / "a"))
    train.main(base_args(corpus, tmp_path / "a", 4, "--ffn_dim", "168", "--resume"))
    assert final_state(tmp_path / "a")["step"] == 4
    train.main(eval_args(corpus, tmp_path / "a", "--ffn_dim", "168"))
    train.main(base_args(corpus, tmp_path / "b", 4, "--stop_after", "2"))
    old = final_state(tmp_path / "b")
    del old["args"]["ffn_dim"], old["sha256"]
    checkpoint.save(tmp_path / "b" / "ckpt.pt", old)
    train.main(base_args(corpus, tmp_path / "b", 4, "--resume"))
    assert final_state(tmp_path / "b")["step"] == 4


def test_a_width_a_gpu_runs_slowly_is_said_with_the_aligned_one(capsys):
    """1b's MLP width, 5461 (the paper's), is the one size's not a multiple of 8: on an H200 its bf16 step took 1.8x
    (SLTrain) to 2.4x (full rank) as long as at 5464 (BENCHMARKS.md). train.py says so on a GPU, naming --ffn_dim
    5464, and --help says so; every other width is quiet. Both once gave full rank's 2.4x to an SLTrain run too."""
    assert "--ffn_dim 5464 " in slow_width(config_for("1b")) and slow_width(config_for("1b", ffn_dim=5464)) is None
    with pytest.raises(SystemExit):
        train.get_args(["--help"])
    ffn_dim = " ".join(capsys.readouterr().out.split("--ffn_dim FFN_DIM", 2)[2].split("\n  --", 1)[0].split())
    for said in (slow_width(config_for("1b", method="sltrain")), ffn_dim):
        assert "1.8x (SLTrain) to 2.4x (full rank)" in said, said
    assert [size for size in SIZES if slow_width(config_for(size))] == ["1b"]
    assert "--ffn_dim 176 " in slow_width(config_for("tiny", ffn_dim=170))


def test_adam8bit_kernel_is_honored_and_may_change_on_resume(corpus, tmp_path, monkeypatch, capsys):
    """--adam8bit_kernel: auto takes the one-kernel step wherever it can run, on too, off never; GaLore's 8-bit
    moments alike. Faked here as runnable on this CPU, with the kernel's launch recording each tensor and making
    the eager update (the kernel itself is tested in test_adam8bit_kernel.py). A resume may switch it, and says so;
    a checkpoint from before the flag resumes as auto without a word."""
    import adam8bit_kernel
    import optim
    launched = []
    monkeypatch.setattr(adam8bit_kernel, "why_not", lambda device, dtype, block_size: None)
    monkeypatch.setattr(adam8bit_kernel, "adam8bit_", lambda *a: launched.append(a[0].numel()) or optim._adam8bit_(*a))
    runs = {}
    for name, extra in {"auto": [], "on": ["--adam8bit_kernel", "on"], "off": ["--adam8bit_kernel", "off"],
                        "galore auto": ["--optimizer", "galore_adam8bit", "--method", "full"],
                        "galore off": ["--optimizer", "galore_adam8bit", "--method", "full", "--adam8bit_kernel", "off"]
                        }.items():
        before = len(launched)
        train.main(base_args(corpus, tmp_path / name, 2, "--optimizer", "adam8bit", "--per_layer", *extra))
        runs[name] = (len(launched) - before, final_state(tmp_path / name))
        said = capsys.readouterr().out  # the run's first lines say which step it takes
        assert (" | 8-bit step: eager (no kernel: --adam8bit_kernel off) | " if name.endswith("off") else
                " | 8-bit step: one kernel per run of tensors | ") in said, said[:2000]
    assert runs["auto"][0] > 0 and runs["on"][0] == runs["auto"][0] and runs["galore auto"][0] > 0
    assert runs["off"][0] == 0 and runs["galore off"][0] == 0
    assert runs["auto"][1]["args"]["adam8bit_kernel"] == "auto" and runs["off"][1]["args"]["adam8bit_kernel"] == "off"
    for name in ("on", "off"):  # the same arithmetic either way
        for key, value in runs["auto"][1]["model"].items():
            assert torch.equal(value, runs[name][1]["model"][key]), key
    capsys.readouterr()
    train.main(base_args(corpus, tmp_path / "off", 3, "--optimizer", "adam8bit", "--per_layer", "--resume"))
    resumed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming from"))
    assert resumed.endswith("changed and honored: num_training_steps 2 -> 3, eval_every 2 -> 3, adam8bit_kernel off "
                            "-> auto")
    old = final_state(tmp_path / "auto")
    del old["args"]["adam8bit_kernel"], old["sha256"]
    checkpoint.save(tmp_path / "auto" / "ckpt.pt", old)
    train.main(base_args(corpus, tmp_path / "auto", 3, "--optimizer", "adam8bit", "--per_layer", "--resume"))
    resumed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming from"))
    assert resumed.endswith("changed and honored: num_training_steps 2 -> 3, eval_every 2 -> 3")


def test_resume_from_another_run_is_refused(corpus, tmp_path, monkeypatch):
    """Seen at a quick look at the checkpoint's args (checkpoint.peek), before its whole read (minutes at 7b)."""
    train.main(base_args(corpus, tmp_path, 2))
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("read whole before the refusal"))
        with pytest.raises(SystemExit, match="written by another run"):
            train.main(base_args(corpus, tmp_path, 4, "--resume", "--method", "lowrank"))
        with pytest.raises(SystemExit, match=r"total_batch_size 8 \(now 16\)"):
            train.main(base_args(corpus, tmp_path, 4, "--resume", "--total_batch_size", "16"))
    with pytest.raises(SystemExit, match="already has 2 updates; raise --num_training_steps"):
        train.main(base_args(corpus, tmp_path, 2, "--resume"))
    with pytest.raises(SystemExit, match="no checkpoint at"):
        train.main(base_args(corpus, tmp_path / "empty", 4, "--resume"))


@pytest.mark.parametrize("quick_look", [True, False])
def test_every_resume_refusal_comes_before_the_whole_read(corpus, tmp_path, monkeypatch, quick_look):
    """A finished run, a warmup changed past its end, a decay that bf16 rounds away and a batch that cannot fit are
    each decided on the run's args and step at checkpoint.peek's look: refused before the read of minutes at 7b.
    Where no look can be had (peek gives None), the same refusals come after the read."""
    train.main(base_args(corpus, tmp_path, 4, "--dtype", "bfloat16", "--warmup_steps", "1", "--stop_after", "2"))
    reads = []
    load = checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: (reads.append(a), load(*a, **k))[1])
    if not quick_look:
        monkeypatch.setattr(checkpoint, "peek", lambda path: None)
    def too_big(p, args, *rest, **kw):
        raise SystemExit("too big")
    for steps, extra, refusal in ((2, (), "already has 2 updates"), (4, ("--warmup_steps", "3"), "past the end of"),
                                  (4, ("--weight_decay", "0.1"), "holds bf16 parameters"),
                                  (4, ("--batch_size", "8"), "too big")):
        with monkeypatch.context() as m:
            if refusal == "too big":
                m.setattr(flags, "check_memory", too_big)
            with pytest.raises(SystemExit, match=refusal):
                train.main(base_args(corpus, tmp_path, steps, "--resume", *extra))
        assert len(reads) == (0 if quick_look else 1), (extra, reads)
        reads.clear()
    train.main(base_args(corpus, tmp_path, 4, "--resume"))  # and a resume that is taken reads it once, whole
    assert len(reads) == 1 and final_state(tmp_path)["step"] == 4


def test_a_checkpoint_saved_over_between_its_look_and_its_read_is_refused(corpus, tmp_path, monkeypatch):
    """--resume PATH of a run still training in its own --out_dir: its job may save between the quick look, where the
    data position is taken, and the whole read (minutes at 7b). The run went on silently with the weights and step of
    one update and the data position of another, its documents out of order. An evaluation, which takes from the
    look the run's settings alone, evaluates the new one."""
    train.main(base_args(corpus, tmp_path / "run", 8, "--stop_after", "2"))
    train.main(base_args(corpus, tmp_path / "later", 8, "--stop_after", "4"))
    two, path, peek, saved = tmp_path / "two.pt", tmp_path / "run" / "ckpt.pt", checkpoint.peek, []
    shutil.copy(path, two)

    def look_then_saved(at):  # the other job's atomic save, right after this run's look
        look = peek(at)
        if not saved and os.path.abspath(at) == str(path):
            shutil.copy(tmp_path / "later" / "ckpt.pt", tmp_path / "new.pt")
            saved.append(os.replace(tmp_path / "new.pt", path))
        return look
    monkeypatch.setattr(checkpoint, "peek", look_then_saved)
    with pytest.raises(SystemExit, match=rf"--resume {path} was saved over while it was read \(step 4, where its "
                                         r"first look had step 2\): run the same command again"):
        train.main(base_args(corpus, tmp_path / "fork", 8, "--resume", str(path)))
    assert saved and not (tmp_path / "fork" / "ckpt.pt").exists()
    shutil.copy(two, path)
    saved.clear()
    train.main(eval_args(corpus, tmp_path / "run"))
    assert saved


def test_a_resume_over_other_training_shards_is_refused_before_the_whole_read(corpus, tmp_path, monkeypatch):
    """The data position's check (the shards the checkpoint names, and their sizes) needs only the checkpoint's look
    and the folder's listing: refused before the checkpoint is read whole (minutes at 7b) and the validation set."""
    folder = tmp_path / "c4"
    shutil.copytree(corpus[0], folder)
    train.main(base_args((str(folder), corpus[1]), tmp_path / "run", 4, "--stop_after", "2"))
    (folder / "c4-train.00001-of-00002.json.gz").unlink()
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("read whole before the refusal"))
    monkeypatch.setattr(train, "validation_batches", lambda *a, **k: pytest.fail("validation read before it"))
    with pytest.raises(SystemExit, match="training shards are not the checkpoint's: 1 gone"):
        train.main(base_args((str(folder), corpus[1]), tmp_path / "run", 4, "--resume"))


def test_a_run_resumed_into_another_out_dir_and_stopped_names_its_own_checkpoint(corpus, tmp_path, capsys):
    """Resumed from a's checkpoint into b and stopped there, the run said "rerun with --resume": its own command
    again (--resume a/ckpt.pt) is refused, since b now holds a checkpoint of its own. The stop names b's, and the
    refusal of the command run again names it too; that one continues the run."""
    a, b = tmp_path / "a", tmp_path / "b"
    train.main(base_args(corpus, a, 6, "--stop_after", "2"))
    capsys.readouterr()
    train.main(base_args(corpus, b, 6, "--resume", str(a / "ckpt.pt"), "--stop_after", "2"))
    assert f"saved {b}/ckpt.pt at step 4; rerun with --resume {b}/ckpt.pt" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"continue that one with --resume {b}/ckpt.pt"):
        train.main(base_args(corpus, b, 6, "--resume", str(a / "ckpt.pt")))
    train.main(base_args(corpus, b, 6, "--resume", str(b / "ckpt.pt")))
    assert final_state(b)["step"] == 6 and [r["step"] for r in metrics(b)[0]] == list(range(1, 7))
    train.main(base_args(corpus, a, 6, "--resume", "--stop_after", "2"))  # its own: the plain advice
    assert f"saved {a}/ckpt.pt at step 4; rerun with --resume\n" in capsys.readouterr().out


def test_resume_into_another_out_dir_brings_its_metrics_and_never_overwrites_silently(corpus, tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train.main(base_args(corpus, a, 6, "--stop_after", "2"))
    train.main(base_args(corpus, b, 3))
    with pytest.raises(SystemExit, match=f"--resume {a}/ckpt.pt would train on into --out_dir {b}, which holds "
                                         f"another checkpoint: continue that one with --resume {b}/ckpt.pt "
                                         r"\(a run resumed into it and stopped\?\), pass a new --out_dir, or "
                                         "--overwrite to replace it"):
        train.main(base_args(corpus, b, 6, "--resume", str(a / "ckpt.pt")))
    assert final_state(b)["step"] == 3 and len(metrics(b)[0]) == 3, "the refused run changed nothing"
    with pytest.raises(SystemExit, match=f"--resume: no checkpoint at {a}/typo.pt"):
        train.main(base_args(corpus, b, 6, "--resume", str(a / "typo.pt")))
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, a, 6, "--resume", "--overwrite"))
    assert "--resume continues the checkpoint in --out_dir and --overwrite replaces it" in capsys.readouterr().err
    train.main(base_args(corpus, b, 6, "--resume", str(a / "ckpt.pt"), "--overwrite"))
    train.main(base_args(corpus, c, 6, "--resume", str(a)))  # a folder: its ckpt.pt, continued into a new out_dir
    first = metrics(a)[0]
    for out in (b, c):  # the resumed run's rows up to its checkpoint, then this run's: none of b's own old rows
        rows = metrics(out)[0]
        assert [r["step"] for r in rows] == list(range(1, 7)) and rows[:2] == first, out
    same = [[(r["step"], r["loss"], r["lr"]) for r in metrics(out)[0]] for out in (b, c)]
    assert same[0] == same[1] and final_state(b)["step"] == final_state(c)["step"] == 6
    # a folder holding another run's rows and no checkpoint (it stopped before its first save): refused, as a fresh
    # run there is; rows of this same resume, killed there before its first save, are its own to write again
    d, e = tmp_path / "d", tmp_path / "e"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    with pytest.raises(SystemExit, match=f"^--resume {a}/ckpt.pt would train on into --out_dir {d}, and {d}/metrics"
                                         r".jsonl holds the rows of a run that saved no checkpoint .* --overwrite"):
        train.main(base_args(corpus, d, 6, "--resume", str(a)))
    assert (d / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    train.main(base_args(corpus, e, 6, "--resume", str(a)))
    (e / "ckpt.pt").unlink()  # as if killed before its first save
    train.main(base_args(corpus, e, 6, "--resume", str(a)))
    assert [(r["step"], r["loss"]) for r in metrics(e)[0]] == [(r["step"], r["loss"]) for r in metrics(c)[0]]


def test_weights_only_checkpoint_is_evaluated_but_not_resumed(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 2))
    state = final_state(tmp_path)
    for key in ("optimizer", "scheduler", "world", "data", "rng", "sha256"):  # what export.py --merged leaves out
        state.pop(key)
    checkpoint.save(tmp_path / "weights.pt", state)
    with pytest.raises(SystemExit, match="holds weights only .*evaluate it with --eval_only, or start a new"):
        train.main(base_args(corpus, tmp_path / "new", 4, "--resume", str(tmp_path / "weights.pt")))
    capsys.readouterr()
    without_out_dir = [a for a in eval_args(corpus, tmp_path) if a not in ("--out_dir", str(tmp_path))]
    train.main([*without_out_dir, "--resume", str(tmp_path / "weights.pt")])
    assert f"{metrics(tmp_path)[1][-1]['val_loss']:.4f}" in capsys.readouterr().out


def plain_run(model, optimizer, scheduler=None):
    """A train.Run of one process on CPU around a model and its optimizer (no DDP, no per-layer updates)."""
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    return train.Run(model, model, optimizer, scheduler, None, model.config, torch.device("cpu"), rank=0, world=1)


def one_batch(vocab=96, accum=1):
    return [(torch.randint(vocab, (2, 16)), torch.randint(vocab, (2, 16)), 32) for _ in range(accum)]


def test_the_first_update_steps_at_the_schedules_first_lr():
    """optimizer.step() before scheduler.step(): update 1 uses lr_lambda(0), which the warmup makes 0 (as the
    authors' schedule), so the weights do not move; update 2 uses lr_lambda(1). Without a warmup update 1 is at
    the peak."""
    args = train.get_args(["--size", "tiny", "--num_training_steps", "10", "--warmup_steps", "2"])
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", vocab_size=96))
    optimizer = train.AdamW(model.parameters(), lr=1e-3)
    run = plain_run(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, train.lr_lambda_for(args)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train.train_step(args, run, one_batch())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "update 1 moved at lr 0"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)  # update 2's: lr_lambda(1) = 1/2
    args.warmup_steps = 0
    assert train.lr_lambda_for(args)(0) == 1.0, "no warmup: the first update is at the peak lr"


def test_grad_clipping_bounds_the_norm_the_optimizer_steps_with():
    """--grad_clipping: the optimizer's step sees the global gradient norm clipped to the flag (Adam's scale
    invariance hides clipping from the loss, so the gradients at the step are read); the norm logged is the one
    before clipping; 0 clips nothing."""
    seen = []

    class Recording(train.AdamW):
        def step(self, closure=None):
            seen.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.param_groups[0]["params"]])))
            return super().step(closure)
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", vocab_size=96))
    run, batch = plain_run(model, Recording(model.parameters(), lr=1e-3)), one_batch()
    norm = train.train_step(SimpleNamespace(grad_clipping=0.0), run, batch)[1]
    assert seen[-1].item() == pytest.approx(norm.item(), rel=1e-6) and norm.item() > 0.05
    norm = train.train_step(SimpleNamespace(grad_clipping=0.05), run, batch)[1]
    assert seen[-1].item() == pytest.approx(0.05, rel=1e-4) and norm.item() > 0.05, (seen[-1], norm)


def test_a_bf16_runs_gradient_norm_is_its_float32_norm(corpus, tmp_path):
    """In bf16 (a GPU's default) the logged norm is the gradients' norm taken in float32, as with per-layer updates,
    where torch's clip_grad_norm_ gives a bf16 one (2.546875 for 2.549685 at update 1 here): the runs' rows agree."""
    rows = {}
    for extra in ([], ["--per_layer"]):
        out = tmp_path / ("per_layer" if extra else "global")
        train.main(base_args(corpus, out, 3, "--dtype", "bfloat16", *extra))
        rows[bool(extra)] = metrics(out)[0]
    assert [r["loss"] for r in rows[False]] == [r["loss"] for r in rows[True]]
    for a, b in zip(rows[False], rows[True]):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)


@pytest.mark.parametrize("per_layer", [False, True], ids=["adamw", "adam8bit-per-layer"])
def test_a_fresh_run_builds_its_optimizers_with_the_flags_hyperparameters(corpus, tmp_path, per_layer):
    """--lr, --beta1, --beta2 and --weight_decay reach the optimizer a run builds (each layer's, with per-layer
    updates), not only a resumed one's (set_hyperparameters)."""
    extra = ["--optimizer", "adam8bit", "--per_layer"] if per_layer else []
    args = train.get_args(base_args(corpus, tmp_path, 4, "--lr", "2e-3", "--beta1", "0.8", "--beta2", "0.95",
                                    "--weight_decay", "0.1", *extra))
    run = train.build(args, config_for("tiny", vocab_size=96), torch.device("cpu"), torch.float32, False, None)
    groups = [g for opt in run.optimizers for g in opt.param_groups]
    assert len(run.optimizers) > (1 if per_layer else 0) and groups
    assert {(g["betas"], g["weight_decay"], g.get("initial_lr", g["lr"])) for g in groups} == {((0.8, 0.95), 0.1,
                                                                                               2e-3)}


def test_bad_out_dir_validation_data_and_inherited_warmup_are_one_line(corpus, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path / "afile", 2))
    assert f"--out_dir {tmp_path}/afile is a file: pass a folder" in capsys.readouterr().err
    blank = tmp_path / "blank"
    blank.mkdir()
    for f in Path(corpus[0]).iterdir():  # the validation shard holds blank lines only
        (blank / f.name).write_bytes(gzip.compress(b"\n\n") if "validation" in f.name else f.read_bytes())
    with pytest.raises(SystemExit, match=f"^train.py --size tiny: the validation shards in {blank} hold no documents"):
        train.main(base_args((str(blank), corpus[1]), tmp_path / "out", 2))
    assert not (tmp_path / "out").exists()
    train.main(base_args(corpus, tmp_path / "w", 20, "--warmup_steps", "10", "--stop_after", "2"))
    with pytest.raises(SystemExit, match="the run's warmup of 10 updates is longer than --num_training_steps 6: "
                                         "pass --warmup_steps too"):
        train.main(base_args(corpus, tmp_path / "w", 6, "--resume"))
    train.main(base_args(corpus, tmp_path / "w", 6, "--resume", "--warmup_steps", "3"))
    assert final_state(tmp_path / "w")["step"] == 6


def test_a_short_validation_set_and_a_second_pass_over_the_data_are_said(corpus, tmp_path, capsys):
    """Two things a run once did without a word: evaluate on fewer tokens than --eval_tokens (the shards hold fewer:
    all of them are taken), and go round the training shards again (each document seen twice). Both are said, once,
    when they happen; a resume already in the second pass does not say it again."""
    folder, tokenizer = corpus
    val = data.validation_batches(folder, tokenizer, 4, 32, eval_tokens=3000)
    assert val.short and 0 < val.tokens < 3000
    # the corpus's 300 training documents, one padded row each: 9 updates of 32 rows, and the 10th goes round
    batch = ("--total_batch_size", "32", "--batch_size", "16")
    train.main(base_args(corpus, tmp_path, 12, *batch, "--stop_after", "11"))
    out = capsys.readouterr().out
    assert out.count(f"note: the validation shards in {folder} hold {val.tokens:,} tokens at --max_length 32, fewer "
                     f"than --eval_tokens 3,000: every evaluation covers those {val.tokens:,}; for more, fetch more "
                     "shards (python data.py download --validation_shards N)") == 1, out
    assert out.count("note: by update 10 the training data has reached pass 2 over the shards in") == 1, out
    assert "each document is seen again, in a new order" in out
    train.main(base_args(corpus, tmp_path, 12, *batch, "--resume", "--eval_tokens", "300"))
    out = capsys.readouterr().out
    assert "note:" not in out and not data.validation_batches(folder, tokenizer, 4, 32, eval_tokens=300).short, out


def test_missing_data_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match=r"does not exist; pass --data_dir, or fetch the shards \(python data.py "
                                         r"download, or train.py --download\)"):
        train.main(["--size", "tiny", "--data_dir", str(tmp_path / "nowhere"), "--out_dir", str(tmp_path)])


def test_a_resume_whose_data_folder_is_not_there_names_the_runs_own(corpus, tmp_path):
    """A resume without the run's --data_dir (data/c4, the default, where the run read another folder) is a
    difference from the run, named as the others are, not a new run's missing data: its fix, fetching shards into
    that folder, ended in the resume's refusal of another data folder, after the download."""
    train.main(base_args(corpus, tmp_path, 2))
    argv = base_args(corpus, tmp_path, 4, "--resume")
    argv[argv.index("--data_dir") + 1] = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit, match=rf"written by another run: data_dir {re.escape(corpus[0])} \(now "
                                         rf"{re.escape(str(tmp_path / 'nowhere'))}\)"):
        train.main(argv)


def test_authors_flag_names_are_accepted(corpus, tmp_path):
    args = train.get_args(["--model_config", "configs/llama_60m.json", "--peft_model", "sltrain",
                              "--sp_ratio", "0.05", "--lora_alpha", "16", "--optimizer", "adam8bit_per_layer",
                              "--save_dir", "ckpts", "--continue_from", "ckpts/ckpt.pt"])
    assert (args.size, args.method, args.delta, args.alpha) == ("60m", "sltrain", 0.05, 16.0)
    assert (args.optimizer, args.per_layer, args.out_dir, args.resume) == ("adam8bit", True, "ckpts", "ckpts/ckpt.pt")
    assert (args.num_training_steps, args.lr, args.rank) == (11_000, 3e-3, 128)
    assert args.warmup_steps is None, "a resumed run keeps the warmup in its checkpoint"



@pytest.mark.parametrize("typed,meant", [(["--packed"], "--pack"), (["--lora", "8"], "--rank"),
                                         (["--warmup", "10"], "--warmup_steps"), (["--out", "runs"], "--out_dir")])
def test_a_flag_is_taken_by_its_whole_name_only(capsys, typed, meant):
    """argparse took a unique prefix as the flag it begins: --packed (meant for --pack) was --packed_support, and
    --lora 8 (meant as a LoRA rank) was --lora_alpha 8, neither said. Only a whole name is taken; another is refused,
    with the usage line that lists the names."""
    with pytest.raises(SystemExit):
        flags.get_args(["--size", "tiny", "--device", "cpu", *typed])
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {' '.join(typed)}" in err, (meant, err)


@pytest.mark.parametrize("program, argv", [
    ("sample", ["x.pt", "--temp", "0.5"]), ("export", ["x.pt", "--merg", "y.pt"]),
    ("analyze", ["spectrum", "x.pt", "--thresh", "0.1"]), ("analyze", ["curves", "m.jsonl", "--lab", "a"]),
    ("data", ["stats", "--data", "shards"]), ("data", ["download", "--shard", "1"]),
    ("estimate_memory", ["--siz", "tiny"]), ("bench", ["--onl", "step"]), ("suite", ["tiny", "--onl", "layer"])])
def test_every_program_takes_a_flag_by_its_whole_name_only(monkeypatch, capsys, program, argv):
    """As train.py's: each program's parser took a unique prefix as the flag it begins (sample.py --temp 0.5 as
    --temperature, data.py download --shard 1 as --shards, suite.py --onl as --only), which STYLE.md's "no fuzzy
    name matching" rules out. Each refuses it, before any work."""
    module = __import__(program)
    monkeypatch.setattr(sys, "argv", [f"{program}.py", *argv])  # the programs that read their flags from it
    takes_argv = "argv" in inspect.signature(module.main).parameters
    with pytest.raises(SystemExit) as e:
        module.main(argv) if takes_argv else module.main()
    assert e.value.code == 2 and f"unrecognized arguments: {' '.join(argv[-2:])}" in capsys.readouterr().err


# the authors' configs/llama_7b.json (as in their repository and GaLore's), every key of it
AUTHORS_7B = {"architectures": ["LLaMAForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 11008, "initializer_range": 0.02, "max_sequence_length": 2048,
              "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "pad_token_id": -1,
              "rms_norm_eps": 1e-06, "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 32000}


def test_model_config_contents_are_read_where_the_file_is(corpus, tmp_path, capsys, monkeypatch):
    """--model_config once set --size from its name alone: a config of another width trained the size's model without
    a word. Where the file is, it is read: the authors' configs and export.py's config.json are the size's; its
    intermediate_size is --ffn_dim's (one that disagrees is refused); a shape other than the size's, a key of another
    architecture, a vocab_size other than the tokenizer's, or a file that is not a config, are refused before any
    work. A path not here is still taken by its name (the authors' command lines)."""
    configs = tmp_path / "configs"
    configs.mkdir()
    path = configs / "llama_7b.json"
    path.write_text(json.dumps(AUTHORS_7B, indent=4))
    assert flags.read_model_config(path, "7b") == dict(dim=4096, ffn_dim=11008, n_heads=32, n_layers=32,
                                                       norm_eps=1e-6, vocab_size=32000)
    tiny = dict(AUTHORS_7B, hidden_size=64, intermediate_size=176, num_attention_heads=4, num_hidden_layers=2,
                vocab_size=96)  # the corpus's tokenizer has 96 pieces
    path = configs / "llama_tiny.json"

    def run(config, out, *extra):
        path.write_text(json.dumps(config))
        train.main(base_args(corpus, tmp_path / out, 2, "--model_config", str(path), *extra))
        return final_state(tmp_path / out)
    assert run(tiny, "a")["model_config"]["ffn_dim"] == 176
    state = run(dict(tiny, intermediate_size=200), "b")
    assert state["model_config"]["ffn_dim"] == state["args"]["ffn_dim"] == 200
    assert state["model"]["layers.0.mlp.up_proj.B"].shape[0] == 200
    assert run(dict(tiny, intermediate_size=200), "c", "--ffn_dim", "200")["args"]["ffn_dim"] == 200
    model = LLaMA(config_for("tiny", vocab_size=96))
    path.write_text(json.dumps(export.hf_config(model.config, 32, "float32", 1)))  # an export's config.json
    assert train.get_args(base_args(corpus, tmp_path, 2, "--model_config", str(path))).ffn_dim == 176
    for config, message in [
            (dict(tiny, intermediate_size=200), "has intermediate_size 200, --ffn_dim says 168: drop one"),
            (dict(tiny, hidden_size=80), "hidden_size 80, where size tiny has 64: this repo builds the paper's sizes"),
            (dict(tiny, num_hidden_layers=3), "num_hidden_layers 3, where size tiny has 2"),
            (dict(tiny, rms_norm_eps=1e-5), "rms_norm_eps 1e-05, where size tiny has 1e-06"),
            (dict(tiny, num_key_value_heads=2), "num_key_value_heads 2: this repo's LLaMA has 4"),
            (dict(tiny, hidden_act="gelu"), "hidden_act 'gelu': this repo's LLaMA has 'silu'"),
            (dict(tiny, tie_word_embeddings=True), "tie_word_embeddings True: this repo's LLaMA has False"),
            (dict(tiny, sliding_window=4096, qk_norm=True), "sliding_window, qk_norm: not read by this repo's LLaMA; "
                                                           "remove them"),
            (dict(tiny, intermediate_size=0), "intermediate_size must be a positive integer, got 0"),
            ([1, 2], "holds a JSON list, not a config's object"),
            ("{not json", "cannot be read as JSON")]:
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        extra = ["--ffn_dim", "168"] if "--ffn_dim" in message else []
        with pytest.raises(SystemExit):
            train.get_args(base_args(corpus, tmp_path, 2, "--model_config", str(path), *extra))
        err = capsys.readouterr().err
        assert f"--model_config {path}" in err and message in err and "Traceback" not in err, err
    path.write_text(json.dumps(dict(tiny, vocab_size=32000)))
    with pytest.raises(SystemExit, match=r"has vocab_size 32000, and the tokenizer .* has 96 pieces: pass the "
                                         r"tokenizer the config was made for, or a config of its size"):
        train.main(base_args(corpus, tmp_path / "d", 2, "--model_config", str(path)))
    assert not (tmp_path / "d").exists() or not os.listdir(tmp_path / "d")
    monkeypatch.setattr(train, "download", lambda *a, **k: pytest.fail("downloaded before the config was checked"))
    with pytest.raises(SystemExit, match=r"has vocab_size 32000, and the tokenizer .* has 96 pieces"):
        train.main(base_args(corpus, tmp_path / "e", 2, "--model_config", str(path), "--download"))
    # no tokenizer there yet: --download fetches T5's, of 32000 pieces, which a config of 96 is refused against
    # before the download's minutes, not once the tokenizer is read after it
    path.write_text(json.dumps(tiny))
    with pytest.raises(SystemExit, match=r"has vocab_size 96, and T5's tokenizer, which --download fetches to "
                                         r".*spiece.model, has 32000 pieces: pass the tokenizer"):
        train.main(base_args(corpus, tmp_path / "f", 2, "--model_config", str(path), "--download", "--tokenizer",
                             str(tmp_path / "t5" / "spiece.model")))
    args = train.get_args(["--model_config", str(tmp_path / "elsewhere" / "llama_60m.json"), "--device", "cpu"])
    assert (args.size, args.ffn_dim) == ("60m", 1376)  # not here: by its name


@pytest.mark.parametrize("config,message", [
    (dict(AUTHORS_7B, intermediate_size=11264), "has intermediate_size 11264, --ffn_dim says 11008: drop one"),
    (dict(AUTHORS_7B, hidden_size=5120), "hidden_size 5120, where size 7b has 4096"),
    (dict(AUTHORS_7B, num_key_value_heads=8), "num_key_value_heads 8: this repo's LLaMA has 32"),
    (dict(AUTHORS_7B, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling {'type': 'linear', 'factor': "
                                                                       "2.0}: this repo's LLaMA has None"),
    (dict(AUTHORS_7B, sliding_window=4096), "sliding_window: not read by this repo's LLaMA; remove it"),
    ("{not json", "cannot be read as JSON"),
])
def test_a_model_config_this_repo_does_not_build_is_refused_in_one_line(tmp_path, capsys, config, message):
    path = tmp_path / "llama_7b.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    extra = ["--ffn_dim", "11008"] if "intermediate_size" in message else []
    with pytest.raises(SystemExit):
        train.get_args(["--model_config", str(path), "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert f"--model_config {path}" in err and message in err and "Traceback" not in err, err


def test_a_model_config_saved_by_a_newer_transformers_is_read(tmp_path):
    """transformers 4.56 renamed config.json's torch_dtype to dtype (the weights' storage dtype, nothing of the
    model's shape): a config it saved of the size's model was refused as one of another architecture."""
    path = tmp_path / "llama_7b.json"
    path.write_text(json.dumps(dict(AUTHORS_7B, dtype="bfloat16")))
    assert flags.read_model_config(path, "7b")["ffn_dim"] == 11008


def test_download_that_fails_is_one_line(monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise ConnectionError("the network is unreachable; copy the files by hand")
    monkeypatch.setattr(train, "download", offline)
    with pytest.raises(SystemExit, match="^--download: the network is unreachable"):
        train.main(["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir", str(tmp_path)])


def test_download_under_torchrun_names_the_one_process_command(monkeypatch, tmp_path):
    torchrun_variables(monkeypatch, rank=0, local_rank=0, world=2)
    with pytest.raises(SystemExit, match="python data.py download --out .* --train_shards 17 --validation_shards 2$"):
        train.main(["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir", str(tmp_path)])
    assert not (tmp_path / "c4").exists()


@pytest.mark.parametrize("extra,shards", [([], (17, 2)), (["--eval_tokens", "100000"], (17, 1)),
                                          (["--eval_tokens", "10**9"], (17, 8)),
                                          (["--num_training_steps", "10", "--eval_tokens", "16000001"], (1, 3)),
                                          (["--max_length", "64"], (17, 5)), (["--pack"], (9, 2)),
                                          (["--pack", "--max_length", "1024"], (35, 2))])
def test_download_fetches_the_shards_the_run_reads(monkeypatch, tmp_path, capsys, extra, shards):
    """Train shards enough that no document comes twice; validation shards enough for --eval_tokens: one holds about
    8.9M tokens at 256 a row, so the paper's 10M once came from a shard that holds fewer. A row of 64 holds fewer
    still (a shard about 2.9M: 2 gave a short set), and a packed window of 1025 tokens takes about 2 documents (17
    shards went round twice), one of 257 about half of one (17 were twice what it reads)."""
    fetched = []
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: fetched.append(shards) or 1 / 0)
    extra = [str(10 ** 9) if e == "10**9" else e for e in extra]
    with pytest.raises(ZeroDivisionError):  # stops the run once the download is asked for
        train.main(["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir", str(tmp_path),
                    *extra])
    assert fetched == [download.shard_names(*shards)]
    # each file where it goes: the shards into --data_dir, the tokenizer to --tokenizer (not into --data_dir)
    assert f"--download: {shards[0]} C4 train shard(s), {shards[1]} validation shard(s) into {tmp_path / 'c4'} and " \
           f"the T5 tokenizer to {data.DEFAULT_TOKENIZER}" in capsys.readouterr().out


def test_the_download_plan_says_a_tokenizer_already_there_is_kept(corpus, monkeypatch, tmp_path, capsys):
    """download() fetches no tokenizer over one at --tokenizer; the plan said "the T5 tokenizer to PATH" all the same,
    of a user's own tokenizer that stays as it is."""
    own = tmp_path / "own.model"
    shutil.copy(corpus[1], own)
    ours = own.read_bytes()
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train.main(["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir", str(tmp_path),
                    "--tokenizer", str(own)])
    assert f"{tmp_path / 'c4'}; the tokenizer at {own} is there and kept" in capsys.readouterr().out
    assert own.read_bytes() == ours


def test_a_resumed_download_fetches_the_checkpoints_own_shards(monkeypatch, tmp_path, capsys):
    """On a resume --download fetches the shards the checkpoint's data position names (3 of a short run, here), not
    as many as the size's default --num_training_steps would read (17 at 60m): those would be fetched for minutes and
    then refused as not the checkpoint's. A checkpoint that cannot be read falls back to the count (the resume then
    says what is wrong with it); one that is not there is refused before any fetch."""
    ckpt = tmp_path / "run" / "ckpt.pt"
    ckpt.parent.mkdir()
    names = download.shard_names(train=3, validation=0)
    checkpoint.save(str(ckpt), {"data": [{"shards": names, "rank": r} for r in range(2)], "step": 5})
    fetched = []
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: fetched.append(shards) or 1 / 0)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    for resume, want in ((ckpt, names), (tmp_path / "junk.pt", download.shard_names(train=17, validation=0))):
        with pytest.raises(ZeroDivisionError):  # stops the run once the download is asked for
            train.main(["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir",
                        str(tmp_path / "out"), "--resume", str(resume)])
        assert fetched.pop() == want + download.shard_names(train=0, validation=2)
        assert f"--download: {len(want)} C4 train shard(s) (the resumed run's), 2 validation" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="^--resume: no checkpoint at .*nothing.pt"):
        train.main(["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir",
                    str(tmp_path / "out"), "--resume", str(tmp_path / "nothing.pt")])
    assert not fetched


def a_60m_run(path, data, **run):
    """A checkpoint of a 60m run at update 5 as train.py records it (args, model config, data position; no tensors),
    with run's args; its data under data/ (data/c4, a tokenizer data/t5.model not there yet)."""
    argv = ["--size", "60m", "--data_dir", str(data / "c4"), "--tokenizer", str(data / "t5.model")]
    args = vars(train.get_args(argv)) | {"dtype": "float32"} | run
    checkpoint.save(str(path), {"args": args, "model_config": vars(config_for("60m")), "step": 5, "world": 1,
                                "optimizer": {}, "data": [{"shards": download.shard_names(3, 0), "rank": 0}]})
    return argv


@pytest.mark.parametrize("extra,message", [
    (["--resume", "--rank", "64"], "^--resume: .* rank 128 .now 64."), (["--resume", "--seed", "1"], "seed 42 .now 1."),
    (["--resume", "--num_training_steps", "5"], "already has 5 updates"),
    (["--resume", "--warmup_steps", "2", "--num_training_steps", "10"], "past the end of its warmup"),
    (["--eval_only", "--delta", "0.05"], "^--eval_only: .* holds another model: delta 0.03 .now 0.05.")])
def test_a_download_for_a_resume_it_refuses_is_refused_before_the_download(monkeypatch, tmp_path, extra, message):
    """A resume (or evaluation) that its checkpoint refuses, another model, a flag that must match, a run already done
    or a warmup past changing, is refused on the checkpoint's quick look before --download fetches for minutes."""
    ckpt = tmp_path / "out" / "ckpt.pt"
    ckpt.parent.mkdir()
    argv = a_60m_run(ckpt, tmp_path, warmup_steps=4)
    monkeypatch.setattr(train, "download", lambda *a, **k: pytest.fail("downloaded before the resume was checked"))
    with pytest.raises(SystemExit, match=message):
        train.main(argv + ["--download", "--out_dir", str(tmp_path / "out"), *extra])


def test_a_download_for_a_start_it_refuses_is_refused_before_the_download(corpus, monkeypatch, tmp_path, capsys):
    """--init_from a checkpoint that cannot start the run (not full-rank; another width; with no tokenizer there
    yet, another vocabulary than T5's, which --download fetches) was refused once the shards were fetched (minutes,
    17 at 60m): it is refused on the checkpoint's quick look first, having fetched nothing."""
    train.main(base_args(corpus, tmp_path / "sl", 1))
    train.main(base_args(corpus, tmp_path / "full", 1, "--method", "full"))
    monkeypatch.setattr(train, "download", lambda *a, **k: pytest.fail("downloaded before --init_from was checked"))
    folder, tokenizer = corpus
    for start, extra, message in ((tmp_path / "sl", [], "a sltrain checkpoint; pass a full-rank checkpoint"),
                                  (tmp_path / "full", ["--ffn_dim", "160"], "ffn_dim 176 differs from this model's "
                                                                            "160; pass --ffn_dim 176"),
                                  (tmp_path / "full", ["--tokenizer", str(tmp_path / "t5.model")], "vocab_size 96 "
                                   "differs from this model's 32000; pass the --tokenizer it was trained with")):
        argv = base_args(corpus, tmp_path / "out", 2, "--download", "--init_from", str(start), *extra)
        with pytest.raises(SystemExit, match=message):
            train.main(argv)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    capsys.readouterr()
    fetched = []  # a start that fits goes on to the download
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: fetched.append(shards) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train.main(base_args(corpus, tmp_path / "out", 2, "--download", "--init_from", str(tmp_path / "full")))
    assert fetched

@pytest.mark.parametrize("extra,validation", [([], 3), (["--eval_tokens", "100000"], 1)])
@pytest.mark.parametrize("mode", ["--resume", "--eval_only"])
def test_a_resumed_or_evaluated_download_fetches_the_validation_shards_of_the_runs_eval_tokens(
        monkeypatch, tmp_path, capsys, mode, extra, validation):
    """A resume (and --eval_only) takes the run's --eval_tokens where the command line gives none, so --download
    fetches the validation shards those need: 3 for a run of 20M tokens, not the 2 of the default 10M (the resume
    then found a shorter set than the run's, and refused it as changed). One given is the command line's."""
    ckpt = tmp_path / "out" / "ckpt.pt"
    ckpt.parent.mkdir()
    argv = a_60m_run(ckpt, tmp_path, eval_tokens=20_000_001)
    fetched = []
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: fetched.append(shards) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # stops the run once the download is asked for
        train.main(argv + ["--download", "--out_dir", str(tmp_path / "out"), mode, *extra])
    assert [name for name in fetched.pop() if "validation" in name] == download.shard_names(0, validation)


@pytest.mark.parametrize("extra,validation", [([], 6), (["--max_length", "256"], 3)])
def test_an_evaluated_download_fetches_the_validation_shards_of_the_runs_max_length(monkeypatch, tmp_path, extra,
                                                                                     validation):
    """--eval_only cuts the set at the run's --max_length where its command line gives none: a run of rows of 128
    (a shard holds about 5.3M tokens of them) needs 6 shards for 20M tokens, where 3 hold them at 256."""
    ckpt = tmp_path / "out" / "ckpt.pt"
    ckpt.parent.mkdir()
    argv = a_60m_run(ckpt, tmp_path, eval_tokens=20_000_001, max_length=128)
    fetched = []
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: fetched.append(shards) or 1 / 0)
    with pytest.raises(ZeroDivisionError):  # stops the run once the download is asked for
        train.main(argv + ["--download", "--out_dir", str(tmp_path / "out"), "--eval_only", *extra])
    assert fetched.pop() == download.shard_names(0, validation)


def test_a_download_for_an_out_dir_the_run_cannot_write_is_refused_before_it(monkeypatch, tmp_path, capsys):
    """--download fetches minutes of shards (17 at 60m): a run refused for its --out_dir alone (a checkpoint there
    without --resume or --overwrite, another run writing there) is refused first, having fetched nothing."""
    fetched = []
    monkeypatch.setattr(train, "download", lambda data_dir, tokenizer, shards: fetched.append(shards) or 1 / 0)
    argv = ["--size", "60m", "--download", "--data_dir", str(tmp_path / "c4"), "--out_dir", str(tmp_path / "out")]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"a run's")
    with pytest.raises(SystemExit, match="ckpt.pt exists: continue that run with --resume"):
        train.main(argv)
    (tmp_path / "out" / "ckpt.pt").unlink()
    with checkpoint.folder_lock(str(tmp_path / "out")):  # another run writing there
        with pytest.raises(SystemExit, match="another process .* is writing into"):
            train.main(argv)
    assert not fetched


@pytest.mark.parametrize("extra", [[], ["--packed_support"]], ids=["flat", "packed"])
def test_every_rank_trains_rank_0s_supports(corpus, tmp_path, extra):
    """Each rank draws its own supports, which DDP does not broadcast (buffers): alike from one seed on one kind of
    device, but on GPUs of two kinds the random kernels give other draws. Here each rank draws from its own seed, as
    such a GPU would: all train rank 0's."""
    script = tmp_path / "own_draws.py"
    script.write_text(f"import os, sys, torch\nsys.path.insert(0, {str(HERE)!r})\nimport train, sllinear\n"
                      "build = train.build\n"
                      "def own_draws(args, *rest):\n"
                      "    torch.manual_seed(int(os.environ['RANK']))\n"
                      "    draw = sllinear.uniform_support\n"
                      "    sllinear.uniform_support = lambda n, nnz, **k: draw(n, nnz, generator=torch.Generator()"
                      ".manual_seed(int(os.environ['RANK']) + n))\n"
                      "    run = build(args, *rest)\n"
                      "    sllinear.uniform_support = draw\n"
                      "    torch.save({k: v for k, v in run.raw_model.state_dict().items() if k.endswith('indices')}, "
                      f"{str(tmp_path)!r} + '/rank' + os.environ['RANK'] + '.pt')\n"
                      "    return run\n"
                      "train.build = own_draws\ntrain.main(sys.argv[1:])\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *base_args(corpus, tmp_path / "out", 2, "--workers", "1", "--batch_size", "2", *extra)]
    proc = subprocess.run(cmd, cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] and all(torch.equal(t, ranks[1][k]) for k, t in ranks[0].items())
    assert all((t.dtype == torch.uint8) == bool(extra) for t in ranks[0].values())
    saved = final_state(tmp_path / "out")["model"]
    assert all(torch.equal(t, saved[k]) for k, t in ranks[0].items())


def test_fresh_run_into_a_checkpoint_folder_is_refused(corpus, tmp_path):
    train.main(base_args(corpus, tmp_path, 2))
    with pytest.raises(SystemExit, match="exists: continue that run with --resume, or pass a new --out_dir, or "
                                         "--overwrite"):
        train.main(base_args(corpus, tmp_path, 3))
    assert final_state(tmp_path)["step"] == 2
    train.main(base_args(corpus, tmp_path, 3, "--overwrite"))
    assert [r["step"] for r in metrics(tmp_path)[0]] == [1, 2, 3]


def test_fresh_run_into_the_rows_of_a_run_without_a_checkpoint_is_refused(corpus, tmp_path):
    """A run that stopped before its first checkpoint leaves only its rows; a fresh run there once emptied them
    without a word. Refused, the rows kept; --overwrite replaces them (every message that says to start again names
    it), and an empty file is no run's rows."""
    rows = tmp_path / "metrics.jsonl"
    rows.write_text(json.dumps({"step": 1, "loss": 10.5}) + "\n")
    with pytest.raises(SystemExit, match="metrics.jsonl holds the rows of a run that saved no checkpoint .*pass a new "
                                         "--out_dir, or --overwrite to replace them"):
        train.main(base_args(corpus, tmp_path, 2))
    assert rows.read_text() == json.dumps({"step": 1, "loss": 10.5}) + "\n"
    train.main(base_args(corpus, tmp_path, 2, "--overwrite"))
    assert [r["step"] for r in metrics(tmp_path)[0]] == [1, 2]
    (tmp_path / "ckpt.pt").unlink()
    rows.write_text("")
    train.main(base_args(corpus, tmp_path, 2))


def test_workers_are_bounded_by_the_cpus_this_process_may_use(monkeypatch, capsys):
    """flags counted the machine's CPUs (os.cpu_count) where data.py counts those the process may run on (a
    container's or a scheduler's share): on one CPU of two, --workers 2 was taken, and crowded it."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(SystemExit):
        train.get_args(["--size", "tiny", "--device", "cpu", "--workers", "2"])
    assert "--workers must be at most 1, the CPUs this process may use, got 2" in capsys.readouterr().err
    assert train.get_args(["--size", "tiny", "--device", "cpu", "--workers", "1"]).workers == 1


@pytest.mark.parametrize("extra,message", [
    (["--lr", "0"], "--lr must be positive"),
    (["--num_training_steps", "0"], "--num_training_steps must be positive"),
    (["--min_lr_ratio", "-1"], "--min_lr_ratio must be in [0, 1]"),
    (["--alpha", "0"], "--alpha must be positive"),
    (["--alpha", "-5"], "--alpha must be positive"),
    (["--workers", "-1"], "--workers must be >= 0"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--beta1", "1.5"], "--beta1 must be in [0, 0.999999] (closer to 1, a moment averages over more than a million "
                         "updates, longer than any run), got 1.5"),
    (["--beta2", "0.9999999"], "--beta2 must be in [0, 0.999999]"),
    (["--rank", "0", "--alpha", "5"], "--alpha scales the low-rank factors, which --rank 0 removes (S alone): pass a "
                                      "--rank above 0, or drop --alpha"),
    (["--weight_decay", "-1"], "--weight_decay must be >= 0"),
    (["--max_length", "1"], "--max_length must be at least 2 (an input token and its target), got 1"),
    (["--max_length", str(2 ** 24 + 1)], "--max_length must be at most 2^24 = 16,777,216"),
    (["--max_length", str(10 ** 20)], f"--max_length must be at most 2^24 = 16,777,216, the positions a model tells "
                                      f"apart (its rotary positions are float32, exact to 2^24), got {10 ** 20}"),
    (["--eval_tokens", str(10 ** 23)], f"--eval_tokens must be positive and at most 2^63 - 1, got {10 ** 23}"),
    (["--total_batch_size", str(10 ** 20), "--batch_size", "4"],
     f"--total_batch_size must be positive and at most 2^63 - 1, got {10 ** 20}"),
    (["--warmup_steps", str(2 ** 63)], f"--warmup_steps must be >= 0 and at most 2^63 - 1, got {2 ** 63}"),
    (["--eval_tokens", "0"], "--eval_tokens must be positive"),
    (["--ffn_dim", "0"], "--ffn_dim must be positive"),
    (["--lr", "inf"], "--lr must be positive and at most 3.4e+38, got inf"),
    (["--lr", "1e300"], "--lr must be positive and at most 3.4e+38, got 1e+300"),  # inf in float32
    (["--alpha", "nan"], "--alpha must be positive and at most 3.4e+38, got nan"),
    (["--weight_decay", "inf"], "--weight_decay must be >= 0 and at most 3.4e+38, got inf"),
    (["--grad_clipping", "nan"], "--grad_clipping must be >= 0 and at most 3.4e+38, got nan"),
    (["--method", "full", "--optimizer", "galore_adamw", "--galore_scale", "-1"],
     "--galore_scale must be positive and at most 3.4e+38, got -1.0"),
    (["--seed", str(2 ** 64)], f"--seed must be in [0, 2^63), got {2 ** 64}"),
    (["--support_seed", "-1"], "--support_seed must be in [0, 2^63), got -1"),
    (["--support", "top", "--support_seed", "3", "--resume"], "--support top picks the residual's largest entries, "
                                                              "and --support_seed draws random ones: drop one"),
    (["--workers", str(data._cpus() + 1)], f"--workers must be at most {data._cpus()}, the CPUs this process may "
                                           "use"),
    *[([f"--{name}", value], f"--{name} is empty (an unset variable?): pass a path, or drop --{name}")
      for name, value in (("resume", ""), ("init_from", ""), ("model_config", ""), ("out_dir", ""),
                          ("data_dir", " "), ("tokenizer", ""))],
    (["--device", "cuda"], "no usable CUDA GPU; pass --device cpu"),
    (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
    (["--amp", "--dtype", "bfloat16"], "--amp keeps float32 parameters"),
    (["--dtype", "bfloat16", "--weight_decay", "0.1"], "--weight_decay 0.1 with bf16 parameters: its decay per update, "
     "lr x weight_decay = 0.0003 at most, is under 2^-9, half a bf16 step of any weight, so it rounds away and would "
     "do nothing; pass --amp in place of --dtype bfloat16 (float32 parameters, bf16 compute) to decay, or "
     "--weight_decay 0"),
    (["--method", "lowrank", "--delta", "0.5"], "--delta: not read by --method lowrank with --optimizer adamw; "
                                                "drop it, or pass --method sltrain"),
    (["--method", "full", "--rank", "7", "--alpha", "99"], "--rank, --alpha: not read by --method full"),
    (["--relora_reset", "5", "--relora_prune", "0.5"],
     "--relora_reset, --relora_prune: not read by --method sltrain with --optimizer adamw; drop them, or pass --method "
     "relora"),
    *[(["--method", "relora", "--relora_reset", "50", "--relora_warmup", warmup], f"--relora_warmup {warmup} must be "
       "shorter than --relora_reset 50: each restart's warmup ends before the next restart")
      for warmup in ("50", "60")],
    *[(["--method", method, "--rank", "0"], "methods lowrank and relora train rank-r factors, so they need a rank of "
       "at least 1, got 0") for method in ("lowrank", "relora")],
    (["--galore_rank", "4"], "--galore_rank: not read by --method sltrain with --optimizer adamw; drop it, or pass a "
                             "galore_* --optimizer"),
    (["--method", "full", "--galore_scale", "9"], "--galore_scale: not read by --method full"),
    (["--method", "lowrank", "--packed_support"], "--packed_support stores the sparse supports: it needs --method "
                                                  "sltrain or sltrain_ft, not lowrank"),
    *[(["--delta", "0", *flag], f"{flag[0]} is of the sparse supports, which --delta 0 removes: pass a --delta above "
       f"0, or drop {flag[0]}")
      for flag in (["--packed_support"], ["--support_seed", "3"], ["--support", "top", "--resume"])],
    (["--method", "full", "--optimizer", "galore_adamw", "--rank", "8", "--galore_rank", "4"],
     "--rank 8 and --galore_rank 4: both set GaLore's projection rank; drop one"),
    (["--method", "full", "--optimizer", "galore_adamw", "--rank", "1000"], "--rank (GaLore's rank) must be in [1, "),
    (["--method", "relora", "--relora_reset", "5000", "--relora_prune", "0.5"], "--relora_reset, --relora_prune: "
     "--relora_reset 5000 restarts nothing in a run of 4 updates; pass a --relora_reset below --num_training_steps"),
    (["--method", "relora", "--relora_reset", "4", "--relora_warmup", "0", "--warmup_steps", "1"],  # the last: none
     "--relora_reset 4 restarts nothing in a run of 4 updates; pass a --relora_reset below --num_training_steps"),
])
def test_every_flag_is_checked_before_any_work(corpus, tmp_path, capsys, extra, message):
    if extra[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path, 4, *extra))
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("method,optimizer,records", [
    ("sltrain", "adamw", set()), ("relora", "adamw", {"relora_reset", "relora_warmup", "relora_prune"}),
    ("full", "galore_adamw", {"galore_rank", "galore_update_gap", "galore_scale"})])
def test_a_run_records_the_baselines_settings_only_where_it_is_one(corpus, tmp_path, method, optimizer, records):
    """A plain sltrain run stored GaLore's gap and ReLoRA's resets among its args (its checkpoint's, its printed
    config): settings of a run it is not. Each baseline's are recorded by its own runs, as None by the others."""
    args = train.get_args(base_args(corpus, tmp_path, 4, "--method", method, "--optimizer", optimizer))
    baselines = {"galore_rank", *flags.BASELINES}
    assert {name for name in baselines if getattr(args, name) is not None} == records


def test_paths_that_would_mix_a_run_with_its_data_or_its_start_are_refused(corpus, tmp_path, capsys):
    """--out_dir on --data_dir: the run's metrics.jsonl is a *.jsonl shard to the next read (the resume's: a bad
    shard line whose fix was to delete the rows). --eval_only --resume PATH with an --out_dir it never reads."""
    for extra, said in ((["--out_dir", corpus[0]], f"--out_dir {corpus[0]} is --data_dir too"),
                        (["--eval_only", "--resume", str(tmp_path / "a.pt")], "--eval_only evaluates --resume's "
                         f"checkpoint ({tmp_path}/a.pt) and writes nothing: drop --out_dir")):
        with pytest.raises(SystemExit):
            train.get_args([*eval_args(corpus, tmp_path)[:-1], *extra] if "--eval_only" in extra else
                           base_args(corpus, tmp_path, 4, *extra))
        assert said in capsys.readouterr().err
    assert not any(Path(corpus[0]).glob("*.jsonl"))


def test_eval_only_reads_no_train_shard(corpus, tmp_path, capsys):
    """An evaluation needs the validation shards alone: a folder without train shards was refused, and --download
    planned train shards for it (or a TypeError, its update size being none)."""
    train.main(base_args(corpus, tmp_path, 2))
    val_only = tmp_path / "val"
    val_only.mkdir()
    for shard in Path(corpus[0]).glob("*validation*"):
        (val_only / shard.name).write_bytes(shard.read_bytes())
    capsys.readouterr()
    train.main([*eval_args(corpus, tmp_path), "--data_dir", str(val_only)])
    assert f"{tmp_path}/ckpt.pt at step 2 | val loss" in capsys.readouterr().out
    args = train.get_args([*eval_args(corpus, tmp_path), "--download"])
    assert train.download_shards(args) == ([], 1)


def test_an_empty_resume_path_never_starts_afresh_over_the_run(corpus, tmp_path):
    """--resume "$CKPT" with the variable unset: once taken as no --resume, a fresh run, and with --overwrite one that
    removed the checkpoint it was meant to continue. Refused before any work; the run's checkpoint and rows stay."""
    train.main(base_args(corpus, tmp_path, 4, "--stop_after", "2"))
    before = (tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "metrics.jsonl").read_bytes()
    for extra in (["--resume", ""], ["--resume", "", "--overwrite"]):
        with pytest.raises(SystemExit):
            train.main(base_args(corpus, tmp_path, 4, *extra))
        assert ((tmp_path / "ckpt.pt").read_bytes(), (tmp_path / "metrics.jsonl").read_bytes()) == before, extra


def test_a_decay_bf16_parameters_take_is_honored_and_one_they_cannot_is_refused(corpus):
    """w·(1 - lr·wd) in bf16 is w again for every bf16 w when lr·wd < 2⁻⁹ (the refusal's bound), and not for all
    at 2⁻⁸; a decay at or above the bound, or with float32 parameters (--amp, float32), is run."""
    w = torch.cat([torch.randn(100_000) * 10.0 ** e for e in range(-6, 3)]).bfloat16()
    assert torch.equal(w * (1 - 2 ** -9 * 0.999), w) and not torch.equal(w * (1 - 2 ** -8), w)
    folder, tokenizer = corpus
    run = ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--device", "cpu"]
    for extra in (["--dtype", "bfloat16", "--lr", "3e-3", "--weight_decay", "1.0"], ["--amp", "--weight_decay", "0.1"],
                  ["--weight_decay", "0.1"], ["--dtype", "bfloat16", "--weight_decay", "0"]):
        assert train.get_args(run + extra).weight_decay == float(extra[-1]), extra


def test_a_decay_refused_for_a_given_bf16_dtype_names_a_fix_that_is_taken(corpus, capsys):
    """--dtype bfloat16 with a decay that rounds away: the refusal said "pass --amp", and --amp beside --dtype
    bfloat16 is refused ("drop --dtype bfloat16"). It names --amp in place of --dtype bfloat16, which is taken."""
    folder, tokenizer = corpus
    run = ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--device", "cpu", "--weight_decay", "0.1"]
    with pytest.raises(SystemExit):
        train.get_args(run + ["--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert "pass --amp in place of --dtype bfloat16 (float32 parameters, bf16 compute) to decay, or --weight_decay " \
           "0" in err, err
    args = train.get_args(run + ["--amp"])
    assert args.amp and args.weight_decay == 0.1

@pytest.mark.parametrize("device,env,expected", [
    ("cuda", {}, "cuda:0"), ("auto", {}, "cuda:0"), ("cuda:1", {}, "cuda:1"),
    ("auto", dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2"), "cuda:1"),
    ("cuda", dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"), "cuda:1"),
    ("cuda:2", {}, "this machine has 2 CUDA GPU(s), cuda:0 to cuda:1; pass one of those"),
    ("cuda:0", dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"), "pass --device cuda (or auto)"),
    ("auto", dict(RANK="3", LOCAL_RANK="3", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4"), "pass --nproc_per_node=2"),
])
def test_a_gpu_is_always_named_with_its_index(monkeypatch, capsys, device, env, expected):
    """On a machine with 2 GPUs (faked: this test runs without one): torch.cuda.set_device and DDP's device_ids take
    the resolved device, and a GPU that is not there or is shared by the processes of one machine is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80e9, 80e9))
    chosen = []  # torch.cuda.set_device's argument check, without its CUDA call
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.cuda._utils._get_device_index(d)))
    for k, v in dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items() if env else ():  # as torchrun sets
        monkeypatch.setenv(k, v)
    argv = ["--size", "60m", "--device", device]
    if expected.startswith("cuda:"):
        args = train.get_args(argv)
        assert args.device == expected and chosen == [int(expected[-1])]
        return
    with pytest.raises(SystemExit):
        train.get_args(argv)
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_cpu_run_that_cannot_fit_is_refused_naming_a_batch_size(monkeypatch, capsys):
    pages = {"SC_PHYS_PAGES": 24 * 2**30 // 4096, "SC_PAGE_SIZE": 4096}  # a 24 GB machine, whatever runs the test
    monkeypatch.setattr(train.os, "sysconf", lambda name: pages[name])
    with pytest.raises(SystemExit):
        train.get_args(["--size", "60m", "--device", "cpu", "--max_length", "1024", "--batch_size", "512"])
    assert re.search(r"needs about \d+\.\d GB per process, more than 80% of .* pass --batch_size \d+$",
                     capsys.readouterr().err.strip())
    args = train.get_args(["--size", "60m", "--device", "cpu"])
    assert args.batch_size == flags.CPU_MICRO  # not the GPU micro-batch of 128


@pytest.mark.parametrize("given", [["--gradient_accumulation", "1"],
                                   ["--batch_size", "512", "--gradient_accumulation", "1"]])
def test_a_run_that_cannot_fit_at_a_given_accumulation_names_a_fix_that_is_taken(monkeypatch, capsys, given):
    """With --gradient_accumulation given, the micro-batch is the update's share of it: the refusal named a smaller
    --batch_size alone, which the batch arithmetic then refused (and its fix, to drop --batch_size, led back to the
    first refusal). It names the accumulation that makes up the update with it, and that fix is taken."""
    pages = {"SC_PHYS_PAGES": 24 * 2**30 // 4096, "SC_PAGE_SIZE": 4096}  # a 24 GB machine, whatever runs the test
    monkeypatch.setattr(train.os, "sysconf", lambda name: pages[name])
    argv = ["--size", "60m", "--device", "cpu", *given]  # 512 sequences of 256 tokens in one micro-batch
    with pytest.raises(SystemExit):
        train.get_args(argv)
    err = capsys.readouterr().err.strip()
    found = re.search(r"--batch_size 512 needs about .* pass --batch_size (\d+) --gradient_accumulation (\d+)$", err)
    assert found and int(found[1]) * int(found[2]) == 512, err
    args = train.get_args(argv + ["--batch_size", found[1], "--gradient_accumulation", found[2]])
    assert (args.batch_size, args.gradient_accumulation) == (int(found[1]), int(found[2]))


@pytest.mark.parametrize("world", [1, 2])
def test_the_memory_check_counts_gradients_kept_between_micro_batches_and_in_ddp_buckets(monkeypatch, capsys, world):
    """Per-layer updates free each layer's gradients, but not while an update accumulates micro-batches nor under DDP,
    whose buckets hold them all. On a machine with room for the one and not the other, a run of one micro-batch an
    update trains, and the same run is refused before anything is built, naming what it needs, when it accumulates
    two or runs on two ranks (which share the machine)."""
    settings = dict(optimizer="adam8bit", per_layer=True, batch_size=8, dtype="float32", index_dtype="int32")
    freed, kept = (flags.estimate("60m", "sltrain", accumulation=a, **settings)["train_gb"] for a in (1, 2))
    assert kept > 1.1 * freed and flags.estimate("60m", "sltrain", ddp=True, **settings)["train_gb"] == kept
    room = world * (freed + kept) / 2 / 0.8 * 1e9  # 80% of the machine is what the ranks may fill
    pages = {"SC_PHYS_PAGES": int(room // 4096), "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(train.os, "sysconf", lambda name: pages[name])
    argv = ["--size", "60m", "--device", "cpu", "--optimizer", "adam8bit", "--per_layer", "--batch_size", "8"]
    assert train.get_args(argv + ["--total_batch_size", "8"]).gradient_accumulation == 1
    torchrun_variables(monkeypatch, rank=0, local_rank=0, world=world)
    with pytest.raises(SystemExit):
        train.get_args(argv + ["--total_batch_size", "16"])  # two micro-batches an update, or two ranks of one
    assert f"needs about {kept:.1f} GB per process" in capsys.readouterr().err


def one_gpu(monkeypatch, free):
    """A machine with one GPU of 80 GB (faked: these tests run without one), free bytes of it free."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 80e9))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def refused_then_taken(monkeypatch, capsys, argv, fix, rows, named=""):
    """On a GPU with room between rows[0]'s need and rows[1]'s, the run of argv is refused naming rows[1]'s need (and
    the fix named, if given), and taken with the flags fix: its args."""
    one_gpu(monkeypatch, (rows[0]["train_gb"] + rows[1]["train_gb"]) / 2 / 0.95 * 1e9)
    with pytest.raises(SystemExit):
        train.get_args(argv)
    err = capsys.readouterr().err
    assert f"needs about {rows[1]['train_gb']:.1f} GB" in err and named in err, err
    return train.get_args(argv + fix)


@pytest.mark.parametrize("extra", [[], ["--amp"], ["--optimizer", "adam8bit", "--per_layer"]])
def test_gpu_run_that_cannot_fit_is_refused_and_each_named_fix_is_taken(monkeypatch, capsys, extra):
    """On a GPU with 24 GB free (faked; 26 GB under --amp, where float32 weights, moments and gradients and autocast's
    bf16 copies of the weights leave no batch room in 24) 1b's micro-batch of 32 does not fit: refused before anything
    is built, naming a --batch_size and, where it is enough, --activation_checkpointing; each fix named is then
    accepted."""
    free = 26 if "--amp" in extra else 24
    one_gpu(monkeypatch, free * 1e9)  # the rest of 80 GB in use elsewhere
    argv = ["--size", "1b", "--method", "full", "--device", "cuda", *extra]
    with pytest.raises(SystemExit):
        train.get_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.search(rf"--batch_size 32 needs about (\d+\.\d) GB per process, more than 95% of the {free}\.0 GB free "
                      r"on cuda:0; pass --batch_size (\d+)( or add --activation_checkpointing| with "
                      r"--activation_checkpointing)?$", err)
    assert found, err
    assert float(found[1]) > 0.95 * free and (found[3] or extra)  # bf16 1b full at batch 32 fits when checkpointed
    # --amp: float32 weights, moments and gradients (kept over 512 / 32 micro-batches) leave too little room for
    # any micro-batch's activations, but checkpointed ones
    both = found[3] == " with --activation_checkpointing"
    assert both == (extra == ["--amp"]), err
    fix = ["--batch_size", found[2]] + (["--activation_checkpointing"] if both else [])
    assert train.get_args(argv + fix).batch_size == int(found[2])
    if found[3] == " or add --activation_checkpointing":
        assert train.get_args(argv + ["--activation_checkpointing"]).batch_size == 32
    for too_much in (["--batch_size", str(2 * int(found[2])), *fix[2:]], ["--batch_size", found[2]] if both else []):
        if too_much:  # the next batch size up, a divisor of 512, does not fit; nor, if both were named, one alone
            with pytest.raises(SystemExit):
                train.get_args(argv + too_much)


def test_gpu_memory_check_counts_galore_at_its_own_rank(monkeypatch, capsys):
    """GaLore's moments are (galore_rank, max(in, out)) per projection: the check counts them at --galore_rank."""
    one_gpu(monkeypatch, 1e9)  # nothing at 1b fits in 1 GB
    needs = []
    for galore_rank in ("64", "2048"):
        with pytest.raises(SystemExit):
            train.get_args(["--size", "1b", "--method", "full", "--device", "cuda", "--optimizer", "galore_adamw",
                            "--galore_rank", galore_rank, "--batch_size", "1"])  # 1: no smaller one to search
        needs.append(float(re.search(r"needs about (\d+\.\d) GB", capsys.readouterr().err)[1]))
    rows = [flags.estimate("1b", "galore", rank, batch_size=1, index_dtype="int32") for rank in (64, 2048)]
    assert needs[1] > needs[0] + 1
    assert needs[1] - needs[0] == pytest.approx(rows[1]["optim_gb"] - rows[0]["optim_gb"], abs=0.11)


def test_gpu_memory_check_counts_packed_supports(monkeypatch, capsys):
    """--packed_support keeps each support in about a byte a value, where int32 takes 4: a GPU with room for the
    7b run's packed supports but not its flat ones refuses the run naming the flag, and takes it with the flag."""
    argv = ["--size", "7b", "--method", "sltrain", "--device", "cuda", "--optimizer", "adam8bit", "--per_layer",
            "--batch_size", "1", "--total_batch_size", "1"]  # one micro-batch an update, no smaller batch to search
    rows = [flags.estimate("7b", "sltrain", batch_size=1, index_dtype=f, optimizer="adam8bit", per_layer=True)
            for f in ("packed", "int32")]
    assert rows[1]["train_gb"] - rows[0]["train_gb"] > 0.9  # 7b at δ = 0.05: 1.30 G of int32 indices, 0.35 G packed
    args = refused_then_taken(monkeypatch, capsys, argv, ["--packed_support"], rows, named="add --packed_support")
    assert args.packed_support


def test_gpu_memory_check_counts_only_the_sparse_values_when_frozen(monkeypatch, capsys):
    """--freeze lowrank trains V alone: a GPU with room for that run but not for the whole model's takes it."""
    argv = ["--size", "1b", "--method", "sltrain", "--device", "cuda", "--batch_size", "1"]  # no smaller one to search
    rows = [flags.estimate("1b", "sltrain", batch_size=1, index_dtype="int32", freeze=f, accumulation=512)
            for f in ("lowrank", None)]  # 512 micro-batches an update, the gradients kept between them
    assert refused_then_taken(monkeypatch, capsys, argv, ["--freeze", "lowrank"], rows).freeze == "lowrank"


def test_eval_only_memory_check_counts_a_forward_without_gradients(monkeypatch, capsys):
    """--eval_only needs the parameters and a forward's activations, not training's gradients and moments: on a GPU
    too small to train 7b SLTrain it evaluates; with less room it names a smaller batch, which need not divide an
    update (there is none)."""
    rows = {b: flags.estimate("7b", "sltrain", batch_size=b, index_dtype="int32", accumulation=512 // b)
            for b in (7, 8)}  # training accumulates the rest of 512 sequences; evaluation has no gradients
    assert rows[8]["eval_gb"] < rows[8]["param_gb"] + 1 < rows[8]["train_gb"] / 2
    def evaluated(argv):  # checked as train.py does, at the run's settings (here the command line's), on its look
        args = train.get_args(argv + ["--eval_only"])
        train.eval_settings(args, dict(vars(args)), None, torch.device(args.device), 1, (), (args.dtype, args.amp))
        return args
    one_gpu(monkeypatch, (rows[8]["eval_gb"] + rows[8]["train_gb"]) / 2 / 0.95 * 1e9)  # room to evaluate, not to train
    argv = ["--size", "7b", "--device", "cuda", "--batch_size", "8"]
    with pytest.raises(SystemExit):
        train.get_args(argv)
    assert f"needs about {rows[8]['train_gb']:.1f} GB" in capsys.readouterr().err
    assert evaluated(argv).batch_size == 8
    one_gpu(monkeypatch, (rows[7]["eval_gb"] + rows[8]["eval_gb"]) / 2 / 0.95 * 1e9)  # room for 7 sequences, not 8
    with pytest.raises(SystemExit):
        evaluated(argv)
    assert re.search(rf"--batch_size 8 needs about {rows[8]['eval_gb']:.1f} GB per process, more than 95% of the "
                     r"\d+\.\d GB free on cuda:0; pass --batch_size 7 or add --packed_support$",
                     capsys.readouterr().err.strip())  # packed supports: the 7b model's 1.30 G of indices in 0.35 G


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """A sentencepiece model of about 100,000 pieces (a multilingual tokenizer's size, three times T5's), laid out as
    T5's: the pieces of one sentence and user-defined symbols, made in a second where training them would take hours.
    Returns (its path, its pieces)."""
    prefix = tmp_path_factory.mktemp("tok100k") / "spm"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["the cat sat on the mat and the dog ran far"] * 50),
                                   model_prefix=str(prefix), vocab_size=100_000, model_type="unigram", pad_id=0,
                                   eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False, minloglevel=2,
                                   user_defined_symbols=[f"<x{i}>" for i in range(99_980)])
    pieces = data.load_tokenizer(f"{prefix}.model").get_piece_size()
    assert pieces > 99_980, pieces
    return f"{prefix}.model", pieces


def machine_of(monkeypatch, room):
    """A machine (faked) where a run may fill room bytes: 80% of its memory, as on a CPU."""
    monkeypatch.setattr(flags, "memory_there", lambda device, world=1: (room / 0.8, 0.8, f"a {room / 0.8:.0f} B box"))


def test_the_memory_check_counts_the_tokenizers_own_vocabulary(corpus, big_tokenizer, monkeypatch, capsys):
    """The embeddings, the output head and the logits are as wide as the tokenizer: a run is checked at its pieces,
    not T5's 32000 (the check passed none). On a machine with room for a 60m run at T5's vocabulary but not at
    100,000 pieces, the run with that tokenizer was let through, to be killed once built; with room for it at the
    96 pieces of corpus's tokenizer but not at T5's, the run with those was refused, though it fits."""
    big, pieces = big_tokenizer
    need = lambda pieces: flags.estimate("60m", "sltrain", index_dtype="int32", dtype="float32", batch_size=16,  # noqa
                                         accumulation=32, vocab_size=pieces)["train_gb"] * 1e9  # 512 = 16 x 32
    argv = ["--size", "60m", "--device", "cpu", "--batch_size", "16", "--tokenizer"]
    machine_of(monkeypatch, (need(32000) + need(pieces)) / 2)
    with pytest.raises(SystemExit):
        train.get_args(argv + [big])
    assert f"needs about {need(pieces) / 1e9:.1f} GB per process" in capsys.readouterr().err
    assert train.get_args(argv + [big, "--batch_size", "4"]).batch_size == 4  # a smaller one fits
    machine_of(monkeypatch, (need(96) + need(32000)) / 2)
    assert train.get_args(argv + [corpus[1]]).batch_size == 16
    with pytest.raises(SystemExit):  # no tokenizer there yet: T5's, which --download fetches
        train.get_args(argv + [str(HERE / "no" / "spiece.model"), "--download"])
    assert f"needs about {need(32000) / 1e9:.1f} GB per process" in capsys.readouterr().err


def test_a_resume_and_an_evaluation_are_checked_at_the_runs_vocabulary(corpus, tmp_path, monkeypatch, capsys):
    """A resume's memory check (at the run's own settings, once its checkpoint is looked at) and --eval_only's (on the
    command line's, then again at the run's own length) count the run's vocabulary, its tokenizer's: on a machine
    with room for the tiny run at its 96 pieces, but not at T5's 32000, both were refused, though the run had
    trained there."""
    train.main(base_args(corpus, tmp_path, 4, "--stop_after", "2"))
    rows = {v: flags.estimate("tiny", "sltrain", index_dtype="int32", dtype="float32", batch_size=4, max_length=32,
                              accumulation=2, vocab_size=v) for v in (96, 32000)}
    assert rows[96]["train_gb"] < rows[32000]["eval_gb"] < rows[32000]["train_gb"]
    machine_of(monkeypatch, (rows[96]["train_gb"] + rows[32000]["eval_gb"]) / 2 * 1e9)
    train.main(base_args(corpus, tmp_path, 4, "--resume"))
    assert final_state(tmp_path)["step"] == 4
    argv = eval_args(corpus, tmp_path)
    at = argv.index("--max_length")
    del argv[at:at + 2]  # the run's own 32 is taken, and checked again
    train.main(argv)
    said = capsys.readouterr().out
    assert "--eval_only: the run's own --max_length 32" in said and "| val loss" in said, said


def test_an_evaluation_is_checked_at_the_runs_own_length_and_dtype_alone(corpus, tmp_path, monkeypatch, capsys):
    """--eval_only without --max_length or --dtype evaluates at the run's own (a bf16 run of 32 tokens a row): its
    memory was checked first at the command line's (the default 256, and float32 on a CPU), and a machine with room
    for the evaluation it runs refused it, naming no fix that helps. It is checked at the run's own, on the quick
    look: still before the checkpoint's read where it does not fit."""
    train.main(base_args(corpus, tmp_path, 2, "--dtype", "bfloat16"))
    need = lambda dtype, length: flags.estimate("tiny", "sltrain", index_dtype="int32", dtype=dtype,  # noqa: E731
                                                batch_size=4, max_length=length, vocab_size=96)["eval_gb"] * 1e9
    assert need("bfloat16", 32) < min(need("float32", 32), need("bfloat16", 256)) < need("float32", 256)
    argv = eval_args(corpus, tmp_path)
    at = argv.index("--max_length")
    del argv[at:at + 2]
    machine_of(monkeypatch, (need("bfloat16", 32) + min(need("float32", 32), need("bfloat16", 256))) / 2)
    train.main(argv)
    said = capsys.readouterr().out
    assert "the run's own --dtype bfloat16, --max_length 32" in said and "| val loss" in said, said
    reads, load = [], checkpoint.load
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: (reads.append(a), load(*a, **k))[1])
    machine_of(monkeypatch, need("bfloat16", 32) / 2)
    with pytest.raises(SystemExit):
        train.main(argv)
    assert f"needs about {need('bfloat16', 32) / 1e9:.1f} GB" in capsys.readouterr().err and not reads


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        train.get_args(["--help"])
    out = capsys.readouterr().out
    # --weight_decay's 0.0 (the paper's: no decay) equals False, which a store_true flag's help leaves out
    for flag in ("--min_lr_ratio MIN_LR_RATIO", "--eval_tokens EVAL_TOKENS", "--workers WORKERS",
                 "--weight_decay WEIGHT_DECAY"):
        assert "(default:" in out.split(flag, 2)[2].split("\n  --", 1)[0], f"{flag} shows no default"
    lr = " ".join(out.split("--lr LR", 2)[2].split("\n  --", 1)[0].split())  # each peak a run can default to
    for default in {lr for _, _, lr, _ in flags.RECIPES.values()} | {lr for lr, _ in flags.GALORE.values()}:
        assert f"{default:g}" in lr, f"--lr's help omits the default {default:g}: {lr}"


@pytest.mark.parametrize("script", ["analyze.py", "bench.py", "checkpoint.py", "data.py", "estimate_memory.py",
                                    "export.py", "model.py", "sample.py", "suite.py"])
def test_each_command_freezes_its_heap_for_the_exit(script, monkeypatch, capsys):
    """Every command's process ends without the interpreter's last collection over the objects it is about to free
    anyway, torch's modules among them (about a second). train.py's exit is checked in its own process by
    test_faults.py's late-signal test."""
    hooks = []
    monkeypatch.setattr(atexit, "register", lambda hook, *args, **kwargs: hooks.append(hook) or hook)
    monkeypatch.setattr(sys, "argv", [script] if script == "model.py" else [script, "--help"])  # model.py: its table
    with suppress(SystemExit):
        runpy.run_path(str(HERE / script), run_name="__main__")
    assert gc.freeze in hooks, f"{script} leaves its heap to the exit's collection"
    capsys.readouterr()


def test_galore_defaults_are_its_scripts_and_explicit_ones_stand(monkeypatch):
    monkeypatch.setattr(flags, "check_memory", lambda *args, **kw: None)  # a 7b run need not fit this machine
    galore = ["--method", "full", "--optimizer", "galore_adam8bit", "--device", "cpu"]
    for argv, lr, gap in ((["--size", "7b"], 5e-3, 500), (["--size", "1b"], 1e-2, 200),
                          (["--size", "7b", "--lr", "1e-3", "--galore_update_gap", "100"], 1e-3, 100)):
        args = train.get_args([*argv, *galore])
        assert (args.lr, args.galore_update_gap) == (lr, gap), f"{' '.join(argv)}: {args.lr}, {args.galore_update_gap}"


def test_default_clipping_is_the_authors_at_7b_and_an_explicit_one_stands(monkeypatch):
    monkeypatch.setattr(flags, "check_memory", lambda *args, **kw: None)  # a 7b run need not fit this machine
    for argv, clip in ((["--size", "7b"], 1.0), (["--size", "7b", "--optimizer", "adam8bit", "--per_layer"], 0.0),
                       (["--size", "7b", "--grad_clipping", "0"], 0.0), (["--size", "60m"], 0.0),
                       (["--size", "60m", "--grad_clipping", "0.5"], 0.5)):
        got = train.get_args([*argv, "--device", "cpu"]).grad_clipping
        assert got == clip, f"{' '.join(argv)}: grad_clipping {got}, expected {clip}"


def test_default_warmup_is_the_recipes_share_of_the_steps(monkeypatch):
    # the authors' scripts warm up over 10% of the updates, except 1b's: 10,000 of 140,000
    monkeypatch.setattr(flags, "check_memory", lambda *args, **kw: None)  # a 1b or 7b run need not fit this machine
    for argv, warmup in ((["--size", "60m"], 1100), (["--size", "1b"], 10_000), (["--size", "7b"], 15_000),
                         (["--size", "1b", "--num_training_steps", "14000"], 1000),
                         (["--size", "tiny", "--num_training_steps", "6"], 0),
                         # ReLoRA's first warmup ends by its first restart (ReLoRA's scheduler asserts it)
                         (["--size", "350m", "--method", "relora"], 2000),
                         (["--size", "60m", "--method", "relora"], 1100),
                         (["--size", "60m", "--method", "relora", "--relora_reset", "500"], 500),
                         (["--size", "1b", "--method", "relora", "--warmup_steps", "2000"], 2000)):
        got = train.get_args([*argv, "--device", "cpu"]).warmup_steps
        assert got == warmup, f"{' '.join(argv)}: warmup {got}, the recipe's is {warmup}"


def test_a_rank_past_a_model_configs_width_names_the_file(tmp_path, capsys):
    """The width came from --model_config's intermediate_size, where --ffn_dim beside it is refused: the fix named is
    the file's."""
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "llama_tiny.json"
    config.write_text(json.dumps({"hidden_size": 64, "intermediate_size": 12}))
    with pytest.raises(SystemExit):
        train.get_args(["--model_config", str(config), "--device", "cpu"])
    assert (f"--size tiny's rank, 16, must be below min(dim 64, ffn_dim 12) = 12, every projection's smaller side: "
            f"pass a smaller --rank or a larger intermediate_size in {config}") in capsys.readouterr().err
    # where --ffn_dim set the width, a file without intermediate_size (or not here) is not what to change
    config.write_text(json.dumps({"hidden_size": 64}))
    for path in (config, tmp_path / "elsewhere" / "llama_tiny.json"):
        with pytest.raises(SystemExit):
            train.get_args(["--model_config", str(path), "--ffn_dim", "12", "--device", "cpu"])
        assert capsys.readouterr().err.rstrip().endswith("= 12, every projection's smaller side: pass a smaller "
                                                         "--rank or a larger --ffn_dim")


@pytest.mark.parametrize("argv,message", [
    (["--size", "350m", "--warmup_steps", "6500"], "--warmup_steps 6500 is longer than --relora_reset 2000: ReLoRA's "
     "first restart comes after its warmup; pass a --warmup_steps of at most 2000, or a --relora_reset of at least "
     "6500"),
    (["--size", "60m", "--relora_reset", "1000"], None),  # the size's warmup, 1100, made 1000: accepted
    (["--size", "60m", "--relora_reset", "1000", "--warmup_steps", "1001"], "--warmup_steps 1001 is longer than "
                                                                          "--relora_reset 1000"),
])
def test_relora_restarts_only_after_its_first_warmup(monkeypatch, capsys, argv, message):
    """A restart inside the warmup merged, pruned 99% of the moments and began a jag while the learning rate still
    climbed: every default size from 130m up restarted at 2000, 4000 and 6000 inside warmups of 2200 to 15000."""
    monkeypatch.setattr(flags, "check_memory", lambda *args, **kw: None)
    run = [*argv, "--method", "relora", "--device", "cpu"]
    if message is None:
        args = train.get_args(run)
        lr = [train.lr_lambda_for(args)(k) for k in range(args.relora_reset + 1)]
        assert args.warmup_steps <= args.relora_reset, args.warmup_steps
        assert all(a < b for a, b in zip(lr[:-2], lr[1:-1])) and lr[-1] == 0, "a jag within the first warmup"
        return
    with pytest.raises(SystemExit):
        train.get_args(run)
    assert message in capsys.readouterr().err


def test_a_relora_run_too_short_for_its_default_reset_says_it_restarts_nothing(corpus, tmp_path, capsys,
                                                                               monkeypatch):
    """ReLoRA's default reset, 2000, in a shorter run (--size tiny's 1000 updates, or any short one) never restarts:
    it trained LoRA over a frozen W0 without a word. It is said, also in a run of exactly 2000 updates (its last
    update is no restart: the "reached" run below restarts at 1 of 2, not at 2); a reset the run reaches makes no
    note and restarts (a --relora_reset given that it does not reach is refused: test_relora)."""
    train.main(base_args(corpus, tmp_path / "default", 2, "--method", "relora"))
    out = capsys.readouterr().out
    assert ("note: --relora_reset 2000 restarts nothing in a run of 2 updates: this run trains LoRA over a frozen W0, "
            "without ReLoRA's merges; pass a --relora_reset below --num_training_steps for them") in out, out
    train.main(base_args(corpus, tmp_path / "as_long", 2000, "--method", "relora", "--stop_after", "1"))
    out = capsys.readouterr().out
    assert "note: --relora_reset 2000 restarts nothing in a run of 2000 updates" in out, out
    restarts, merge = [], train.relora_merge
    monkeypatch.setattr(train, "relora_merge", lambda *a: restarts.append(1) or merge(*a))
    train.main(base_args(corpus, tmp_path / "reached", 2, "--method", "relora", "--relora_reset", "1",
                         "--relora_warmup", "0", "--warmup_steps", "1"))
    assert "restarts nothing" not in capsys.readouterr().out and restarts == [1]


@pytest.mark.parametrize("argv,message", [
    (["--method", "full", "--optimizer", "galore_adamw", "--galore_update_gap", "0"],
     "--galore_update_gap must be at least 1, got 0"),
    (["--method", "relora", "--relora_reset", "-5"], "--relora_reset must be at least 1, got -5"),
    (["--method", "relora", "--relora_warmup", "-1"], "--relora_warmup must be at least 0, got -1"),
], ids=["gap", "reset", "warmup"])
def test_a_baselines_count_out_of_range_is_refused_naming_that_flag(capsys, argv, message):
    """One line named all three of GaLore's and ReLoRA's counts, whichever was wrong: it names the one given."""
    with pytest.raises(SystemExit):
        train.get_args(["--size", "tiny", "--device", "cpu", "--num_training_steps", "100", *argv])
    assert capsys.readouterr().err.rstrip().endswith(message)


def test_a_rows_time_counts_the_work_the_device_still_had_queued():
    """On a GPU the interval's kernels may still run when the row is made; reading its tokens waits for them. The
    clock must be read after that wait, or each row's ms and tok/s leave out their own last work."""
    class Queued:  # a device scalar whose work is still queued: reading it waits
        def __init__(self, value):
            self.value = value

        def item(self):
            time.sleep(0.3)
            return self.value

        def zero_(self):
            self.value = 0.0

    meter = train.Meter(torch.device("cpu"), 0, 10)
    meter.tokens = Queued(1000.0)
    row = meter.row(1, 1e-3, torch.tensor(1.0), ddp=False)
    assert row["ms_per_step"] >= 300 and row["tokens_per_s"] <= 1000 / 0.3, row


def test_the_eta_is_the_pace_after_the_first_rows_one_off_costs(monkeypatch):
    """The first interval holds what never comes again: a compile (or a CUDA graph's capture) and a resumed run's
    pending evaluation, minutes at 7b, which the eta spread over every update to come: days on a run of 150k. The
    first row's eta is its training time's pace (the evaluation left out, as from its ms/step); each later row's is
    the pace since the first row, the evaluations and checkpoints since included, as they recur."""
    clock = [0.0]
    monkeypatch.setattr(train, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    meter = train.Meter(torch.device("cpu"), 0, 1000)
    clock[0] += 30
    meter.pause(30)  # the pending evaluation, before the first update
    clock[0] += 60 + 10  # a compile, then 10 updates of a second
    meter.row(10, 1e-3, torch.tensor(1.0), ddp=False)
    assert meter.eta == pytest.approx(70 / 10 * 990)
    clock[0] += 10 + 5  # 10 updates and an evaluation
    meter.pause(5)
    meter.row(20, 1e-3, torch.tensor(1.0), ddp=False)
    assert meter.eta == pytest.approx(15 / 10 * 980)


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adam8bit", "--per_layer"]], ids=["adamw", "per_layer"])
def test_a_rows_lr_is_the_one_its_update_stepped_with(corpus, tmp_path, extra):
    # warmup over 2 updates, then the cosine from its top: update k steps with lr · lr_lambda(k - 1); the first
    # is a step of lr 0, as in the authors' schedule
    train.main(base_args(corpus, tmp_path, 3, "--lr", "1e-2", "--warmup_steps", "2", *extra))
    assert [r["lr"] for r in metrics(tmp_path)[0]] == pytest.approx([0.0, 5e-3, 1e-2], abs=1e-15)


def test_resume_honors_new_flags_and_continues_the_schedule(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 6, "--lr", "1e-2"))
    lr_end = metrics(tmp_path)[0][-1]["lr"]
    capsys.readouterr()
    train.main(base_args(corpus, tmp_path, 10, "--resume", "--lr", "1e-2"))
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path}/ckpt.pt at step 6; changed and honored: num_training_steps 6 -> 10" in out
    rows = metrics(tmp_path)[0]
    assert rows[6]["lr"] <= lr_end + 1e-12, f"lr jumped from {lr_end} to {rows[6]['lr']} when the steps were raised"
    state = final_state(tmp_path)
    assert state["args"]["warmup_steps"] == 0 and state["args"]["num_training_steps"] == 10
    # a new --lr is used, and what is recorded is what ran
    train.main(base_args(corpus, tmp_path, 12, "--resume", "--lr", "1e-4"))
    assert metrics(tmp_path)[0][-1]["lr"] < 1e-4 and final_state(tmp_path)["args"]["lr"] == 1e-4


def test_a_resume_naming_the_runs_start_another_way_is_the_same_run(corpus, tmp_path, monkeypatch):
    """--init_from on a resume is checked against the run's start as a file, as --data_dir is as a folder: the same
    checkpoint by another path (./full, its absolute path), or the run's own command again once the start's folder is
    gone (the resumed run does not need it, its help says), was refused as "written by another run"."""
    monkeypatch.chdir(tmp_path)
    train.main(base_args(corpus, "full", 2, "--method", "full"))
    train.main(base_args(corpus, "run", 6, "--init_from", "full", "--stop_after", "1"))
    train.main(base_args(corpus, "run", 6, "--init_from", "./full", "--resume", "--stop_after", "1"))
    train.main(base_args(corpus, "run", 6, "--init_from", str(tmp_path / "full"), "--resume", "--stop_after", "1"))
    shutil.rmtree("full")
    train.main(base_args(corpus, "run", 6, "--init_from", "full", "--resume"))
    assert final_state("run")["step"] == 6
    train.main(base_args(corpus, "other", 2, "--method", "full"))
    with pytest.raises(SystemExit, match="written by another run: init_from full/ckpt.pt"):
        train.main(base_args(corpus, "run", 8, "--init_from", "other", "--resume"))


def test_resume_with_another_tokenizer_is_refused(corpus, tmp_path):
    train.main(base_args(corpus, tmp_path, 2))
    other = data.train_tokenizer(corpus[0], tmp_path / "other", vocab_size=96, max_docs=50)  # same vocabulary size
    args = base_args(corpus, tmp_path, 4, "--resume")
    args[args.index("--tokenizer") + 1] = str(other)
    with pytest.raises(SystemExit, match="tokenizer_sha256"):
        train.main(args)


def disk_full_from(monkeypatch, nth, at):
    """A disk that is full from the nth temporary (checkpoint.TEMPORARY's name: atomic_file's and atomic_files') that
    comes to it: creating it (at="open") or syncing it (at="fsync", as a delayed-allocation disk says so) fails with
    ENOSPC, for it and for every one after. Returns the temporaries that came, in order."""
    came, real = [], getattr(os, at)

    def full(target, *args, **kwargs):
        name = os.fspath(target) if at == "open" else os.readlink(f"/proc/self/fd/{target}")
        if checkpoint.TEMPORARY.fullmatch(os.path.basename(name)):
            came.append(name)
            if len(came) >= nth:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(target, *args, **kwargs)
    monkeypatch.setattr(os, at, full)
    return came


@contextmanager
def file_size_limit(nbytes):
    """The kernel's limit on the size of a file this process writes (RLIMIT_FSIZE, `ulimit -f`, which some clusters
    set): a write past it fails with EFBIG (Python ignores SIGXFSZ). A filesystem error other than a full disk that
    needs no root and no special disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_overwrite_removes_the_old_checkpoint_with_its_rows(corpus, tmp_path):
    """--overwrite empties the old run's metrics at the start; its checkpoint goes then too, so a new run that stops
    before its first save leaves neither, not the old checkpoint beside the new rows."""
    train.main(base_args(corpus, tmp_path, 4, "--stop_after", "2"))
    with pytest.raises(SystemExit, match="No checkpoint was saved yet"):
        train.main(base_args(corpus, tmp_path, 4, "--overwrite", "--lr", "1e9", "--warmup_steps", "0"))
    assert not (tmp_path / "ckpt.pt").exists()


def test_overwrite_keeps_the_old_checkpoint_until_the_run_has_passed_its_checks(corpus, tmp_path, capsys):
    """A run refused after --overwrite was read (a start that cannot be read, a --resume of another run) kept nothing
    of the run it was to replace: the checkpoint was removed first. Nor may a run start from the checkpoint that its
    own would replace."""
    train.main(base_args(corpus, tmp_path / "old", 4, "--stop_after", "2"))
    train.main(base_args(corpus, tmp_path / "other", 2, "--seed", "7"))
    before = (tmp_path / "old" / "ckpt.pt").read_bytes()
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(SystemExit, match="junk.pt"):
        train.main(base_args(corpus, tmp_path / "old", 4, "--overwrite", "--method", "sltrain", "--init_from",
                             str(tmp_path / "junk.pt")))
    with pytest.raises(SystemExit, match=r"^--resume: .* was written by another run: seed 7 \(now 42\)"):
        train.main(base_args(corpus, tmp_path / "old", 4, "--overwrite", "--resume", str(tmp_path / "other")))
    assert (tmp_path / "old" / "ckpt.pt").read_bytes() == before
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path / "old", 4, "--overwrite", "--init_from",
                             str(tmp_path / "old" / "ckpt.pt")))
    assert f"--init_from {tmp_path}/old/ckpt.pt is the checkpoint in --out_dir {tmp_path}/old, which this run's own " \
           "checkpoints replace: pass another --out_dir" in capsys.readouterr().err
    assert (tmp_path / "old" / "ckpt.pt").read_bytes() == before


def test_eval_only_reports_the_checkpoint_and_tokens(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 2))
    val = metrics(tmp_path)[1][-1]["val_loss"]
    capsys.readouterr()
    train.main(eval_args(corpus, tmp_path))
    out = capsys.readouterr().out
    assert f"{tmp_path}/ckpt.pt at step 2 | val loss {val:.4f}" in out and "validation tokens" in out


def test_eval_only_with_a_bare_resume_evaluates_the_out_dirs_checkpoint(corpus, tmp_path, capsys):
    """--resume without a path names --out_dir's ckpt.pt (its help): --eval_only --resume --out_dir DIR was refused
    as an --out_dir it never reads, naming --resume's path to drop, where none was given."""
    train.main(base_args(corpus, tmp_path, 2))
    capsys.readouterr()
    train.main(eval_args(corpus, tmp_path, "--resume"))  # eval_args names --out_dir
    assert f"{tmp_path}/ckpt.pt at step 2 | val loss" in capsys.readouterr().out

def test_eval_only_cuts_the_validation_set_as_the_run_did_unless_told(corpus, tmp_path, capsys):
    """Without --max_length, --pack and --eval_tokens, --eval_only scored 256-token padded rows of 10M tokens: for a
    run trained on 16-token packed windows, positions it never saw and another loss than its own. It takes the run's
    and says so, and gives the run's last val_loss again; a flag given is honored."""
    folder, tokenizer = corpus
    argv = base_args(corpus, tmp_path, 2, "--pack")
    argv[argv.index("--max_length") + 1] = "16"
    argv[argv.index("--eval_tokens") + 1] = "2000"
    train.main(argv)
    val = metrics(tmp_path)[1][-1]["val_loss"]
    capsys.readouterr()
    bare = ["--size", "tiny", "--data_dir", folder, "--tokenizer", tokenizer, "--out_dir", str(tmp_path), "--eval_only"]
    train.main(bare)
    out = capsys.readouterr().out
    assert "--eval_only: the run's own --max_length 16, --pack True, --eval_tokens 2000 (pass others to choose)" in out
    assert f"at step 2 | val loss {val:.4f}" in out, out
    train.main(bare + ["--max_length", "32"])
    out = capsys.readouterr().out
    assert "the run's own --pack True, --eval_tokens 2000" in out and "sequences of 32 tokens" in out, out


@pytest.mark.parametrize("precision", [["--amp"], ["--dtype", "bfloat16"]])
def test_eval_only_computes_as_the_run_did_unless_told(precision, corpus, tmp_path, capsys):
    """An --amp or a bf16 run evaluated without --amp or --dtype computed in the device's default (float32 on a CPU)
    and gave another val_loss than its own (3.9393 against 3.9391): it takes the run's and says so; a --dtype
    given is honored."""
    train.main(base_args(corpus, tmp_path, 2, *precision))
    val = metrics(tmp_path)[1][-1]["val_loss"]
    capsys.readouterr()
    train.main(eval_args(corpus, tmp_path))
    out = capsys.readouterr().out
    said = "--amp (bf16 compute)" if precision == ["--amp"] else "--dtype bfloat16"
    assert f"--eval_only: the run's own {said} (pass others to choose)" in out, out
    assert f"at step 2 | val loss {val:.4f}" in out, out
    train.main(eval_args(corpus, tmp_path, "--dtype", "float32"))
    out = capsys.readouterr().out
    assert "--eval_only: the run's own" not in out and "| float32 |" in out, out


@pytest.mark.parametrize("pack", [False, True])
def test_eval_only_says_the_tokens_it_scores_from_the_start(corpus, tmp_path, capsys, pack):
    """--eval_tokens 500 is scored to the end of the row (or --pack's window of 33) that reaches it: the start said
    "the first 500 validation tokens" and the result line, of the same set, 528. Both say the set's count."""
    train.main(base_args(corpus, tmp_path, 2, *(["--pack"] if pack else [])))
    capsys.readouterr()
    train.main(eval_args(corpus, tmp_path, "--eval_tokens", "500"))
    out = capsys.readouterr().out
    start = re.search(r"the first ([\d,]+) validation tokens \(--eval_tokens 500, to the end of the (\w+) that "
                      r"reaches it\)", out)
    end = re.search(r"\| ([\d,]+) validation tokens \(", out)
    assert start and end and start.group(1) == end.group(1), out
    assert start.group(2) == ("window" if pack else "row") and int(start.group(1)) > 500
    if pack:  # whole windows of --max_length 32 + 1
        assert int(start.group(1)) % 33 == 0, start.group(1)


def test_eval_only_takes_any_batch_and_data_but_refuses_another_model(corpus, tmp_path, capsys):
    """Evaluation depends on the model and the tokenizer alone: the training run's batch, schedule, optimizer and
    seed need not be repeated, and another model is one line naming its flags. The batch need not divide an update
    (there is none): the validation tokens are the same at any batch size."""
    train.main(base_args(corpus, tmp_path, 2, "--optimizer", "adam8bit", "--seed", "5"))
    capsys.readouterr()
    train.main(eval_args(corpus, tmp_path, "--batch_size", "3", "--max_length", "16"))
    out = capsys.readouterr().out
    assert f"{tmp_path}/ckpt.pt at step 2 | val loss" in out
    assert "--eval_only: batches of 3 sequences of 16 tokens per device, the first " in out
    assert "accum" not in out and "per update" not in out, "the header of a training run"
    tokens = [re.search(r"([\d,]+) validation tokens \(", out).group(1)]
    train.main(eval_args(corpus, tmp_path, "--batch_size", "5", "--max_length", "16"))
    tokens.append(re.search(r"([\d,]+) validation tokens \(", capsys.readouterr().out).group(1))
    assert tokens[0] == tokens[1], tokens
    # the set's tokens, as the start said them (here all the shards hold); the scored targets are one fewer a row,
    # and were what this line called the validation tokens
    said = re.search(r"hold ([\d,]+) tokens at --max_length 16", out).group(1)
    scored = re.search(r"validation tokens \(([\d,]+) targets scored", out).group(1)
    assert tokens[0] == said and int(scored.replace(",", "")) < int(said.replace(",", "")), out
    assert f"the first {said} validation tokens\n" in out, "the shards' tokens, not the --eval_tokens beyond them"
    with pytest.raises(SystemExit, match=r"^--eval_only: .* holds another model: method sltrain \(now full\); pass "
                                         r"the --size, --method"):
        train.main(eval_args(corpus, tmp_path, "--method", "full"))


def test_eval_only_refuses_the_training_flags_it_would_not_read(corpus, tmp_path, capsys):
    """A flag is honored or refused: --eval_only reads the model, the device, the batch and the validation tokens;
    the training flags of a command line it is added to are named in one line, before the checkpoint is read."""
    for extra, named in ((["--lr", "1e-3"], "--lr: "), (["--optimizer", "adam8bit", "--per_layer"], "--optimizer, "
                         "--per_layer: "), (["--beta1", "0.9"], "--beta1: "), (["--total_batch_size", "8"],
                         "--total_batch_size: "), (["--overwrite"], "--overwrite: "), (["--seed", "42"], "--seed: ")):
        with pytest.raises(SystemExit):  # the values of the defaults (beta1 0.9, seed 42) are refused too: given
            train.main(eval_args(corpus, tmp_path / "none", *extra))
        err = capsys.readouterr().err
        assert f"error: {named}not read by --eval_only" in err and ("drop them" if "," in named else "drop it") in err
    assert not (tmp_path / "none").exists()
    ok = flags.get_args(eval_args(corpus, tmp_path, "--method", "lowrank", "--rank", "8", "--alpha", "16", "--dtype",
                                  "float32", "--device", "cpu", "--pack", "--eval_tokens", "100"))
    assert (ok.eval_only, ok.batch_size, ok.total_batch_size, ok.gradient_accumulation) == (True, 4, None, None)


def test_tok_s_counts_trained_tokens_not_padding(corpus, tmp_path):
    # 256-token rows of documents much shorter than that: most positions are padding, which trains nothing
    train.main(base_args(corpus, tmp_path, 1, "--max_length", "256"))
    row = metrics(tmp_path)[0][0]
    counted = row["tokens_per_s"] * row["ms_per_step"] / 1000
    assert counted < 0.9 * 8 * 255, f"tok/s counts {counted:.0f} tokens per update: padding is counted"


def test_ms_per_step_and_tok_s_leave_out_checkpoint_writes(corpus, tmp_path, monkeypatch):
    # a checkpoint write is not training: at 7b it takes minutes, and counted in the row after it, that row's tok/s
    # would fall to a fraction of the true rate every --save_every updates
    save, seconds = checkpoint.save, 1.5
    monkeypatch.setattr(checkpoint, "save", lambda path, state: (time.sleep(seconds), save(path, state)))
    train.main(base_args(corpus, tmp_path, 4, "--save_every", "2"))
    after_save = metrics(tmp_path)[0][2]  # step 3: its interval began with the checkpoint of step 2
    assert after_save["step"] == 3 and after_save["ms_per_step"] < 500 * seconds, \
        f"step 3 took {after_save['ms_per_step']:.0f} ms: the {seconds} s checkpoint write was counted as training"


def test_amp_keeps_float32_parameters_and_computes_in_bf16(corpus, tmp_path):
    fp32, amp = tmp_path / "fp32", tmp_path / "amp"
    train.main(base_args(corpus, fp32, 6))
    train.main(base_args(corpus, amp, 6, "--amp"))
    state = final_state(amp)
    assert state["args"]["amp"] and state["args"]["dtype"] == "float32"
    assert all(t.dtype == torch.float32 for t in state["model"].values() if t.is_floating_point())
    a, b = metrics(fp32)[0], metrics(amp)[0]
    assert a[-1]["loss"] < a[0]["loss"] and b[-1]["loss"] < b[0]["loss"]
    # bf16 matmuls: close to the float32 run, but not the same numbers
    assert all(abs(ra["loss"] - rb["loss"]) < 0.05 * ra["loss"] for ra, rb in zip(a, b))
    assert any(ra["loss"] != rb["loss"] for ra, rb in zip(a, b))


@pytest.mark.parametrize("optimizer", ["adam8bit", "adam8bit_per_layer", "galore_adam8bit_per_layer"])
def test_compile_also_compiles_the_8bit_step(corpus, tmp_path, optimizer):
    for extra, compiled in (([], False), (["--compile"], True)):
        args = train.get_args(base_args(corpus, tmp_path, 2, "--method", "full", "--optimizer", optimizer, *extra))
        config = config_for("tiny", method="full", vocab_size=96)
        run = train.build(args, config, torch.device("cpu"), torch.float32, False, None)
        assert all(o.compile is compiled for o in run.optimizers), (optimizer, extra)
        assert all((block._compiled_call_impl is not None) is compiled for block in run.model.layers), "each block"
        assert not hasattr(run.model, "_orig_mod"), "compiled in place: the checkpoint keeps its names"


def test_compiled_blocks_share_one_graph_and_keep_per_layer_updates():
    """model.compile_blocks (train.py --compile): one graph for every block, the same losses as eager to float32
    rounding, and per-layer updates that still free every gradient by the end of backward."""
    import optim
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = LLaMA(config_for("tiny", method="sltrain", vocab_size=96, n_layers=3))
        if compiled:
            model.compile_blocks(backend="aot_eager")  # AOTAutograd as inductor uses it, without code generation
        train.attach_per_layer(model, lambda ps: optim.Adam8bit(ps, lr=1e-3, min_8bit_size=65))
        idx = torch.randint(96, (4, 2, 17), generator=torch.Generator().manual_seed(0))
        losses[compiled] = []
        for x in idx:
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            losses[compiled].append(loss.item())
            assert all(p.grad is None for p in model.parameters()), "a gradient outlived its layer's update"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1, "each block compiled apart"
    assert losses[True] == pytest.approx(losses[False], rel=1e-5) and losses[True][-1] < losses[True][0]


def test_a_compiled_evaluation_compiles_once_and_its_filled_rows_change_nothing(corpus):
    """The validation set's last batch is filled up with rows of padding: a short one would make a compiled block
    compile once more (a new shape) after the evaluation's own graph (no gradients). The rows change neither the
    loss nor the count of tokens."""
    batches = data.validation_batches(*corpus, 3, 32, 3000)  # 40 documents: 13 batches and one of 1
    counted = [(y != -1).any(1) for _, y in batches]
    assert not counted[-1].all(), "the last batch is filled up"
    torch.manual_seed(0)
    model, cpu, stop = LLaMA(config_for("tiny", method="sltrain", vocab_size=96)), torch.device("cpu"), {"signal": None}
    want = train.evaluate(model, [(x[c], y[c]) for (x, y), c in zip(batches, counted)], cpu, 0, 1, stop)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.compile_blocks(backend="aot_eager")
    model(*batches[0])[1].backward()  # the training graph
    got = train.evaluate(model, batches, cpu, 0, 1, stop)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2, "training, then evaluation"
    assert got[2] == want[2] and got[0] == pytest.approx(want[0], rel=1e-6)


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adam8bit_per_layer"], ["--amp"],
                                   ["--method", "full", "--optimizer", "galore_adam8bit", "--galore_update_gap", "2"]],
                         ids=["adamw", "adam8bit-per-layer", "amp", "galore-8bit"])
def test_no_host_sync_between_log_steps(corpus, tmp_path, capsys, extra):
    train.main(base_args(corpus, tmp_path, 8, "--log_every", "4", "--eval_every", "8", "--sync_debug", *extra))
    assert "sync_debug: 6 updates between log steps watched; host syncs: none" in capsys.readouterr().out


def test_no_host_sync_between_log_steps_under_torchrun_with_accumulation(corpus, tmp_path):
    # the ranks agree on a signal before every micro-batch after an update's first: an all-reduce of a host tensor,
    # which waits for the other process, never for a device, and is read as host memory
    out = run_torchrun(base_args(corpus, tmp_path, 6, "--batch_size", "2", "--log_every", "3", "--sync_debug"))
    assert "batch 2 x 2 accum x 2" in out
    assert "sync_debug: 4 updates between log steps watched; host syncs: none" in out


@pytest.mark.parametrize("method,optimizer,per_layer", [("sltrain", "adam8bit", True), ("full", "adamw", False),
                                                        ("sltrain", "adamw", False)])
def test_no_pageable_copy_to_the_device_in_a_step(monkeypatch, method, optimizer, per_layer):
    """On a device (meta stands in for the GPU: a step runs there, without data) the micro-batches arrive pinned
    and the step fills its scalars on the device: no copy from pageable memory, which CUDA may make wait."""
    mark_pinning(monkeypatch)
    device = torch.device("meta")
    model = LLaMA(config_for("tiny", method=method), device=device)
    make = {"adamw": lambda ps: train.AdamW(ps, lr=1e-3), "adam8bit": lambda ps: train.Adam8bit(ps, lr=1e-3)}[optimizer]
    if per_layer:
        per, opt, scheduler = train.attach_per_layer(model, make, lr_lambda=lambda k: 1.0), None, None
    else:
        per, opt = None, make(list(model.parameters()))
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    run = train.Run(model, model, opt, scheduler, per, model.config, device, rank=0, world=1)
    batches = iter([(torch.randint(96, (2, 16)), torch.randint(-1, 96, (2, 16))) for _ in range(6)])
    syncs = HostSyncs()
    for _ in range(3):
        micro_batches, bad_line = train.read_update(batches, 2, device, 1)
        assert bad_line is None and all(x.is_pinned() and y.is_pinned() for x, y, _ in micro_batches)
        with syncs.watch():
            loss, norm, n_total = train.train_step(SimpleNamespace(grad_clipping=1.0), run, micro_batches)
        assert loss.device == norm.device == n_total.device == device
    assert syncs.summary() == "none" and syncs.blocks == 3


def test_resume_between_log_rows_is_bit_exact(corpus, tmp_path):
    # stopped at step 3 with --log_every 2: the row of step 4 still averages updates 3 and 4
    every = ["--log_every", "2", "--eval_every", "3"]
    train.main(base_args(corpus, tmp_path / "straight", 6, *every))
    train.main(base_args(corpus, tmp_path / "split", 6, "--stop_after", "3", *every))
    train.main(base_args(corpus, tmp_path / "split", 6, "--resume", *every))
    a, b = metrics(tmp_path / "straight")[0], metrics(tmp_path / "split")[0]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == [(r["step"], r["loss"], r["grad_norm"]) for r in b]
    assert metrics(tmp_path / "split")[1] == metrics(tmp_path / "straight")[1]


def test_a_resume_over_changed_validation_shards_is_refused_unless_it_asks_for_a_new_set(corpus, tmp_path, capsys):
    folder = tmp_path / "c4"
    shutil.copytree(corpus[0], folder)
    data_dir = (str(folder), corpus[1])
    train.main(base_args(data_dir, tmp_path / "out", 6, "--stop_after", "2", "--batch_size", "2"))
    shard = folder / "c4-validation.00000-of-00001.json.gz"
    kept = shard.read_bytes()
    shard.write_bytes(gzip.compress(b"".join(gzip.decompress(kept).splitlines(keepends=True)[::-1])))  # reordered
    with pytest.raises(SystemExit, match=rf"^--resume: the validation shards in {folder} have changed since "
                                         rf"{tmp_path}/out/ckpt.pt was evaluated on them, .* restore them, or pass "
                                         r"another --eval_tokens to evaluate on a new set from here$"):
        train.main(base_args(data_dir, tmp_path / "out", 6, "--resume"))  # at another batch size: the same set
    train.main(base_args(data_dir, tmp_path / "new", 6, "--resume", str(tmp_path / "out" / "ckpt.pt"),
                         "--eval_tokens", "2000"))  # a new set, asked for
    assert "eval_tokens 3000 -> 2000" in capsys.readouterr().out
    shard.write_bytes(kept)
    train.main(base_args(data_dir, tmp_path / "out", 6, "--resume"))
    assert final_state(tmp_path / "out")["step"] == 6


def test_under_torchrun_only_rank_0_says_what_is_wrong(corpus, tmp_path, monkeypatch, capsys):
    """Once per machine: local rank 0 says it (a path may be on one machine's disk only: rank 8 of two machines of 8
    says its own)."""
    torchrun_variables(monkeypatch, rank=1, local_rank=1, world=2)  # refused before any process group is made
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 2, "--lr", "0"))
    assert e.value.code == 2 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 2, "--resume"))  # no checkpoint there
    assert e.value.code == 1
    torchrun_variables(monkeypatch, rank=8, local_rank=0, world=16)
    with pytest.raises(SystemExit, match="--resume: no checkpoint at"):
        train.main(base_args(corpus, tmp_path, 2, "--resume", "--total_batch_size", "64"))


def torchrun_variables(monkeypatch, rank, local_rank, world):
    """The variables torchrun sets for a process (none of these tests makes a process group)."""
    for name, value in dict(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=29500).items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("variables,said", [
    (dict(WORLD_SIZE="2"), "WORLD_SIZE='2' is set without RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: torchrun sets "
                           "them all"),
    (dict(RANK="0", WORLD_SIZE="2"), "is set without LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
    (dict(LOCAL_RANK="1"), "LOCAL_RANK='1' is set without RANK, WORLD_SIZE"),
    (dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"), "is set without MASTER_ADDR, MASTER_PORT"),
    (dict(RANK="0", LOCAL_RANK="abc", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), "torchrun sets whole numbers"),
    (dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="0", MASTER_ADDR="h", MASTER_PORT="1"), "not a process of a torchrun"),
    (dict(RANK="2", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), "not a process of a torchrun"),
])
def test_torchrun_variables_set_in_part_or_unsound_are_one_line_from_every_process(monkeypatch, capsys, variables,
                                                                                   said):
    """A job script's leftovers: WORLD_SIZE alone halved each update in silence (the batch arithmetic counted two
    processes, and one ran); others were a traceback (int(), a KeyError, a ZeroDivisionError), or no word at all
    from a LOCAL_RANK 1 that muted the refusal."""
    for name in flags.TORCHRUN_VARIABLES + ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        train.main(["--size", "tiny", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and "start the run with torchrun, or unset those variables" in err, err
    assert "Traceback" not in err


def test_a_checkpoint_that_stored_an_unused_flag_still_resumes(corpus, tmp_path):
    """Runs before flags.py refused them could store --delta with lowrank, --rank with full, GaLore's flags without
    GaLore: a resume does not compare what the run's method and optimizer do not read."""
    train.main(base_args(corpus, tmp_path, 4, "--method", "lowrank", "--stop_after", "2"))
    state = checkpoint.load(str(tmp_path / "ckpt.pt"))
    state["args"].update(delta=0.0, galore_scale=9.0, relora_reset=5)  # as such a run stored them
    checkpoint.save(str(tmp_path / "ckpt.pt"), {k: v for k, v in state.items() if k != "sha256"})
    train.main(base_args(corpus, tmp_path, 4, "--method", "lowrank", "--resume"))
    assert final_state(tmp_path)["step"] == 4
    with pytest.raises(SystemExit, match="rank 16 \\(now 8\\)"):  # what the method reads is still compared
        train.main(base_args(corpus, tmp_path / "other", 6, "--method", "lowrank", "--rank", "8", "--resume",
                             str(tmp_path)))



@pytest.mark.parametrize("field,value,said", [
    ("qk_norm", True, r"unknown model_config fields \['qk_norm'\]"),
    ("rope_theta", 500000.0, r"rope_theta 500000.0 \(this one's 10000.0\)")], ids=["unknown", "unflagged"])
def test_a_checkpoint_of_a_model_this_model_py_does_not_build_is_refused_by_resume_and_evaluation(corpus, tmp_path,
                                                                                                  field, value, said):
    """A checkpoint whose model_config has a field this model.py lacks, or one no flag sets at another value (another
    version's model) was resumed and evaluated as this version's model without a word, and the resume's checkpoints
    dropped the field; checkpoint.load_model (sample.py, export.py) refused the unknown one. Now both refuse it."""
    train.main(base_args(corpus, tmp_path, 4, "--stop_after", "2"))
    state = checkpoint.load(str(tmp_path / "ckpt.pt"))
    state["model_config"][field] = value
    checkpoint.save(str(tmp_path / "ckpt.pt"), state)
    for command, argv in (("--resume", base_args(corpus, tmp_path, 4, "--resume")),
                          ("--eval_only", eval_args(corpus, tmp_path))):
        with pytest.raises(SystemExit, match=rf"^{command}: {tmp_path}/ckpt.pt: {said}; it was written by another "
                                             r"version of model.py, whose model this one does not build"):
            train.main(argv)
    assert checkpoint.load(str(tmp_path / "ckpt.pt"))["model_config"][field] == value, "the checkpoint is as it was"
