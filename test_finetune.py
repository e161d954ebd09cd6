"""
Tests of SLTrain-FT, the paper's fine-tuning (its appendix): W = W0 + s·BA ⊕_I V with W0 a frozen pretrained weight,
from the layer's gradients to train.py --method sltrain_ft --init_from, resume, export and the memory estimate.

    python -m pytest -q test_finetune.py
"""

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

import analyze
import estimate_memory as em
import export
import sample
import train
from checkpoint import load_model
from model import FINETUNE, LLaMA, config_for
from sllinear import SLLinear
from test_analyze import dense_ckpt  # noqa: F401  (a fixture: a tiny full-rank model trained here)
from test_train import base_args, corpus, eval_args, final_state, metrics, run_torchrun  # noqa: F401  (corpus: fixture)

TRAINED = ("A", "B", "values")


def layer_with_base(dtype=torch.float64):
    """A fine-tuning layer with B and V drawn at random (they start at zero, where their terms would go unchecked)."""
    torch.manual_seed(0)
    layer = SLLinear(24, 40, 4, 0.1, 8.0, dtype=dtype, base=True)
    with torch.no_grad():
        layer.B.normal_()
        layer.values.normal_()
    return layer


def reference_weight(layer):
    """W0 + s·BA ⊕_I V, formed densely by autograd: the reference."""
    W = layer.W0 + layer.scale * layer.B @ layer.A
    return W.flatten().index_add(0, layer.indices.long(), layer.values).view_as(W)


def test_the_layer_adds_its_factors_to_w0_and_gives_w0_no_gradient():
    layer = layer_with_base()
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 40, dtype=torch.float64)
    y = layer(x)
    grads = torch.autograd.grad(y, [x, layer.B, layer.A, layer.values], g)
    x_ref = x.detach().requires_grad_()
    y_ref = x_ref @ reference_weight(layer).t()
    refs = torch.autograd.grad(y_ref, [x_ref, layer.B, layer.A, layer.values], g)
    assert (y - y_ref).abs().max() < 1e-12
    for name, a, b in zip(("x", "B", "A", "V"), grads, refs):
        assert (a - b).abs().max() < 1e-12, f"d{name} differs by {(a - b).abs().max():.2e}"
    assert not layer.W0.requires_grad and "W0" not in dict(layer.named_parameters()), "W0 must stay frozen"
    assert (layer.merged_weight() - reference_weight(layer)).abs().max() < 1e-12


