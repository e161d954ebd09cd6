"""
Tests of analyze.py and of train.py's --init_from, --freeze and --support_seed, on tiny models trained here.

    python -m pytest -q test_analyze.py
"""

import gc
import json
import math
import os
import re
import weakref
import xml.etree.ElementTree as ET

import pytest
import torch

import analyze
import checkpoint
import estimate_memory
import sllinear
import train
from checkpoint import load_model
from data import validation_batches
from sllinear import SLLinear
from test_data import quiet, read_then_stop
from test_train import base_args, corpus, disk_full_from, file_size_limit, other_tokenizer  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def dense_ckpt(corpus, tmp_path_factory):  # noqa: F811
    """A tiny full-rank model trained for a few updates on the tiny corpus."""
    out = tmp_path_factory.mktemp("full")
    train.main(base_args(corpus, out, 6, "--method", "full", "--lr", "1e-2"))
    return str(out / "ckpt.pt")


@pytest.fixture(scope="module")
def sltrain_ckpt(corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sl")
    train.main(base_args(corpus, out, 6, "--method", "sltrain", "--lr", "1e-2"))
    return str(out / "ckpt.pt")


def test_spectrum_split_adds_up_to_sigma(sltrain_ckpt, tmp_path, capsys):
    model, _ = load_model(sltrain_ckpt)
    rows = analyze.spectrum(model)
    assert len(rows) == 7 * model.config.n_layers
    for r in rows:
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        err = (f64(r["sigma_lowrank"]) + f64(r["sigma_sparse"]) - f64(r["sigma"])).abs().max().item()
        assert err < 1e-9, f"{r['name']}: low-rank + sparse parts differ from Σ by {err:.2e}"
        assert min(r["sigma_sparse"]) != max(r["sigma_sparse"]), "the sparse part must carry a spectrum of its own"
    analyze.main(["spectrum", sltrain_ckpt, "--figures", str(tmp_path)])
    out = capsys.readouterr().out
    assert "q_proj" in out and "sparse share" in out
    figures = sorted(p.name for p in tmp_path.glob("*.svg"))
    assert figures == sorted(f"spectrum_{k}.svg" for k in analyze.KINDS)
    root = ET.parse(tmp_path / "spectrum_q_proj.svg").getroot()  # well-formed XML, three lines in the plot
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 3


def test_spectrum_of_full_rank_residual(dense_ckpt, capsys):
    model, _ = load_model(dense_ckpt)
    rows = analyze.spectrum(model, rank=8, threshold=0.04)
    W = model.layers[0].attn.q_proj.weight.double()
    U, S, Vh = torch.linalg.svd(W)
    residual = W - (U[:, :8] * S[:8]) @ Vh[:8]
    row = rows[0]
    assert row["name"] == "layers.0.attn.q_proj" and row["rank"] == 8
    assert math.isclose(row["residual_below"], (residual.abs() < 0.04).double().mean().item())
    assert math.isclose(row["residual_max"], residual.abs().max().item(), rel_tol=1e-9)
    analyze.main(["spectrum", dense_ckpt, "--json", "--rank", "8"])
    assert json.loads(capsys.readouterr().out)[0]["residual_below"] == row["residual_below"]


def test_prune_variants_and_evaluation(dense_ckpt, capsys):
    model, _ = load_model(dense_ckpt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    variants = analyze.prune_weights(model, rank=4, delta=0.05, seed=0)
    W = model.layers[1].mlp.down_proj.weight.double()
    L0 = analyze.best_rank(W, 4)[0]
    R = W - L0
    nnz = int(0.05 * W.numel())
    top = variants["L0 + top"]["layers.1.mlp.down_proj"].double()
    rand = variants["L0 + random"]["layers.1.mlp.down_proj"].double()
    assert torch.allclose(variants["L0"]["layers.1.mlp.down_proj"].double(), L0, atol=1e-6)
    kept = (top - L0).abs() > 1e-7
    assert kept.sum() <= nnz and (top - L0)[kept].abs().min() >= R.abs().flatten().topk(nnz).values[-1] - 1e-6
    assert torch.linalg.matrix_norm(W - top) <= torch.linalg.matrix_norm(W - rand), "top-δ is the best δ to keep"
    analyze.main(["prune", dense_ckpt, "--rank", "4", "--delta", "0.05", "--eval_tokens", "600", "--json"])
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"full", "L0", "L0 + top", "L0 + random"}
    assert all(math.isfinite(v["val_ppl"]) for v in results.values())
    full, _ = load_model(dense_ckpt)
    after = full.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "pruning must restore the weights it evaluated"


def test_prune_restores_the_weights_when_an_evaluation_is_interrupted(dense_ckpt, monkeypatch):
    """An evaluation cut short (Ctrl-C in a notebook, an error) left the model holding the pruned variant it was
    evaluating: the caller's "full" model was then L0 + top, without a word."""
    model, ckpt = load_model(dense_ckpt)
    run = ckpt["args"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = validation_batches(run["data_dir"], run["tokenizer"], 8, run["max_length"], eval_tokens=300)
    evaluate, calls = train.evaluate, []

    def interrupted(*args):  # the full model's and L0's evaluations run; L0 + top's is interrupted
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(*args)

    monkeypatch.setattr(train, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        analyze.prune(model, batches, rank=4, delta=0.05)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, f"the interrupted prune left pruned weights in {changed[:3]}..."


def test_prune_refuses_a_batch_beyond_the_memory_before_reading_the_data(dense_ckpt, monkeypatch):
    """--batch_size 10^12 once padded the validation set up to 10^12 rows. Refused before the data is read, naming
    the largest batch that fits: the model, four copies of its projections and an evaluation forward."""
    model, ckpt = load_model(dense_ckpt)
    run = ckpt["args"]
    need = lambda b: analyze.prune_memory_refusal(model, run, b)  # noqa: E731
    copies = 4 * sum(m.weight.nbytes for _, _, _, m in analyze.projections(model))
    one = copies + 1e9 * analyze.estimate("tiny", "full", batch_size=1, max_length=32, dtype="float32",
                                          vocab_size=96)["eval_gb"]
    row = 1e9 * analyze.estimate("tiny", "full", batch_size=2, max_length=32, dtype="float32",
                                 vocab_size=96)["eval_gb"] + copies - one
    monkeypatch.setattr(analyze, "memory_there", lambda device: ((one + 6.5 * row) / 0.8, 0.8, "a small machine"))
    assert need(7) is None and "--batch_size 8 needs about" in need(8) and need(8).endswith("pass --batch_size 7")
    monkeypatch.setattr(analyze, "validation_batches", lambda *a, **k: pytest.fail("read the data first"))
    with pytest.raises(SystemExit, match=r"^analyze.py prune: --batch_size 1000000000000 needs about .* GB \(the "
                                         r"model, four copies of its projections and an evaluation forward\), more "
                                         r"than 80% of a small machine; pass --batch_size 7$"):
        analyze.main(["prune", dense_ckpt, "--rank", "4", "--batch_size", str(10 ** 12)])
    monkeypatch.setattr(analyze, "memory_there", lambda device: (one / 2, 0.8, "a tiny machine"))
    with pytest.raises(SystemExit, match=r"more than 80% of a tiny machine; use a machine with more memory$"):
        analyze.main(["prune", dense_ckpt, "--rank", "4"])


def test_prune_refuses_a_batch_beyond_the_memory_before_reading_the_checkpoint(dense_ckpt, monkeypatch):
    """The memory the pruning needs is known from the checkpoint's model_config at a quick look: a model too large for
    this machine is refused before it is read whole and cast to float32, which would take minutes at 7b, or be the
    very allocation the OS kills the process for."""
    monkeypatch.setattr(analyze, "memory_there", lambda device: (1e6, 0.8, "a tiny machine"))
    monkeypatch.setattr(analyze, "load_model", lambda *a, **k: pytest.fail("read the checkpoint first"))
    with pytest.raises(SystemExit, match=r"^analyze.py prune: --batch_size 8 needs about .* more than 80% of a tiny "
                                         r"machine; use a machine with more memory$"):
        analyze.main(["prune", dense_ckpt, "--rank", "4"])


def test_prune_frees_the_checkpoint_before_it_evaluates(dense_ckpt, monkeypatch):
    """Of the checkpoint read, prune keeps the model (float32, as its memory check counts it) and the run's args: the
    optimizer's state (twice the model's parameters with AdamW) and the tensors as stored are freed first, as
    export.py and sample.py free them."""
    stored = []

    def load(path):
        model, ckpt = load_model(path)
        stored.append(weakref.ref(next(t for t in ckpt["optimizer"]["state"].values())["exp_avg"]))
        return model, ckpt

    def prune(model, batches, rank, delta, seed=0):
        gc.collect()
        assert stored[0]() is None, "the optimizer's state is held through the evaluations"
        return {"full": (1.0, math.e)}

    monkeypatch.setattr(analyze, "load_model", load)
    monkeypatch.setattr(analyze, "prune", prune)
    analyze.main(["prune", dense_ckpt, "--rank", "4", "--json"])


def test_prune_says_when_the_validation_shards_hold_fewer_than_eval_tokens(dense_ckpt, capsys):
    """As train.py does: --eval_tokens past what the shards hold is every token they hold, and said."""
    _, ckpt = load_model(dense_ckpt)
    run = ckpt["args"]
    analyze.main(["prune", dense_ckpt, "--rank", "4", "--eval_tokens", "600", "--json"])
    assert "note" not in capsys.readouterr().err
    analyze.main(["prune", dense_ckpt, "--rank", "4", "--eval_tokens", "100000", "--json"])
    held = validation_batches(run["data_dir"], run["tokenizer"], 8, run["max_length"], eval_tokens=100000).tokens
    assert f"analyze.py prune: note: the validation shards in {run['data_dir']} hold {held:,} tokens, fewer than " \
        f"--eval_tokens 100,000: every evaluation covers those {held:,}" in capsys.readouterr().err


def test_prune_refuses_a_factored_checkpoint(sltrain_ckpt):
    with pytest.raises(SystemExit, match="full-rank checkpoint"):
        analyze.main(["prune", sltrain_ckpt, "--rank", "4", "--eval_tokens", "1000"])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("support", ["random", "top"])
@pytest.mark.parametrize("packed", [False, True], ids=["flat", "packed"])
def test_init_from_leaves_out_exactly_the_truncated_part(dense_ckpt, support, device, packed):
    """Also with the model on a GPU, as train.py builds it there: the checkpoint loads on the CPU, so the support
    (on the model's device) must pick the residual where it is. And with packed supports (--packed_support)."""
    from model import LLaMA, config_for
    dense, _ = load_model(dense_ckpt)
    model = LLaMA(config_for("tiny", method="sltrain", rank=8, vocab_size=dense.config.vocab_size,
                             packed_support=packed), device=device)
    analyze.init_from_dense(model, dense_ckpt, support=support)
    model.cpu()
    for name, module in model.named_modules():
        if not isinstance(module, SLLinear):
            continue
        W0 = dense.get_submodule(name).weight.double()
        L0 = analyze.best_rank(W0, 8)[0]
        residual = (W0 - L0).view(-1)
        off = torch.ones_like(residual, dtype=torch.bool)
        assert module.packed == packed
        off[module.support().long()] = False
        expected = torch.where(off, residual, torch.zeros_like(residual)).view_as(W0)
        err = (W0 - module.merged_weight().double() - expected).abs().max().item()
        assert err < 1e-5, f"{name}: W0 - merged W differs from the residual off the support by {err:.2e}"
        if support == "top":
            kept = residual.abs()[module.support().long()].min()
            assert kept >= residual.abs()[off].max(), f"{name}: the top support misses a larger entry"
    for name in ("embed.weight", "lm_head.weight", "norm.weight", "layers.1.mlp_norm.weight"):
        assert torch.equal(model.state_dict()[name], dense.state_dict()[name]), f"{name} not copied"


def test_init_from_into_bf16_is_w0_on_the_support_to_one_rounding(dense_ckpt):
    """In bf16 (a GPU's default) B and A are rounded as they are copied: V is the residual of the rounded factors,
    so that on the support s·BA + V misses W0 by V's rounding alone, not by the factors' too (on this checkpoint's
    projections, 2.0e-3 of W0 on average, relative, where it is now 1.1e-3)."""
    from model import LLaMA, config_for
    dense, _ = load_model(dense_ckpt)
    model = LLaMA(config_for("tiny", method="sltrain", rank=8, vocab_size=dense.config.vocab_size)).bfloat16()
    analyze.init_from_dense(model, dense_ckpt)
    errors = []
    for name, module in model.named_modules():
        if isinstance(module, SLLinear):
            W0 = dense.get_submodule(name).weight.double().view(-1)[module.indices.long()]
            ours = (module.scale * module.B.double() @ module.A.double()).view(-1)[module.indices.long()]
            errors.append((torch.linalg.vector_norm(ours + module.values.double() - W0)
                           / torch.linalg.vector_norm(W0)).item())
    assert sum(errors) / len(errors) < 1.6e-3, errors


def test_freeze_lowrank_trains_only_the_sparse_values(corpus, dense_ckpt, tmp_path):  # noqa: F811
    train.main(base_args(corpus, tmp_path, 2, "--method", "sltrain", "--rank", "8", "--init_from", dense_ckpt,
                         "--support", "top", "--freeze", "lowrank", "--lr", "1e-2", "--eval_tokens", "300"))
    from model import LLaMA, config_for
    start = LLaMA(config_for("tiny", method="sltrain", rank=8, vocab_size=96))
    analyze.init_from_dense(start, dense_ckpt, support="top")
    end = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    for name, t in start.state_dict().items():  # L0, the support, embeddings, norms and head all stay
        if name.endswith(".values"):
            assert not torch.equal(end[name], t), f"{name} did not train"
        else:
            assert torch.equal(end[name], t), f"{name} changed under --freeze lowrank"


def test_support_seed_draws_supports_apart_from_seed():
    from argparse import Namespace
    from model import LLaMA, config_for

    def model_for(seed, support_seed, packed=False):
        torch.manual_seed(seed)
        model = LLaMA(config_for("tiny", method="sltrain", vocab_size=96, packed_support=packed))
        args = Namespace(support_seed=support_seed, init_from=None, support="random", freeze=None)
        analyze.prepare_for_training(model, args, resuming=False)
        supports = {name: m.support() for name, m in model.named_modules() if isinstance(m, SLLinear)}
        return supports, model.state_dict()["embed.weight"]

    a, emb_a = model_for(1, 7)
    b, emb_b = model_for(2, 7)
    c, emb_c = model_for(1, 8)
    packed, _ = model_for(2, 7, packed=True)
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], packed[k]) for k in a), \
        "same --support_seed, same supports whatever --seed, packed or not"
    assert not torch.equal(emb_a, emb_b), "--seed still sets the initialization"
    assert torch.equal(emb_a, emb_c) and not any(torch.equal(a[k], c[k]) for k in a), "only the supports differ"


