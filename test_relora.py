"""
Tests of the ReLoRA baseline: the merge (model.ReLoRALinear, model.relora_merge), the pruned optimizer state
(optim.prune_state_), the jagged schedule and exact resume across a merge in train.py.

    python -m pytest -q test_relora.py
"""

import copy
import math

import pytest
import torch

import optim
import train
from model import LLaMA, ReLoRALinear, config_for, relora_merge
from galore import GaLore, galore_param_groups
from optim import AdamW, Adam8bit, dequantize_blockwise, prune_state_
from per_layer import attach_per_layer
from test_train import base_args, corpus, final_state, metrics  # noqa: F401  (corpus is a fixture)


def trained_relora(make_optimizer, steps=3):
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="relora", vocab_size=64))
    opt = make_optimizer(list(model.parameters()))
    for _ in range(steps):
        idx = torch.randint(64, (2, 17))
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_layer_is_w0_plus_scaled_ba_and_w0_is_a_frozen_buffer():
    torch.manual_seed(0)
    layer = ReLoRALinear(12, 20, rank=4, alpha=32.0)
    torch.nn.init.normal_(layer.B)
    x = torch.randn(3, 12)
    expected = x @ (layer.W0 + 8.0 * layer.B @ layer.A).t()  # s = alpha / r = 8
    assert torch.allclose(layer(x), expected, atol=1e-5), (layer(x) - expected).abs().max()
    assert {n for n, _ in layer.named_parameters()} == {"A", "B"} and "W0" in dict(layer.named_buffers())
    with pytest.raises(ValueError, match="rank must be in"):
        ReLoRALinear(12, 20, rank=12, alpha=32.0)


def test_merge_keeps_the_function_and_restarts_the_factors():
    model, _ = trained_relora(lambda ps: AdamW(ps, lr=1e-2))
    idx = torch.randint(64, (2, 16))
    layers = [m for m in model.modules() if isinstance(m, ReLoRALinear)]
    assert all(layer.B.abs().max() > 0 for layer in layers), "training should have moved B off zero"
    before, old_A = model(idx)[0], [layer.A.detach().clone() for layer in layers]
    twin = copy.deepcopy(model)  # another DDP rank: the same generator seed draws the same A
    reset = relora_merge(model, torch.Generator().manual_seed(7))
    relora_merge(twin, torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    after = model(idx)[0]
    assert torch.allclose(before, after, atol=1e-5), f"logits moved by {(before - after).abs().max()}"
    assert len(reset) == 2 * len(layers) == 2 * 7 * 2  # A and B of 7 projections in each of 2 blocks
    for layer, A in zip(layers, old_A):
        assert torch.equal(layer.B, torch.zeros_like(layer.B))
        assert not torch.equal(layer.A, A)
        bound = 1 / layer.in_features**0.5  # kaiming_uniform(a=√5) draws A from U[-1/√in, 1/√in]
        assert layer.A.abs().max() <= bound and layer.A.std() > 0.4 * bound


@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=1e-2), lambda ps: Adam8bit(ps, lr=1e-2, min_8bit_size=256)],
                         ids=["adamw", "adam8bit"])
def test_merge_prunes_99_percent_of_the_factors_moments(make):
    model, opt = trained_relora(make)
    others = {p: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
              for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] not in ("A", "B")}
    reset = relora_merge(model)
    prune_state_([opt], reset, 0.99)
    for p in reset:
        state = opt.state[p]
        assert state["step"] == 3, "the step count (bias correction) goes on"
        names = ("exp_avg", "exp_avg_sq") if "exp_avg_sq" in state else ("exp_avg", "sqrt_exp_avg_sq")  # 8-bit: √v
        for name, signed in zip(names, (True, False)):
            values = state[name] if name in state else \
                dequantize_blockwise(state[f"{name}_codes"], state[f"{name}_absmax"], signed, p.numel())
            kept = int((values != 0).sum())
            assert 0 < kept <= p.numel() - int(0.99 * p.numel()), f"{name}: {kept} of {p.numel()} kept"
    for p, saved in others.items():  # everything else is untouched
        assert all(torch.equal(opt.state[p][k], v) for k, v in saved.items())