def test_the_layer_starts_as_w0_and_keeps_w0_in_checkpoints():
    torch.manual_seed(0)
    layer = SLLinear(24, 40, 4, 0.1, 8.0, base=True)
    assert torch.equal(layer.merged_weight(), layer.W0), "B = 0 and V = 0: the layer starts as its pretrained W0"
    assert set(layer.state_dict()) == {"A", "B", "values", "indices", "W0"}
    plain = SLLinear(24, 40, 4, 0.1, 8.0)
    assert set(plain.state_dict()) == {"A", "B", "values", "indices"}, "a pretraining layer's checkpoint is as before"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mixed_precision_keeps_no_copy_of_w0_for_backward(compiled):
    """Under bf16 autocast the float32 W0 is cast inside the Function, as B, A and V are: what is kept for backward is
    W0 itself and the bf16 input, never a bf16 copy of W0 (2 bytes per frozen weight); also compiled, in one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend
    layer = layer_with_base(torch.float32)
    x = torch.randn(6, 24)
    kept, counter = [], CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    forward = torch.compile(layer, backend=counter, fullgraph=True) if compiled else layer
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16):
        y = forward(x)
    assert counter.frame_count == int(compiled)
    weights = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
    others = [t for t in kept if t.untyped_storage().data_ptr() not in weights]
    assert [(t.dtype, tuple(t.shape)) for t in others] == [(torch.bfloat16, (6, 24))], "only the bf16 input is new"
    assert y.dtype == torch.bfloat16
    ref = x.bfloat16().float() @ reference_weight(layer).detach().bfloat16().float().t()
    assert (y.float() - ref).abs().max() < 0.02 * ref.abs().max()  # W formed in bf16: an error of a few bf16 ulps
    y.float().sum().backward()
    assert layer.B.grad.dtype == torch.float32 and layer.W0.grad is None


def test_a_fine_tuned_model_starts_as_the_pretrained_one(dense_ckpt):
    torch.manual_seed(0)
    dense, _ = load_model(dense_ckpt)
    model = LLaMA(config_for("tiny", method="sltrain_ft", vocab_size=dense.config.vocab_size))
    analyze.init_from_dense(model, dense_ckpt)
    assert sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}) == sorted(TRAINED)
    idx = torch.randint(0, dense.config.vocab_size, (2, 16))
    with torch.no_grad():
        err = (model.eval()(idx)[0] - dense(idx)[0]).abs().max().item()
    assert err < 1e-5, f"the fine-tuned model starts {err:.2e} away from the pretrained one"


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adam8bit", "--per_layer"], ["--amp"]],
                         ids=["adamw", "8bit-per-layer", "amp"])
def test_train_fine_tunes_only_the_factors_and_resumes_exactly(corpus, dense_ckpt, tmp_path, extra):  # noqa: F811
    """train.py --method sltrain_ft --init_from: W0, embeddings, norms and head stay the pretrained ones (W0 in bf16
    under --amp), B, A and V learn, and a run stopped and resumed ends where one straight run does. The resume needs
    no --init_from, and the pretrained checkpoint may be gone by then: the run's start is in its own checkpoint."""
    pretrained = tmp_path / "pretrained.pt"
    shutil.copy(dense_ckpt, pretrained)
    ft = ["--method", "sltrain_ft", "--lr", "1e-2", "--eval_tokens", "300", *extra]
    train.main(base_args(corpus, tmp_path / "straight", 4, *ft, "--init_from", str(pretrained)))
    train.main(base_args(corpus, tmp_path / "resumed", 4, *ft, "--init_from", str(pretrained), "--stop_after", "2"))
    pretrained.unlink()
    train.main(base_args(corpus, tmp_path / "resumed", 4, *ft, "--resume"))
    dense = torch.load(dense_ckpt, weights_only=True)["model"]
    if "--amp" in extra:
        dense = {k: t.bfloat16() if k.endswith("_proj.weight") else t for k, t in dense.items()}
    end = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "resumed" / "ckpt.pt", weights_only=True)["model"]
    for name, t in end.items():
        assert torch.equal(t, resumed[name]), f"{name}: the resumed run differs"
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "W0":
            assert torch.equal(t, dense[name.removesuffix(".W0") + ".weight"]), f"{name} changed"
        elif leaf in ("B", "values"):
            assert t.abs().sum() > 0, f"{name} did not train"
        elif leaf not in ("A", "indices"):
            assert torch.equal(t, dense[name]), f"{name} changed: only B, A and V train"


def test_fine_tuning_under_torchrun_matches_one_process(corpus, dense_ckpt, tmp_path):  # noqa: F811
    """DDP with the embeddings, norms, head and W0 frozen, and 8-bit Adam stepping each factor inside backward."""
    ft = ["--method", "sltrain_ft", "--init_from", dense_ckpt, "--lr", "1e-2", "--optimizer", "adam8bit_per_layer"]
    train.main(base_args(corpus, tmp_path / "one", 4, "--batch_size", "8", *ft))
    assert "2 x cpu" in run_torchrun(base_args(corpus, tmp_path / "two", 4, "--batch_size", "4", *ft))
    for ra, rb in zip(metrics(tmp_path / "one")[0], metrics(tmp_path / "two")[0], strict=True):
        assert abs(ra["loss"] - rb["loss"]) < 1e-5 * ra["loss"], f"step {ra['step']}: {ra['loss']} vs {rb['loss']}"
    one, two = final_state(tmp_path / "one")["model"], final_state(tmp_path / "two")["model"]
    diff = max((one[k].float() - two[k].float()).abs().max().item() for k in one)
    assert diff < 1e-4, f"parameters differ by {diff}"


def test_a_fine_tuned_checkpoint_exports_samples_and_analyzes(corpus, dense_ckpt, tmp_path):  # noqa: F811
    train.main(base_args(corpus, tmp_path, 3, "--method", "sltrain_ft", "--init_from", dense_ckpt, "--lr", "1e-2",
                         "--eval_tokens", "300"))
    ckpt = str(tmp_path / "ckpt.pt")
    export.main([ckpt, "--merged", str(tmp_path / "dense.pt")])
    model, _ = load_model(ckpt)
    merged, saved = load_model(str(tmp_path / "dense.pt"))
    assert merged.config.method == "full" and saved["args"]["merged_from"] == "sltrain_ft"
    q = model.layers[0].attn.q_proj
    assert (q.merged_weight() - reference_weight(q)).abs().max() < 1e-6
    assert torch.equal(merged.layers[0].attn.q_proj.weight, q.merged_weight())
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert (merged(idx)[0] - model(idx)[0]).abs().max() < 1e-5
    assert sample.merged(model).config.method == "full", "sample.py merges a fine-tuned model once"
    rows = analyze.spectrum(load_model(ckpt)[0])
    assert all("residual_below" in r and "sigma_lowrank" not in r for r in rows), "W0 + s·BA + S is full-rank"
    assert train.main(eval_args(corpus, tmp_path, "--method", "sltrain_ft")) is None