def test_bad_flags_are_refused_before_work(corpus, dense_ckpt, tmp_path, capsys):  # noqa: F811
    for extra, message in [(["--method", "relora", "--init_from", dense_ckpt], "--init_from"),
                           (["--support", "top"], "--support top"),
                           (["--method", "full", "--freeze", "lowrank"], "--freeze lowrank"),
                           (["--method", "lowrank", "--freeze", "lowrank"], "--freeze lowrank"),
                           (["--freeze", "lowrank", "--delta", "0"], "which --delta 0 removes: pass a --delta above 0"),
                           (["--method", "lowrank", "--support_seed", "3"], "--support_seed")]:
        with pytest.raises(SystemExit):
            train.get_args(base_args(corpus, tmp_path, 1, *extra))
        assert message in capsys.readouterr().err


def test_an_init_from_that_does_not_fit_is_one_line(corpus, dense_ckpt, sltrain_ckpt, tmp_path,  # noqa: F811
                                                     monkeypatch, capsys):
    """One that is damaged, not a model, not full-rank, or of another shape stops the run with one line naming it and
    the fix, and nothing is written. Its method, shape and tokenizer are seen at a quick look, and a file that look
    cannot read is read whole at once: all before the data is read and the model built (at 7b, minutes). Only a
    damaged one that the quick look reads (a changed byte in its tensors) is found later, when read whole into the
    built model. A run's folder names its ckpt.pt, as for --resume."""
    read = []
    validation_batches = train.validation_batches
    monkeypatch.setattr(train, "validation_batches", lambda *a, **k: (read.append(1), validation_batches(*a, **k))[1])
    cut = tmp_path / "cut.pt"
    cut.write_bytes(open(dense_ckpt, "rb").read()[:5000])
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(open(dense_ckpt, "rb").read())
    with open(flipped, "r+b") as f:  # a byte of the largest tensor, the embedding: mapped, not checked, by a look
        f.seek(flipped.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    other = tmp_path / "other.pt"  # trained with another tokenizer of as many pieces: only its digest tells
    ckpt = checkpoint.load(dense_ckpt)
    ckpt["args"]["tokenizer_sha256"] = "0" * 64
    checkpoint.save(other, ckpt)
    no_model = tmp_path / "optimizer.pt"
    checkpoint.save(no_model, {"optimizer": ckpt["optimizer"], "step": 1})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 4.0}\n')
    for path, extra, message in [(sltrain_ckpt, [], r"a sltrain checkpoint; pass a full-rank checkpoint \(train.py "
                                                     r"--method full, or export.py --merged of any run\)"),
                                 (cut, [], "cannot be read"),
                                 (flipped, [], "fails its sha256 check"),
                                 (no_model, [], "holds no model .*; pass a full-rank checkpoint"),
                                 (metrics, [], "not a checkpoint"),
                                 (dense_ckpt, ["--size", "60m"], "dim 64 differs from this model's 512; pass the "
                                                                 "--size it was trained at"),
                                 (dense_ckpt, ["--ffn_dim", "128"], "ffn_dim 176 differs from this model's 128; pass "
                                                                    "--ffn_dim 176"),
                                 (other, [], r"trained with another tokenizer \(sha256 000000000000\.\.\.\) than "
                                             r"--tokenizer \(\w{12}\.\.\.\); pass the one it was trained with")]:
        argv = [*base_args(corpus, tmp_path / "out", 1, "--method", "sltrain", "--init_from", str(path)), *extra]
        read.clear()
        with pytest.raises(SystemExit, match=rf"^--init_from {path}: .*{message}") as e:
            train.main(argv)
        assert "\n" not in str(e.value) and not (tmp_path / "out" / "ckpt.pt").exists()
        assert bool(read) == (path == flipped), "refused before the data is read, but for the changed byte"
    run = tmp_path / "run"  # the folder of the dense run: its ckpt.pt
    run.mkdir()
    (run / "ckpt.pt").write_bytes(open(dense_ckpt, "rb").read())
    args = train.get_args(base_args(corpus, tmp_path / "out", 1, "--method", "sltrain", "--init_from", str(run)))
    assert args.init_from == str(run / "ckpt.pt")
    for extra, message in [(["--init_from", str(tmp_path / "none")], "no checkpoint there; pass a full-rank ckpt.pt"),
                           (["--method", "relora", "--init_from", str(run)],
                            "ReLoRA starts from its own: pass --method sltrain or lowrank, or drop --init_from")]:
        with pytest.raises(SystemExit):
            train.get_args(base_args(corpus, tmp_path / "out", 1, "--method", "sltrain", *extra))
        assert message in capsys.readouterr().err