@pytest.mark.parametrize("n, fraction, kept", [(100, 0.99, 1), (90, 0.7, 27), (650, 0.7, 195), (7, 0.5, 4)])
def test_prune_zeroes_the_fraction_of_entries_it_is_given(n, fraction, kept):
    """fraction·n entries zeroed, rounded down: 0.7·90 is 62.99999999999999 in floating point, and 28 of 90 moments
    were kept where 27 is the 70% prune's."""
    x = torch.randperm(n).float() + 1  # distinct magnitudes: no ties at the threshold
    optim._prune_(x, fraction)
    assert int((x != 0).sum()) == kept


def test_prune_of_galore_8bit_counts_the_projected_moments():
    """GaLore's 8-bit moments are of the projected gradient (r·max(m, n) entries), not of the weight."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(96, 64))
    opt = GaLore(galore_param_groups([("W", W)], 4), inner="adam8bit", min_8bit_size=16)
    W.grad = torch.randn_like(W)
    opt.step()
    prune_state_([opt], [W], 0.5)
    state, n = opt.state[W], 4 * 96
    for name, signed in (("exp_avg", True), ("sqrt_exp_avg_sq", False)):
        values = dequantize_blockwise(state[f"{name}_codes"], state[f"{name}_absmax"], signed, n)
        kept = int((values != 0).sum())  # re-quantized, a few of the kept may round to 0
        assert 0.45 * n < kept <= n - n // 2, f"{name}: {kept} of {n} kept"


def test_prune_reaches_per_layer_optimizers():
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="relora", vocab_size=64))
    per = attach_per_layer(model, lambda ps: AdamW(ps, lr=1e-2))
    idx = torch.randint(64, (2, 17))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    reset = relora_merge(model)
    prune_state_(per.optimizers.values(), reset, 0.99)
    for p in reset:
        kept = int((per.optimizer_of[p].state[p]["exp_avg"] != 0).sum())
        assert kept <= p.numel() - int(0.99 * p.numel())


def test_a_restart_in_training_prunes_the_restarted_factors_moments():
    """train.relora_restart, as the loop calls it: at a reset step it merges, restarts the factors and prunes 99% of
    their moments (the smallest); the other parameters' moments stay; between resets it does nothing."""
    args = train.get_args(["--size", "tiny", "--method", "relora", "--num_training_steps", "10", "--relora_reset",
                           "2", "--relora_warmup", "1", "--relora_prune", "0.99"])
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="relora", vocab_size=64))
    opt = AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(64, (2, 17))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    before = {p: opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    train.relora_restart(args, model, [opt], 1)  # not a reset step
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in before.items())
    train.relora_restart(args, model, [opt], 2)
    factors = {p for m in model.modules() if isinstance(m, ReLoRALinear) for p in (m.A, m.B)}
    for p, m in before.items():
        kept = int((opt.state[p]["exp_avg"] != 0).sum())
        if p in factors:
            assert kept <= p.numel() - int(0.99 * p.numel()), f"{tuple(p.shape)}: {kept} moments kept"
        else:
            assert torch.equal(opt.state[p]["exp_avg"], m), "a moment of a parameter that did not restart changed"


def test_jagged_schedule_restarts_at_every_reset():
    args = train.get_args(["--size", "tiny", "--method", "relora", "--num_training_steps", "1000",
                              "--warmup_steps", "100", "--relora_reset", "200", "--relora_warmup", "20"])
    jagged = train.lr_lambda_for(args)
    args.method = "sltrain"
    cosine = train.lr_lambda_for(args)
    assert [jagged(s) for s in range(200)] == [cosine(s) for s in range(200)], "the first cycle is the usual one"
    for reset in (200, 400, 600, 800):
        assert jagged(reset) == 0.0
        assert jagged(reset + 10) == pytest.approx(0.5 * cosine(reset + 10))
        rest = range(reset + 20, reset + 200)
        assert [jagged(s) for s in rest] == [cosine(s) for s in rest]