def test_fine_tuning_flags_are_checked_before_work(corpus, dense_ckpt, tmp_path, capsys):  # noqa: F811
    for extra, message in [([], "--method sltrain_ft fine-tunes a pretrained model: pass --init_from"),
                           (["--init_from", dense_ckpt, "--freeze", "lowrank"], "--freeze lowrank"),
                           (["--init_from", dense_ckpt, "--support", "top"], "--support top"),
                           (["--init_from", dense_ckpt, "--rank", "0", "--delta", "0"], "rank and delta are both 0")]:
        with pytest.raises(SystemExit):
            train.get_args(base_args(corpus, tmp_path, 1, "--method", "sltrain_ft", *extra))
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        train.get_args(base_args(corpus, tmp_path, 1, "--method", "relora", "--init_from", dense_ckpt))
    assert "--init_from starts a full, lowrank, sltrain or sltrain_ft model at a full-rank checkpoint; ReLoRA "\
           "starts from its own" in capsys.readouterr().err


@pytest.mark.parametrize("optimizer,per_layer,amp,lora", [
    ("adamw", False, False, False), ("adam8bit", True, False, False), ("adam8bit", True, True, False),
    ("adamw", False, True, True)], ids=["adamw", "8bit-per-layer", "8bit-per-layer-amp", "lora-amp"])
def test_the_memory_estimate_counts_w0_and_trains_only_the_factors(optimizer, per_layer, amp, lora):
    """Under --amp W0 is kept in bf16 (model.frozen_base_to), not float32 as the trained parameters."""
    precision = dict(dtype="float32", amp=True) if amp else {}
    delta = 0.0 if lora else None
    counted, index_dtype = em.measure("tiny", "sltrain_ft", None, delta, optimizer, per_layer, 2, 32, 1,
                                      torch.device("cpu"), **precision)
    est = em.estimate("tiny", "sltrain_ft", None, delta, index_dtype, optimizer, per_layer, 2, 32, **precision)
    for key in ("param", "grad", "optim", "act"):  # exact; the ids are not saved: the embeddings are frozen
        assert counted[key] == pytest.approx(est[key + "_gb"] * 1e9, rel=1e-9), (key, counted, est)
    rank, _, delta = FINETUNE
    delta = 0.0 if lora else delta
    assert (est["rank"], est["delta"]) == (rank, delta), "the paper's fine-tuning settings by default"
    pretraining = em.estimate("tiny", "sltrain", rank, delta, index_dtype, optimizer, per_layer, 2, 32, **precision)
    full = em.estimate("tiny", "full", None, None, index_dtype, optimizer, per_layer, 2, 32, **precision)
    factors = pretraining["lowrank_m"] + pretraining["sparse_m"]
    assert est["stored_m"] == pytest.approx(full["params_m"] + factors), "W0 (the full model's projections) + factors"
    assert est["state_m"] == pytest.approx(2 * factors), "moments of B, A and V alone"
    w0 = est["stored_m"] - est["params_m"]
    width = 4 if amp else 2
    index = 4 if index_dtype == "int32" else 8
    expected = width * est["params_m"] + 2 * w0 + index * est["sparse_m"]  # W0 in bf16 either way
    assert est["param_gb"] * 1e3 == pytest.approx(expected), (est, w0)


def test_lora_is_sltrain_ft_without_a_sparse_part():
    """delta=0: W0 x + s·B(A x), never forming W; B starts at zero (LoRA's start), so the layer starts as W0."""
    torch.manual_seed(0)
    layer = SLLinear(24, 40, 4, 0.0, 8.0, dtype=torch.float64, base=True)
    assert layer.values is None and torch.equal(layer.merged_weight(), layer.W0)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 40, dtype=torch.float64)
    grads = torch.autograd.grad(layer(x), [x, layer.B, layer.A], g)
    x_ref = x.detach().requires_grad_()
    W = layer.W0 + layer.scale * layer.B @ layer.A
    refs = torch.autograd.grad(x_ref @ W.t(), [x_ref, layer.B, layer.A], g)
    for name, a, b in zip(("x", "B", "A"), grads, refs):
        assert (a - b).abs().max() < 1e-12, f"d{name} differs by {(a - b).abs().max():.2e}"
    assert (layer.merged_weight() - W).abs().max() < 1e-12