def test_curves_overlay(corpus, tmp_path):  # noqa: F811
    paths = []
    for i, lines in enumerate([[(10, 5.0), (20, 4.0)], [(10, 5.5), (20, 4.2), (20, 4.1)]]):
        (tmp_path / f"run{i}").mkdir()
        path = tmp_path / f"run{i}" / "metrics.jsonl"
        path.write_text("".join(json.dumps({"step": s, "val_loss": v, "val_ppl": math.exp(v)}) + "\n"
                                for s, v in lines) + json.dumps({"step": 20, "loss": 3.0}) + "\n")
        paths.append(str(path))
    assert analyze.read_curve(paths[1], "val_loss") == ([10, 20], [5.5, 4.1]), "a repeated step keeps the last row"
    analyze.main(["curves", *paths, "--key", "val_loss", "--out", str(tmp_path / "c.svg")])
    root = ET.parse(tmp_path / "c.svg").getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "run0" in texts and "run1" in texts
    assert not list(root.iter("{http://www.w3.org/2000/svg}circle")), "lines of several points need no dots"
    once = write_metrics(tmp_path / "once" / "metrics.jsonl", [{"step": 20, "val_loss": 4.5}])  # one evaluation
    analyze.main(["curves", paths[0], once, "--key", "val_loss", "--out", str(tmp_path / "d.svg")])
    dots = list(ET.parse(tmp_path / "d.svg").getroot().iter("{http://www.w3.org/2000/svg}circle"))
    assert len(dots) == 1, "a run evaluated once is drawn as a dot: a line of one point shows nothing"
    # a run's folder, as the other tools take it (with or without a trailing slash): its metrics.jsonl, its name
    analyze.main(["curves", str(tmp_path / "run0"), f"{tmp_path / 'run1'}/", "--key", "val_loss", "--out",
                  str(tmp_path / "e.svg")])
    assert (tmp_path / "e.svg").read_text() == (tmp_path / "c.svg").read_text()