def test_train_resume_is_bit_exact_across_a_merge(corpus, tmp_path):  # noqa: F811
    extra = ["--method", "relora", "--relora_reset", "2", "--relora_warmup", "1", "--warmup_steps", "1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(base_args(corpus, straight, 6, *extra))
    train.main(base_args(corpus, split, 6, "--stop_after", "3", *extra))  # merges after updates 2 and 4
    train.main(base_args(corpus, split, 6, "--resume", *extra))
    logs = metrics(straight)[0]
    assert [r["loss"] for r in logs] == [r["loss"] for r in metrics(split)[0]]
    # the lr logged at update k is the one it made its step with: 0 at the first (the warmup's start) and at the
    # first after every restart (after updates 2 and 4)
    assert [r["lr"] == 0 for r in logs] == [True, False, True, False, True, False], [r["lr"] for r in logs]
    sa, sb = final_state(straight)["model"], final_state(split)["model"]
    for name, t in sa.items():
        assert torch.equal(t, sb[name]), f"{name} differs by {(t - sb[name]).abs().max()}"


def test_raising_the_steps_at_a_restart_continues_the_cosine_not_the_jag(corpus, tmp_path):  # noqa: F811
    # the jag is 0 at a restart; the cosine under it is not, and the longer run goes on from the cosine's value
    extra = ["--method", "relora", "--relora_reset", "2", "--relora_warmup", "1", "--warmup_steps", "1", "--lr", "1e-2"]
    train.main(base_args(corpus, tmp_path, 8, "--stop_after", "4", *extra))  # the checkpoint is at restart 4
    train.main(base_args(corpus, tmp_path, 16, "--resume", *extra))
    floor, cosine = 0.1, lambda progress: 0.5 * (1 + math.cos(math.pi * progress))
    top = floor + (1 - floor) * cosine((4 - 1) / (8 - 1))  # where the old cosine stood at step 4
    for row in metrics(tmp_path)[0][4:]:  # the lr logged at update k is its own, lr_lambda(k - 1); 0 after a restart
        expected = 0.0 if row["step"] % 2 == 1 else \
            1e-2 * (floor + (top - floor) * cosine((row["step"] - 1 - 4) / (16 - 4)))
        assert row["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-15), (row, expected)


def test_a_run_that_ended_at_a_restart_makes_it_when_resumed_longer(corpus, tmp_path, monkeypatch):  # noqa: F811
    """A run's last update makes no restart (nothing trains after it); when a resume raises --num_training_steps,
    that restart is due, and is made before the first new update, with the step's generator as in a straight run."""
    merges = []
    merge = train.relora_merge
    monkeypatch.setattr(train, "relora_merge", lambda model, g: (merges.append(g.initial_seed()), merge(model, g))[1])
    extra = ["--method", "relora", "--relora_reset", "3", "--relora_warmup", "1", "--warmup_steps", "1"]
    train.main(base_args(corpus, tmp_path / "straight", 9, *extra))
    assert merges == [42 + 3, 42 + 6], merges
    merges.clear()
    train.main(base_args(corpus, tmp_path / "split", 6, *extra))
    assert merges == [42 + 3], merges  # none after update 6, the last
    train.main(base_args(corpus, tmp_path / "split", 9, "--resume", *extra))
    assert merges == [42 + 3, 42 + 6], merges


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_restart_merges_in_float32_rounded_once_as_export_does(dtype):
    """W0 after a restart is W0 + s·BA formed in float32 and rounded once into W0's dtype: what export.py --merged
    writes for the layer just before it. In bf16 (a GPU run's default), s·BA rounded to bf16 before the add rounded
    twice, one bf16 step off in about 5% of W0's entries."""
    torch.manual_seed(0)
    layer = ReLoRALinear(96, 160, rank=12, alpha=32.0).to(dtype)
    with torch.no_grad():
        layer.B.normal_(std=0.02)
    expected = copy.deepcopy(layer).float().merged_weight().to(dtype)  # export.merge's arithmetic
    layer.merge_and_reinit(torch.Generator().manual_seed(0))
    differ = layer.W0 != expected
    assert not differ.any(), (f"{differ.float().mean().item():.1%} of W0 differ from the merge rounded once, by up to "
                              f"{(layer.W0.float() - expected.float()).abs().max().item():.2e}")