@pytest.mark.parametrize("method,extra,trained", [
    ("sltrain_ft", ["--delta", "0"], ("A", "B")),  # LoRA
    ("full", [], None),  # full-rank fine-tuning: every weight
    ("full", ["--optimizer", "galore_adamw"], None)], ids=["lora", "full", "galore"])
def test_the_papers_fine_tuning_baselines_start_at_the_checkpoint(corpus, dense_ckpt, tmp_path, method, extra,
                                                                   trained):  # noqa: F811
    """The rows of the paper's fine-tuning table beside SLTrain-FT: LoRA (--method sltrain_ft --delta 0), full-rank
    fine-tuning (--method full --init_from) and GaLore's (the same with a GaLore optimizer). Each starts at the
    pretrained model and trains what it should."""
    train.main(base_args(corpus, tmp_path, 2, "--method", method, "--init_from", dense_ckpt, "--lr", "1e-2",
                         "--eval_tokens", "300", *extra))
    dense = torch.load(dense_ckpt, weights_only=True)["model"]
    end = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    model = LLaMA(config_for("tiny", method=method, vocab_size=96, delta=0.0 if extra[:1] == ["--delta"] else None))
    analyze.init_from_dense(model, dense_ckpt)
    start = model.state_dict()
    if method == "full":
        assert all(torch.equal(start[k], t) for k, t in dense.items()), "full-rank fine-tuning starts at the weights"
    for name, t in end.items():
        leaf = name.rsplit(".", 1)[-1]
        if trained is None or leaf in trained:
            assert not torch.equal(t, start[name]) or leaf == "A", f"{name} did not train"
        else:
            assert torch.equal(t, start[name]), f"{name} changed"


def readme_fine_tuning_commands():
    """{comment: train.py's argv} of the README's fine-tuning commands (its "Fine-tuning: SLTrain-FT" block)."""
    readme = (Path(__file__).resolve().parent / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Fine-tuning: SLTrain-FT", 1)[1].split("```")[1]
    commands = {}
    for line in block.strip().splitlines():
        command, _, comment = line.partition("#")
        commands[comment.strip()] = shlex.split(command)[2:]  # after "python train.py"
    return commands


@pytest.mark.parametrize("row", ["LoRA: W0 + s·BA", "GaLore"])
def test_the_readmes_fine_tuning_baselines_are_the_papers_rank(row, tmp_path):
    """The paper's fine-tuning table uses r = 8 for every method ("We use r = 8 for all methods"; "LoRA (rank=8)",
    "GaLore FT (rank=8)"): the README's commands for those rows project or factor at that rank, not at the size's
    pretraining rank (128 at 60m)."""
    argv = readme_fine_tuning_commands()[row]
    (tmp_path / "ckpt.pt").touch()  # the flags only check that --init_from is a file
    argv[argv.index("--init_from") + 1] = str(tmp_path / "ckpt.pt")
    args = train.get_args(argv + ["--device", "cpu", "--out_dir", str(tmp_path / "out")])
    rank = args.galore_rank if args.optimizer.startswith("galore") else args.rank
    assert rank == FINETUNE[0], f"{row}: rank {rank}, the paper's fine-tuning rank is {FINETUNE[0]}"


def test_the_readmes_fine_tuning_memory_figures_are_what_its_command_prints(monkeypatch, capsys):
    """The README's SLTrain-FT figure (7b, 8-bit Adam per-layer, batch 1) and full-rank AdamW's beside it are the
    train rows of the command it names, and of that command for full-rank AdamW: an estimate that moves moves them."""
    readme = (Path(__file__).resolve().parent / "README.md").read_text(encoding="utf-8")
    section = " ".join(readme.split("## Fine-tuning: SLTrain-FT", 1)[1].split("\n## ", 1)[0].split())
    found = re.search(r"([\d.]+) G against full-rank AdamW's ([\d.]+) G \(`python (estimate_memory\.py [^`]*)`\)",
                      section)
    assert found, "the README's fine-tuning section no longer gives its memory figures as this test reads them"
    ft, full, command = float(found[1]), float(found[2]), shlex.split(found[3])
    rows = {}
    full_rank = [a for a in command if a != "--per_layer"] + ["--method", "full", "--optimizer", "adamw"]  # last wins
    for method, argv in (("sltrain_ft", command), ("full", full_rank)):
        monkeypatch.setattr(sys, "argv", [*argv, "--json"])
        em.main()
        (rows[method],) = json.loads(capsys.readouterr().out)
        assert rows[method]["method"] == method
    said = {"sltrain_ft": ft, "full": full}
    for method, row in rows.items():
        assert round(row["train_gb"], 2) == said[method], f"{method}: README {said[method]} G, the command prints " \
            f"{row['train_gb']:.2f} G"