# ----------------------------------------------------------------------------- ReLoRA, and bad input of every kind

@pytest.fixture(scope="module")
def relora_ckpt(corpus, tmp_path_factory):  # noqa: F811
    """A tiny ReLoRA model that merged s·BA into W0 once (at update 3) and trained new factors after."""
    out = tmp_path_factory.mktemp("relora")
    train.main(base_args(corpus, out, 6, "--method", "relora", "--lr", "1e-2", "--relora_reset", "3",
                         "--relora_warmup", "1", "--warmup_steps", "1"))
    return str(out / "ckpt.pt")


def refusal(capsys, argv):
    """The one-line message of a refused analyze.py command: SystemExit's text, or argparse's p.error line."""
    with pytest.raises(SystemExit) as e:
        analyze.main(argv)
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in message and "\n" not in message, message
    return message


def test_spectrum_of_relora_is_of_the_merged_weight(relora_ckpt, tmp_path, capsys):
    model, _ = load_model(relora_ckpt)
    layer = model.layers[1].mlp.down_proj
    W = (layer.W0 + layer.scale * layer.B @ layer.A).double()
    assert (W - layer.W0.double()).abs().max() > 1e-4, "s·BA must be nonzero for this test to tell W from W0"
    row = next(r for r in analyze.spectrum(model, rank=4) if r["name"] == "layers.1.mlp.down_proj")
    S = torch.linalg.svdvals(W)
    err = (torch.tensor(row["sigma"], dtype=torch.float64) - S).abs().max().item()
    assert err < 1e-5, f"σ differs from that of W0 + s·BA by {err:.2e}"
    assert row["rank"] == 4 and math.isclose(row["energy_top_r"], (S[:4].square().sum() / S.square().sum()).item(),
                                             rel_tol=1e-6)
    analyze.main(["spectrum", relora_ckpt, "--rank", "4", "--threshold", "0.01", "--figures", str(tmp_path)])
    out = capsys.readouterr().out
    assert "energy top-4" in out and "residual < 0.01" in out
    assert len(list(tmp_path.glob("*.svg"))) == 7
    message = refusal(capsys, ["prune", relora_ckpt, "--eval_tokens", "300"])
    assert "full-rank checkpoint" in message and "export.py --merged" in message


@pytest.mark.parametrize("field, value, said", [
    ("qk_norm", True, r"unknown model_config fields \['qk_norm'\]"),
    ("rope_theta", 500000.0, r"rope_theta 500000.0 \(this one's 10000.0\)")], ids=["unknown", "unflagged"])
def test_init_from_refuses_a_checkpoint_of_a_model_this_model_py_does_not_build(dense_ckpt, field, value, said):
    """A full-rank checkpoint of another version's model (a field this model.py lacks, or a rope_theta no flag sets)
    started this one's without a word, as --resume and --eval_only did (they refuse it now): refused the same way."""
    from model import config_for
    state = checkpoint.load(dense_ckpt)
    state["model_config"][field] = value
    config = config_for("tiny", method="sltrain", vocab_size=state["model_config"]["vocab_size"])
    assert analyze.init_refusal("x.pt", checkpoint.load(dense_ckpt), config) is None
    assert re.fullmatch(rf"--init_from x.pt: {said}; it was written by another version of model.py, whose model this "
                        r"one does not build: use that one", analyze.init_refusal("x.pt", state, config))


def test_init_from_refuses_a_relora_model(dense_ckpt):
    from model import LLaMA, config_for
    with pytest.raises(ValueError, match="sltrain or sltrain_ft model, not relora"):
        analyze.init_from_dense(LLaMA(config_for("tiny", method="relora", vocab_size=96)), dense_ckpt)


@pytest.mark.parametrize("argv, message", [
    (["spectrum", "--rank", "-3"], "--rank must be positive and at most 2^63 - 1, got -3"),
    (["spectrum", "--rank", "0"], "--rank must be positive and at most 2^63 - 1, got 0"),
    (["spectrum", "--threshold", "0"], "--threshold must be a positive number"),
    (["spectrum", "--threshold", "nan"], "--threshold must be a positive number"),
    (["spectrum", "--threshold", "inf"], "--threshold must be a positive number"),
    (["prune", "--rank", "0"], "--rank must be positive and at most 2^63 - 1, got 0"),
    (["prune", "--batch_size", "0"], "--batch_size must be positive and at most 2^63 - 1, got 0"),
    (["prune", "--eval_tokens", "-5"], "--eval_tokens must be positive and at most 2^63 - 1, got -5"),
    (["prune", "--eval_tokens", "0"], "--eval_tokens must be positive and at most 2^63 - 1, got 0"),
    (["prune", "--eval_tokens", str(10 ** 23)], f"--eval_tokens must be positive and at most 2^63 - 1, got {10 ** 23}"),
    (["prune", "--batch_size", str(2 ** 63)], f"--batch_size must be positive and at most 2^63 - 1, got {2 ** 63}"),
    (["prune", "--delta", "1"], "--delta must be in [0, 1), got 1.0"),
    (["prune", "--delta", "nan"], "--delta must be in [0, 1), got nan"),
    (["prune", "--seed", str(2**64)], "--seed must fit in 64 bits"),
])
def test_numeric_flags_are_refused_before_the_checkpoint_is_read(argv, message, tmp_path, capsys):
    missing = str(tmp_path / "no_such_ckpt.pt")  # read first, it would say "no checkpoint at" instead
    assert message in refusal(capsys, [argv[0], missing, *argv[1:]])


def test_flags_are_checked_against_the_checkpoint(dense_ckpt, sltrain_ckpt, capsys):
    model, _ = load_model(dense_ckpt)
    rows = analyze.spectrum(model, rank=63)  # tiny: dim 64, so 63 is the largest rank with a residual
    assert rows[0]["rank"] == 63 and rows[0]["residual_max"] > 0, "an explicit rank is used as given"
    with pytest.raises(ValueError, match=r"rank must be in \[1, 64\), got 0"):
        analyze.spectrum(model, rank=0)
    for command in ("spectrum", "prune"):
        message = refusal(capsys, [command, dense_ckpt, "--rank", "1000"])
        assert "--rank must be in [1, 64) for this model, got 1000" in message, message
    message = refusal(capsys, ["spectrum", dense_ckpt, "--figures", dense_ckpt])
    assert f"--figures {dense_ckpt} is a file" in message, message
    for flags in (["--rank", "4"], ["--threshold", "0.01"], ["--rank", "4", "--threshold", "0.01"]):
        message = refusal(capsys, ["spectrum", sltrain_ckpt, *flags])
        assert "is sltrain" in message and "drop them" in message, message


def test_flags_that_do_not_fit_the_checkpoint_are_refused_at_a_quick_look(dense_ckpt, sltrain_ckpt, monkeypatch,
                                                                          capsys):
    """Its method and sizes are in checkpoint.peek's look: refused before the full read and checksum (half a minute
    at 350m, minutes at 7b), as train.py refuses a resume's flags."""
    def refuse_to_load(path, *args, **kwargs):
        raise AssertionError(f"{path} was read whole before the flags were checked against it")

    monkeypatch.setattr(analyze, "load_model", refuse_to_load)
    for argv, message in [(["spectrum", sltrain_ckpt, "--rank", "4"], "is sltrain, shown as Σ split"),
                          (["spectrum", dense_ckpt, "--rank", "1000"], "--rank must be in [1, 64) for this model"),
                          (["prune", sltrain_ckpt], "is sltrain; prune needs a full-rank checkpoint"),
                          (["prune", dense_ckpt, "--rank", "64"], "--rank must be in [1, 64) for this model, got 64")]:
        got = refusal(capsys, argv)
        assert got.startswith(f"analyze.py {argv[0]}: ") and message in got, got


def test_the_default_rank_is_checked_where_it_is_used(corpus, dense_ckpt, tmp_path, capsys):  # noqa: F811
    from checkpoint import load, save
    state = load(dense_ckpt)
    state["model_config"]["rank"] = 100  # a full model's rank is never used in training, so never checked there
    save(tmp_path / "rank100.pt", state)
    message = refusal(capsys, ["spectrum", str(tmp_path / "rank100.pt")])
    assert "got 100 (the checkpoint's rank, the default); pass --rank" in message, message
    analyze.main(["spectrum", str(tmp_path / "rank100.pt"), "--rank", "8"])
    assert "energy top-8" in capsys.readouterr().out
    train.main(base_args(corpus, tmp_path / "sparse", 1, "--method", "sltrain", "--rank", "0", "--delta", "0.1"))
    analyze.main(["spectrum", str(tmp_path / "sparse" / "ckpt.pt")])  # rank 0 is no residual rank: not refused
    assert "q_proj" in capsys.readouterr().out
    message = refusal(capsys, ["spectrum", str(tmp_path / "sparse" / "ckpt.pt"), "--rank", "4"])  # S alone: no split
    assert "is sltrain, shown as its σ alone: drop them" in message, message


def test_non_finite_weights_are_one_line(dense_ckpt, tmp_path, capsys):
    from checkpoint import load, save
    state = load(dense_ckpt)
    state["model"]["layers.0.attn.k_proj.weight"][0, 0] = float("nan")
    save(tmp_path / "nan.pt", state)
    for argv in (["spectrum", str(tmp_path / "nan.pt")], ["prune", str(tmp_path / "nan.pt"), "--eval_tokens", "300"]):
        message = refusal(capsys, argv)
        assert "layers.0.attn.k_proj has non-finite weights" in message, message


def test_non_finite_weights_are_refused_before_any_svd_or_data(dense_ckpt, sltrain_ckpt, tmp_path, monkeypatch,
                                                                capsys):
    """A NaN in the last projection was found only when its turn came: after the SVDs of every projection before it
    (spectrum; at 7b, hours of float64 SVDs on a CPU) or after the validation data was read (prune)."""
    from checkpoint import load, save
    for ckpt, key in ((dense_ckpt, "layers.1.mlp.down_proj.weight"), (sltrain_ckpt, "layers.1.mlp.down_proj.values")):
        state = load(ckpt)
        state["model"][key].view(-1)[-1] = float("nan")
        save(tmp_path / "nan.pt", state)
        with monkeypatch.context() as m:
            m.setattr(torch.linalg, "svd", lambda *a, **k: pytest.fail("an SVD ran before the weights were checked"))
            m.setattr(analyze, "validation_batches", lambda *a, **k: pytest.fail("read the data first"))
            commands = [["spectrum"]] + ([["prune", "--eval_tokens", "300"]] if ckpt == dense_ckpt else [])
            for command in commands:
                message = refusal(capsys, [command[0], str(tmp_path / "nan.pt"), *command[1:]])
                assert "layers.1.mlp.down_proj has non-finite weights" in message, message


def write_metrics(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_curves_bad_inputs_are_one_line_naming_the_fix(tmp_path, capsys):
    good = write_metrics(tmp_path / "good" / "metrics.jsonl", [{"step": 10, "val_ppl": 50.0}])
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(json.dumps({"step": 10, "val_ppl": 50.0}) + "\n{\"step\": 20, \"val_p\n")
    binary = tmp_path / "ckpt.pt"
    binary.write_bytes(bytes(range(256)) * 4)
    cases = [(str(tmp_path / "missing.jsonl"), "no metrics file at"),
             (str(corrupt), "corrupt.jsonl:2: not a JSON object; fix or delete that line"),
             (str(binary), "is not text"),
             (write_metrics(tmp_path / "list.jsonl", [[1, 2]]), "list.jsonl:1: not a JSON object"),
             (write_metrics(tmp_path / "nostep.jsonl", [{"val_ppl": 3.0}]), "nostep.jsonl:1: a val_ppl row needs"),
             (write_metrics(tmp_path / "text.jsonl", [{"step": 1, "val_ppl": "3"}]), "text.jsonl:1: a val_ppl row"),
             (write_metrics(tmp_path / "nan.jsonl", [{"step": 1, "val_ppl": float("nan")}]), "every val_ppl is non")]
    for path, message in cases:
        got = refusal(capsys, ["curves", good, path, "--out", str(tmp_path / "c.svg")])
        assert got.startswith("analyze.py curves: ") and message in got, got
    assert "is a folder" in refusal(capsys, ["curves", good, "--out", str(tmp_path)])
    before = open(good).read()  # the run's own metrics (or checkpoint) as --out: refused, never written over
    for out in (good, str(binary)):
        assert "the figure is an SVG, written over any file of that name; pass a name ending in .svg" in \
            refusal(capsys, ["curves", good, "--out", out])
    assert open(good).read() == before and binary.read_bytes() == bytes(range(256)) * 4
    assert "--labels for 1 files" in refusal(capsys, ["curves", good, "--labels", "a", "b"])
    (tmp_path / "file").write_text("")
    assert "cannot make or write into" in refusal(capsys, ["curves", good, "--out", str(tmp_path / "file" / "c.svg")])


def test_curves_draws_a_run_evaluated_on_two_sets_as_two_parts(tmp_path, capsys, corpus):  # noqa: F811
    """A resume with another --eval_tokens scores its later rows on another validation set; one line through both
    drew the change of set as the model's. train.py's rows record the set's size (val_tokens), and curves draws a part
    for each set, saying where it changes; a run on one set is one curve, as are rows from before val_tokens."""
    train.main(base_args(corpus, tmp_path / "run", 4, "--eval_every", "2", "--stop_after", "2", "--eval_tokens",
                         "200"))
    train.main(base_args(corpus, tmp_path / "run", 4, "--eval_every", "2", "--resume", "--eval_tokens", "400"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    sizes = [(r["step"], r["val_tokens"]) for r in rows if "val_loss" in r]
    assert len(sizes) == 2 and sizes[0][1] < sizes[1][1], sizes
    out = tmp_path / "c.svg"
    analyze.main(["curves", str(tmp_path / "run"), "--out", str(out)])
    said = capsys.readouterr().err
    assert f"the validation set changes at step 4 ({sizes[0][1]} -> {sizes[1][1]} tokens), another --eval_tokens on " \
        "a resume; drawn as a part for each set" in said, said
    text = out.read_text()
    assert f"run ({sizes[0][1]} val tokens)" in text and f"run ({sizes[1][1]} val tokens)" in text
    old = write_metrics(tmp_path / "old" / "metrics.jsonl", [{"step": 10, "val_ppl": 50.0},
                                                            {"step": 20, "val_ppl": 40.0, "val_tokens": 300}])
    analyze.main(["curves", old, "--out", str(out)])
    assert capsys.readouterr().err == "" and "val tokens" not in out.read_text()


def test_curves_refuses_a_run_given_twice(tmp_path, capsys):
    """The same metrics.jsonl twice (as a folder and as its file, or through a link) drew one run as two identical
    curves, which in Figure 4 reads as two supports that agree exactly; it is refused before any file is read."""
    path = write_metrics(tmp_path / "s1" / "metrics.jsonl", [{"step": 10, "val_ppl": 50.0}])
    other = write_metrics(tmp_path / "s2" / "metrics.jsonl", [{"step": 10, "val_ppl": 51.0}])
    os.symlink(tmp_path / "s1", tmp_path / "link")
    out = tmp_path / "c.svg"
    for twice in (str(tmp_path / "s1"), f"{tmp_path / 'link'}/", path):
        message = refusal(capsys, ["curves", path, other, twice, "--out", str(out)])
        assert f"{twice} is the run of {path} again" in message and "give each run once" in message, message
    assert not out.exists()


def test_curves_creates_its_folder_and_leaves_out_non_finite_points(tmp_path, capsys):
    rows = [{"step": 10, "val_ppl": 50.0}, {"step": 20, "val_ppl": float("inf")}, {"step": 30, "val_ppl": 30.0}]
    path = write_metrics(tmp_path / "run" / "metrics.jsonl", rows)
    out = tmp_path / "some" / "missing" / "folder" / "curves.svg"
    analyze.main(["curves", path, "--out", str(out)])
    assert "non-finite at step(s) 20; left out of the plot" in capsys.readouterr().err
    polyline = ET.parse(out).getroot().find("{http://www.w3.org/2000/svg}polyline")
    assert len(polyline.get("points").split()) == 2 and "nan" not in polyline.get("points")


def test_curves_takes_folder_names_and_labels_that_are_not_utf8(tmp_path):
    """A run folder named in another encoding (Latin-1's é) is the default label: shown with U+FFFD in the SVG,
    which is UTF-8 text, where it raised UnicodeEncodeError; so is a --labels of such bytes."""
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    path = write_metrics(tmp_path / name / "metrics.jsonl", [{"step": 10, "val_ppl": 50.0}])
    for extra, shown in (([], "caf\ufffd"), (["--labels", name + " <2>"], "caf\ufffd <2>")):
        out = tmp_path / "curves.svg"
        analyze.main(["curves", path, "--out", str(out), *extra])
        texts = [t.text for t in ET.parse(out).getroot().iter("{http://www.w3.org/2000/svg}text")]
        assert shown in texts, texts


def test_curves_default_labels_tell_runs_of_one_folder_name_apart(tmp_path):
    """Runs kept as out/60m/sltrain and out/130m/sltrain were both labelled "sltrain": two legend entries alike, and
    no telling which line is which. Where folder names coincide, the label takes the parent folders that differ."""
    paths = [write_metrics(tmp_path / "out" / size / "sltrain" / "metrics.jsonl", [{"step": 10, "val_ppl": ppl}])
             for size, ppl in (("60m", 50.0), ("130m", 40.0))]
    paths.append(write_metrics(tmp_path / "out" / "full" / "metrics.jsonl", [{"step": 10, "val_ppl": 45.0}]))
    out = tmp_path / "curves.svg"
    analyze.main(["curves", *paths, "--out", str(out)])
    texts = [t.text for t in ET.parse(out).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert texts[-3:] == [os.path.join("60m", "sltrain"), os.path.join("130m", "sltrain"), "full"], texts


def test_a_spectrum_of_many_layers_gives_each_its_own_colour_and_legend_entry(tmp_path):
    """Full-rank spectra draw a line per layer: at 350m's 24 layers the palette's 10 colours made layers 0, 10 and 20
    one colour, and the legend ran past the figure's foot from layer 22 on."""
    ns = "{http://www.w3.org/2000/svg}"
    rows = [dict(kind="o_proj", layer=i, sigma=[2.0 - i / 24, 1.0, 0.1]) for i in range(24)]
    root = ET.parse(analyze.spectrum_figures(rows, tmp_path, "350m full")[0]).getroot()
    colours = [line.get("stroke") for line in root.iter(ns + "polyline")]
    assert len(colours) == 24 and len(set(colours)) == 24, colours
    legend = [float(t.get("y")) for t in root.iter(ns + "text") if (t.text or "").startswith("layer ")]
    assert len(legend) == 24 and max(legend) < float(root.get("height")), (legend, root.get("height"))


def test_a_long_label_widens_the_figure_and_leaves_the_plot_its_width(tmp_path):
    """A run's folder named by its settings (94 characters here) is its legend label: the legend took the plot's
    width, which went negative (a frame SVG does not draw, every point at its left edge)."""
    name = "sltrain_350m_rank256_delta0.05_alpha32_lr3e-3_wd0_packed_support_seed3_bf16_compile_run2_final"
    path = write_metrics(tmp_path / name / "metrics.jsonl", [{"step": 10, "val_ppl": 50.0},
                                                              {"step": 20, "val_ppl": 40.0}])
    out = tmp_path / "curves.svg"
    analyze.main(["curves", path, "--out", str(out)])
    root = ET.parse(out).getroot()
    frame = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("stroke") == "black"][0]
    assert float(frame.get("width")) >= 360, frame.get("width")
    xs = [float(p.split(",")[0]) for p in root.find("{http://www.w3.org/2000/svg}polyline").get("points").split()]
    assert xs[1] - xs[0] >= 360 and max(xs) < float(root.get("width")), (xs, root.get("width"))


def test_a_figure_that_cannot_be_written_leaves_the_earlier_one_whole(tmp_path, capsys):
    """A write the filesystem refuses (a file past the process's size limit, as a full disk) is one line, and the
    SVG written before stays whole: figures are written through checkpoint.atomic_file."""
    small = write_metrics(tmp_path / "small" / "metrics.jsonl", [{"step": 10, "val_ppl": 50.0}])
    big = write_metrics(tmp_path / "big" / "metrics.jsonl", [{"step": s, "val_ppl": 50.0 - s / 100} for s in
                                                              range(1, 1001)])
    out = tmp_path / "curves.svg"
    analyze.main(["curves", small, "--out", str(out)])
    before = out.read_bytes()
    assert len(before) < 4096
    with file_size_limit(4096):
        assert "cannot write --out" in refusal(capsys, ["curves", big, "--out", str(out)])
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["big", "curves.svg", "small"]


@pytest.mark.parametrize("at", ["open", "fsync"])
def test_spectrum_figures_are_replaced_all_or_none(dense_ckpt, sltrain_ckpt, tmp_path, monkeypatch, capsys, at):
    """A disk that fills at the fourth of the seven figures left q, k and v of this checkpoint beside o, gate, up and
    down of the one analyzed before into the same folder, each whole, so nothing told the two apart. Every figure is
    written and synced before any replaces an earlier one: a failed write leaves the earlier set as it was. Also where
    the disk says so at fsync (delayed allocation): renamed one by one as each was synced, the last three were new."""
    analyze.main(["spectrum", dense_ckpt, "--figures", str(tmp_path)])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(before) == 7
    disk_full_from(monkeypatch, 4, at)
    got = refusal(capsys, ["spectrum", sltrain_ckpt, "--figures", str(tmp_path)])
    assert "cannot write into --figures" in got and "No space left on device" in got, got
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    mixed = sorted(name for name in before if after.get(name) != before[name])
    assert after.keys() == before.keys() and not mixed, f"replaced: {mixed}; in the folder: {sorted(after)}"


@pytest.mark.parametrize("command", ["spectrum --figures", "prune", "curves 2>&1"])
def test_a_command_read_by_a_reader_that_stops_does_its_work_and_exits_0(dense_ckpt, tmp_path, command):
    """`python analyze.py spectrum ckpt --figures figs | head -3`: the table printed first, and the pipe's end there
    was a BrokenPipeError traceback, exit 1, and no figure written (prune's table the same, after its evaluations);
    with `2>&1 | tee log`, curves' note of a non-finite point (on stderr) came before its figure, which it stopped.
    The lines after the reader's end go nowhere now, and the command does all it was asked."""
    if command == "curves 2>&1":
        rows = [{"step": 10, "val_ppl": 50.0}, {"step": 20, "val_ppl": float("inf")}, {"step": 30, "val_ppl": 30.0}]
        argv = ["curves", write_metrics(tmp_path / "run" / "metrics.jsonl", rows), "--out", str(tmp_path / "c.svg")]
    else:
        argv = [command.split()[0], dense_ckpt, "--rank", "4", *(["--figures", str(tmp_path)] * ("figures" in command))]
    status, err = read_then_stop(["analyze.py", *argv], stderr_too="2>&1" in command)
    assert status == 0 and quiet(err), (status, err)
    assert len(list(tmp_path.glob("*.svg"))) == {"spectrum --figures": 7, "prune": 0, "curves 2>&1": 1}[command]


def test_a_failed_command_leaves_no_empty_folder_it_made(tmp_path, capsys):
    """--figures (spectrum) and --out's folder (curves) are made before the expensive work; a command that then fails
    removes the folders it made, if empty."""
    assert "analyze.py spectrum" in refusal(capsys, ["spectrum", str(tmp_path / "missing.pt"), "--figures",
                                                     str(tmp_path / "a" / "figs")])
    assert "analyze.py curves" in refusal(capsys, ["curves", str(tmp_path / "missing.jsonl"), "--out",
                                                   str(tmp_path / "b" / "c" / "curves.svg")])
    assert list(tmp_path.iterdir()) == []


def test_output_folders_are_checked_before_the_checkpoint_is_read(tmp_path, monkeypatch, capsys):
    def refuse_to_load(path, *args, **kwargs):
        raise AssertionError(f"{path} was loaded before the arguments were checked")

    monkeypatch.setattr(analyze, "load_model", refuse_to_load)
    (tmp_path / "a_file").write_text("")
    got = refusal(capsys, ["spectrum", str(tmp_path / "ckpt.pt"), "--figures", str(tmp_path / "a_file" / "figs")])
    assert "--figures" in got and "cannot make or write into" in got and "pass a folder you can write to" in got, got
    if os.path.isdir("/proc/self/fdinfo"):  # a folder there that no one writes into, root included
        got = refusal(capsys, ["spectrum", str(tmp_path / "ckpt.pt"), "--figures", "/proc/self/fdinfo"])
        assert "--figures /proc/self/fdinfo: cannot make or write into /proc/self/fdinfo" in got, got
    got = refusal(capsys, ["prune", str(tmp_path / "ckpt.pt"), "--tokenizer", str(tmp_path / "none.model")])
    assert "error: --tokenizer: tokenizer" in got and "not found" in got, got


def test_prune_refuses_a_validation_folder_without_shards_before_the_checkpoint_is_read(dense_ckpt, tmp_path,
                                                                                        monkeypatch, capsys):
    """A --data_dir, or the checkpoint's own (a run from another machine), that holds no validation shards is one line
    at a quick look: the full read of the checkpoint (at 7b, minutes, and its float32 copy) comes after."""
    monkeypatch.setattr(analyze, "load_model", lambda *a, **k: pytest.fail("read the checkpoint first"))
    got = refusal(capsys, ["prune", dense_ckpt, "--data_dir", str(tmp_path / "gone")])
    assert got.startswith(f"analyze.py prune: validation data: data folder {tmp_path / 'gone'} does not exist"), got
    moved = tmp_path / "moved.pt"
    ckpt = checkpoint.load(dense_ckpt)
    ckpt["args"]["data_dir"] = str(tmp_path)  # a folder with no shards in it
    checkpoint.save(moved, ckpt)
    got = refusal(capsys, ["prune", str(moved)])
    assert got.startswith(f"analyze.py prune: validation data: no validation shards in {tmp_path}"), got


def test_prune_refuses_a_tokenizer_of_another_size(dense_ckpt, other_tokenizer, capsys):
    got = refusal(capsys, ["prune", dense_ckpt, "--tokenizer", other_tokenizer])
    assert got == (f"analyze.py prune: tokenizer {other_tokenizer} has 80 pieces but the model 96; pass the "
                   "--tokenizer it was trained with"), got


# ----------------------------------------------------------------------------- the paper's numbering

PAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "shared", "paper", "sltrain.tex")


def paper_numbers(tex):
    """{label: its number as the paper prints it} from the LaTeX: tables, figures, numbered equations, sections
    (lettered after \\appendix) and subsections, counted in the order they come, as LaTeX does; comments left
    out."""
    text = re.sub(r"(?<!\\)%.*", "", tex)
    counters = dict(table=0, figure=0, equation=0, section=0, sub=0)
    numbers, stack, last, appendix = {}, [], {}, False
    kinds = dict(table="table", wraptable="table", figure="figure", wrapfigure="figure", equation="equation")
    for m in re.finditer(r"\\(begin|end)\{(\w+\*?)\}|\\(caption|captionof\{table\})\{|\\label\{([^}]*)\}|"
                         r"\\(section|subsection|appendix)\b", text):
        if m.group(1) == "begin":
            stack.append(m.group(2))
            if m.group(2) == "equation":
                counters["equation"] += 1
                last["equation"] = str(counters["equation"])
        elif m.group(1) == "end":
            stack.pop()
        elif m.group(3):
            inner = next((e for e in reversed(stack) if e in kinds or e in ("subfigure", "algorithm")), None)
            kind = "table" if m.group(3) != "caption" else kinds.get(inner)
            if kind in ("table", "figure"):  # a subfigure's or an algorithm's caption is not numbered as these
                counters[kind] += 1
                last[kind] = last["float"] = str(counters[kind])
        elif m.group(5) == "appendix":
            appendix, counters["section"] = True, 0
        elif m.group(5) == "section":
            counters["section"], counters["sub"] = counters["section"] + 1, 0
            n = counters["section"]
            last["section"] = last["top"] = chr(ord("A") + n - 1) if appendix else str(n)
        elif m.group(5) == "subsection":
            counters["sub"] += 1
            last["section"] = f"{last['top']}.{counters['sub']}"
        elif m.group(4):
            inner = next((e for e in reversed(stack) if e in kinds), None)
            numbers[m.group(4)] = last["float" if kinds.get(inner) in ("table", "figure") else
                                       "equation" if inner == "equation" else "section"]
    return numbers


@pytest.mark.skipif(not os.path.isfile(PAPER), reason="the paper's LaTeX (../shared/paper) is not here")
def test_the_docs_cite_the_papers_tables_figures_and_sections_by_its_numbers():
    """Where the README and the modules name a table, figure, appendix or equation of the paper, the number is the
    one the paper prints for it (its pruning table is Table 1, its main comparison Table 2, ...)."""
    with open(PAPER, encoding="utf-8") as f:
        numbers = paper_numbers(f.read())
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"), encoding="utf-8") as f:
        readme = f.read()
    cited = [  # (where, a pattern whose group is the number, the paper's label for what it names)
        (readme, r"the paper's recipe \(§([\d.]+) and", "sect:pretrain"),
        (readme, r"7b: 5e-4, §([\d.]+)'s", "sect:pretrain"),
        (readme, r"Initialization follows §([\d.]+)", "sect:practical_consider"),
        (readme, r"`prune` is Table (\w+) on a full-rank", "tab:random_top_sparse"),
        (readme, r"computes Table (\w+)'s memory column", "main_table_llama"),
        (readme, r"the Appendix (\w) breakdown", "app:memory_estimation"),
        (readme, r"diag\(UᵀSV\) \(Appendix (\w)", "sect:distribution_sing"),
        (readme, r"diag\(UᵀSV\) \(Appendix \w, Figure (\w+)\)", "fig:svd_plot"),
        (readme, r"gathered at I \(eq\. \((\w+)\)\)", "gradient_me"),
        (readme, r"For Figure (\w+)'s memory baseline", "fig:actual_memory"),
        (readme, r"compares the two \(Table (\w+)\)", "tab:"),
        (analyze.__doc__, r"# Table (\w+): full, L0", "tab:random_top_sparse"),
        (analyze.__doc__, r"the sparse factor carry \(Appendix (\w)\)", "sect:distribution_sing"),
        (estimate_memory.__doc__, r"the paper's estimate \(Table (\w+)'s Mem column", "main_table_llama"),
        (estimate_memory.__doc__, r"an ablation \(Table (\w+)\)", "table:ablation_l_s_delta"),
        (sllinear.__doc__, r"paper eq\. \((\w+)\)", "gradient_me"),
        (train.__doc__, r"recipe for each size \(§([\d.]+)", "sect:pretrain"),
    ]
    wrong = []
    for text, pattern, label in cited:
        found = re.search(pattern, text)
        assert found, f"no match for {pattern!r}"
        if found.group(1) != numbers[label]:
            wrong.append(f"{found.group(0)!r} names {label}, which the paper numbers {numbers[label]}")
    assert not wrong, "\n".join(wrong)
