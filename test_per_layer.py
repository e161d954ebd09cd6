"""
Tests of per_layer.py: per-layer updates against the ordinary global step (one optimizer, one step after backward),
with gradient accumulation, a schedule, clipping, resume, a backward on another thread or cut short, reentrant
checkpoints, and DDP under torchrun with 2 processes (gloo).

    python -m pytest -q test_per_layer.py
"""

import contextlib
import copy
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from model import LLaMA, config_for
from optim import AdamW, Adam8bit
from per_layer import attach_per_layer
from sllinear import SLLinear
from test_optim import VOCAB, assert_same_params, bigram_batches, max_diff, one_thread, tiny_llama  # noqa: F401
from test_optim import same_state


def warmup(step):
    return min(1.0, (step + 1) / 4)  # a schedule that changes every step at first, so a miscount shows


OPTIMIZERS = {
    "AdamW": lambda ps: AdamW(ps, lr=3e-3, weight_decay=0.1),
    "Adam8bit": lambda ps: Adam8bit(ps, lr=3e-3, weight_decay=0.1, min_8bit_size=1024),  # both state kinds
    "Adam8bit(compile=True)": lambda ps: Adam8bit(ps, lr=3e-3, weight_decay=0.1, min_8bit_size=1024, compile=True),
}


def test_per_layer_updates_take_a_layers_gradient_norms_in_one_call():
    """The norms of a layer's gradients (summed into the logged norm) in one multi-tensor call per layer, not one
    each: on a GPU each is a launch the host issues. (The logged norm's value:
    test_per_layer_grad_norm_and_clipping.)"""
    from bench import ops_by_name
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="sltrain", vocab_size=VOCAB))
    per = attach_per_layer(model, lambda ps: AdamW(ps, lr=1e-3))
    x, y = bigram_batches(2, batch=2, T=16)
    model(x[0], y[0])[1].backward()  # the state appears
    ops = ops_by_name(lambda: model(x[1], y[1])[1].backward())
    assert ops["_foreach_norm"] == len(per.optimizers) and ops["linalg_vector_norm"] == 1, ops


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_per_layer_matches_global_step(name):
    """10 steps of 2 micro-batches each, with a warm-up schedule: the same parameters as one global step."""
    make = OPTIMIZERS[name]
    x, y = bigram_batches(20, batch=4, T=16)
    ref, model = tiny_llama(), tiny_llama()
    opt = make(ref.parameters())
    sched = LambdaLR(opt, warmup)
    per_layer = attach_per_layer(model, make, lr_lambda=warmup)
    for step in range(10):
        for i in (2 * step, 2 * step + 1):
            (ref(x[i], y[i])[1] / 2).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        before = [p.detach().clone() for p in model.parameters()]
        with per_layer.accumulating():
            (model(x[2 * step], y[2 * step])[1] / 2).backward()
        assert all(p.grad is not None for p in model.parameters()), "accumulating() must keep the gradients"
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "accumulating() must not step"
        (model(x[2 * step + 1], y[2 * step + 1])[1] / 2).backward()
        held = [n for n, p in model.named_parameters() if p.grad is not None]
        assert not held, f"gradients still held after backward: {held[:3]}"
        assert per_layer.steps == step + 1 and per_layer.get_last_lr() == sched.get_last_lr()
    assert_same_params(model, ref, f"per-layer {name} vs global")



@pytest.mark.parametrize("name", OPTIMIZERS)
def test_per_layer_updates_run_from_a_backward_on_another_thread(name):
    """On a GPU the autograd engine runs backward, and so the per-layer hooks, on a device thread of its own; the
    compiled step then first compiles there. A backward on a worker thread stands in for it: the same parameters
    as on the main thread, and no error."""
    import threading
    if "compile" in name:
        torch._dynamo.reset()  # compiled anew, in the thread, whatever other tests compiled on the main one
    x, y = bigram_batches(3, batch=2, T=16)
    models = [tiny_llama(), tiny_llama()]
    for model in models:
        attach_per_layer(model, OPTIMIZERS[name], lr_lambda=warmup)

    def train(model):
        for i in range(3):
            model(x[i], y[i])[1].backward()

    errors = []

    def in_worker():
        try:
            train(models[0])
        except Exception as e:  # an exception in a thread is only printed: hand it to the test
            errors.append(e)

    worker = threading.Thread(target=in_worker)
    worker.start()
    worker.join()
    assert not errors, errors
    train(models[1])
    assert_same_params(models[0], models[1], f"per-layer {name} on a worker thread vs the main thread")

def test_per_layer_steps_each_layer_once_and_keeps_the_per_parameter_format():
    model = tiny_llama()
    per_layer = attach_per_layer(model, OPTIMIZERS["Adam8bit"])
    modules = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    # SLLinear: B, A, values as one layer; q, k, v (and gate, up) sharing a call as one: 3 and 2 modules less a block
    layers = len(modules) - 3 * model.config.n_layers
    assert len(per_layer.optimizers) == layers < len(list(model.parameters()))
    sl = next(m for m in model.modules() if isinstance(m, SLLinear))
    assert per_layer.optimizer_of[sl.A] is per_layer.optimizer_of[sl.B] is per_layer.optimizer_of[sl.values]
    for group in model.shared_calls():  # one optimizer for the parameters of all the group's layers
        assert len({per_layer.optimizer_of[p] for layer in group for p in layer.parameters()}) == 1
    assert len(model.shared_calls()) == 2 * model.config.n_layers
    steps = []
    for opt in per_layer.optimizers.values():
        opt.register_step_post_hook(lambda opt, *_: steps.append(opt))
    x, y = bigram_batches(1, batch=2, T=16)
    model(x[0], y[0])[1].backward()
    assert len(steps) == len(set(steps)) == layers, "each layer's optimizer steps once per update"
    saved = per_layer.state_dict()["optimizers"]  # one entry per parameter, as one optimizer per parameter saves it
    assert set(saved) == {name for name, _ in model.named_parameters()}
    assert all(s["param_groups"][0]["params"] == [0] and set(s["state"]) == {0} for s in saved.values())


def test_per_layer_loads_a_state_saved_with_one_optimizer_per_parameter():
    """Checkpoints written when per-layer mode kept one optimizer per parameter load into the per-layer grouping and
    continue exactly as if it had run all along."""
    make = OPTIMIZERS["Adam8bit"]
    x, y = bigram_batches(5, batch=2, T=16)
    model = tiny_llama()
    per_layer = attach_per_layer(model, make)
    for i in range(5):
        model(x[i], y[i])[1].backward()
    old = tiny_llama()  # the former layout: make([p]) for every parameter, each stepped after backward
    opts = {name: make([p]) for name, p in old.named_parameters()}
    for i in range(3):
        old(x[i], y[i])[1].backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    for opt in opts.values():
        opt.param_groups[0]["initial_lr"] = opt.param_groups[0]["lr"]
    saved = {"steps": 3, "optimizers": {name: opt.state_dict() for name, opt in opts.items()}}
    resumed = attach_per_layer(old, make)
    resumed.load_state_dict(saved)
    for i in range(3, 5):
        old(x[i], y[i])[1].backward()
    assert_same_params(old, model, "resumed from per-parameter state vs grouped all along")


def test_per_layer_updates_a_layer_whose_other_parameter_got_no_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.used, layer.unused = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    per_layer = attach_per_layer(layer, lambda ps: AdamW(ps, lr=1e-2))
    before = [p.detach().clone() for p in (layer.used, layer.unused)]
    (layer.used ** 2).sum().backward()  # the layer's last gradient never comes: updated once backward ends
    assert not torch.equal(layer.used, before[0]) and torch.equal(layer.unused, before[1])
    assert layer.used.grad is None and per_layer.steps == 1 and per_layer.grad_norm() > 0


def test_per_layer_accumulation_updates_what_only_earlier_micro_batches_reached():
    """A parameter with a gradient from an earlier micro-batch and none from the last (a whole layer, b; or one of a
    layer's tensors, u beside w) is updated with it, counted in the norm and freed, as one optimizer step after
    ordinary accumulation does: the gradient is neither lost nor left to add into the next update."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.a, m.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        m.u, m.w = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))  # one layer: the root's
        return m
    x = torch.randn(2, 4)
    first = lambda m: m.a(x).sum() + m.b(x).sum() + (2 * m.u).sum() + (3 * m.w).sum()  # noqa: E731
    last = lambda m: m.a(x).pow(2).sum() + m.w.pow(2).sum()  # noqa: E731  (b and u: no gradient)
    ref, model = build(), build()
    opt = AdamW(ref.parameters(), lr=1e-2)
    per_layer = attach_per_layer(model, lambda ps: AdamW(ps, lr=1e-2))
    for _ in range(3):
        first(ref).backward()
        last(ref).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        with per_layer.accumulating():
            first(model).backward()
        last(model).backward()
        assert all(p.grad is None for p in model.parameters()), "a gradient was left for the next update"
        assert abs(per_layer.grad_norm().item() / norm.item() - 1) < 1e-6
    assert_same_params(model, ref, "accumulated gradients that the last micro-batch did not reach")


def test_per_layer_updates_a_float64_model_as_the_global_step():
    """The layers' gradient norms took float64 gradients to float32, which torch refuses: backward raised there."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).double()
    ref, model = build(), build()
    opt = AdamW(ref.parameters(), lr=1e-2)
    per_layer = attach_per_layer(model, lambda ps: AdamW(ps, lr=1e-2))
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):
        ref(x).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        assert abs(per_layer.grad_norm().item() / norm.item() - 1) < 1e-6
    assert_same_params(model, ref, "per-layer updates of a float64 model")


def test_per_layer_grad_norm_and_clipping():
    with pytest.raises(ValueError, match="max_grad_norm_per_param"):
        attach_per_layer(tiny_llama(), OPTIMIZERS["AdamW"], clip_grad_norm=1.0)
    x, y = bigram_batches(3, batch=4, T=16)
    ref, model = tiny_llama(), tiny_llama()
    opt = OPTIMIZERS["AdamW"](ref.parameters())
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"], max_grad_norm_per_param=0.05)
    for step in range(3):
        ref(x[step], y[step])[1].backward()
        norms = [torch.nn.utils.clip_grad_norm_([p], 0.05) for p in ref.parameters()]  # each clipped on its own
        opt.step()
        opt.zero_grad(set_to_none=True)
        model(x[step], y[step])[1].backward()
        total = torch.linalg.vector_norm(torch.stack(norms))
        assert abs(per_layer.grad_norm().item() / total.item() - 1) < 1e-5, \
            f"grad_norm {per_layer.grad_norm().item():.6f} vs {total.item():.6f}"
        assert min(norms) < 0.05 < max(norms), "the test should clip some tensors and not others"
    assert_same_params(model, ref, "per-parameter clipping")


def test_per_layer_grad_norm_sums_in_the_parameters_order():
    """The logged norm summed the layers' norms in the order backward reached them, which under DDP differs on a
    rebuilt model's first update (a resumed run logged another last bit): it is summed in the parameters' order, to
    the bit the norm of the same gradients taken in that order. (Layers whose gradients differ in scale by decades:
    their sum of squares rounds differently taken the other way.)"""
    from optim import _norms32
    for seed in range(100):  # which draws round differently reversed depends on the CPU's vector width
        torch.manual_seed(seed)
        scales = torch.logspace(-3, 3, 40)[torch.randperm(40)]
        model = torch.nn.ModuleList(torch.nn.Linear(8, 1, bias=False) for _ in scales)
        x = torch.randn(4, 8)
        grads = torch.autograd.grad(sum((layer(x) * s).sum() for layer, s in zip(model, scales)),
                                    list(model.parameters()))
        in_order = torch.linalg.vector_norm(torch.stack(_norms32(list(grads))))
        other = torch.linalg.vector_norm(torch.stack(_norms32(list(grads[::-1]))))
        if in_order != other:
            break
    assert in_order != other, "the test needs gradients whose norm depends on the order it is summed in"
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"])
    sum((layer(x) * s).sum() for layer, s in zip(model, scales)).backward()  # backward reaches the last layer first
    assert torch.equal(per_layer.grad_norm(), in_order), (per_layer.grad_norm().item(), in_order.item())


def test_per_layer_resume_is_bit_exact(tmp_path):
    make = OPTIMIZERS["Adam8bit"]
    x, y = bigram_batches(6, batch=4, T=16)
    model = tiny_llama()
    per_layer = attach_per_layer(model, make, lr_lambda=warmup)
    for step in range(6):
        if step == 3:
            torch.save({"model": model.state_dict(), "optim": per_layer.state_dict()}, tmp_path / "ck.pt")
        model(x[step], y[step])[1].backward()
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    resumed = tiny_llama(seed=1)
    resumed.load_state_dict(saved["model"])
    per_layer2 = attach_per_layer(resumed, make, lr_lambda=warmup)
    per_layer2.load_state_dict(saved["optim"])
    assert per_layer2.steps == 3
    for step in range(3, 6):
        resumed(x[step], y[step])[1].backward()
    assert per_layer2.steps == 6 and per_layer2.get_last_lr() == per_layer.get_last_lr()
    assert_same_params(resumed, model, "resumed vs uninterrupted")
    with pytest.raises(ValueError, match="does not match"):
        attach_per_layer(LLaMA(config_for("tiny", method="full", vocab_size=VOCAB)), make).load_state_dict(
            saved["optim"])


def test_per_layer_backward_that_raises_is_refused_until_reset():
    """A backward that raises part way (out of memory, an interrupt) never reaches the end that finishes an update:
    the next one is refused with the fix, and after reset() the update is made again at the same lr, from a batch's
    gradients alone (none of the failed backward's half is added in)."""
    class FailOnce(torch.autograd.Function):
        armed = True

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if FailOnce.armed:
                FailOnce.armed = False
                raise RuntimeError("out of memory (simulated)")
            return grad

    torch.manual_seed(0)
    net = torch.nn.ModuleDict(dict(first=torch.nn.Linear(4, 4), last=torch.nn.Linear(4, 1), mix=torch.nn.Module()))
    net["mix"].u, net["mix"].w = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    ref = copy.deepcopy(net)
    x = torch.randn(2, 4)
    lr_at = []
    per_layer = attach_per_layer(net, lambda ps: AdamW(ps, lr=0.1), lr_lambda=lambda k: lr_at.append(k) or 1.0)

    def loss(m):
        return m["last"](FailOnce.apply(m["first"](x) * m["mix"].w)).sum() + (m["mix"].u * x).sum()

    with pytest.raises(RuntimeError, match="simulated"):
        loss(net).backward()  # "last" is updated before the failure; "mix" has u's gradient and waits for w's
    assert net["mix"].u.grad is not None and net["mix"].w.grad is None
    with pytest.raises(RuntimeError, match=r"\(1 of 3 layers updated\): call reset\(\)"):
        loss(net).backward()
    per_layer.reset()
    assert all(p.grad is None for p in net.parameters())
    ref["last"].load_state_dict(net["last"].state_dict())  # it keeps the update made before the failure
    loss(net).backward()
    assert per_layer.steps == 1 and lr_at == [0, 0] and all(p.grad is None for p in net.parameters())
    loss(ref).backward()  # "first" and "mix" got one update, from one batch's gradients
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    assert per_layer.grad_norm().item() == pytest.approx(norm.item(), rel=1e-6), "a gradient of the failed " \
        "backward counted in the retried update's norm"
    for name in ("first", "mix"):
        AdamW(ref[name].parameters(), lr=0.1).step()
        for a, b in zip(ref[name].parameters(), net[name].parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: max diff {max_diff(a, b)}\n{m}")


def test_per_layer_after_a_backward_that_raised_a_micro_batch_that_accumulates_is_refused_too():
    """After a backward that raised part way, the next update's first micro-batches (inside accumulating()) were
    not refused: they ran, adding into whatever gradients the failed backward left, and the refusal came at the last
    one, whose reset() drops the earlier micro-batches' gradients too (rerun as the message said, "this batch", the
    update would use the last micro-batch's alone). The first backward after the failure is refused, and the message
    says to rerun the whole update."""
    fail = [True]

    def maybe_raise(grad):
        if fail:
            fail.pop()
            raise RuntimeError("out of memory (simulated)")
        return grad

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    per_layer = attach_per_layer(net, lambda ps: AdamW(ps, lr=0.1))
    x = torch.randn(2, 4)

    def loss():
        h = net[0](x)
        h.register_hook(maybe_raise)  # between the layers: the last is updated, then backward raises
        return net[1](h).sum()

    with pytest.raises(RuntimeError, match="simulated"):
        loss().backward()
    with pytest.raises(RuntimeError, match=r"\(1 of 2 layers updated\): call reset\(\) .*, then run the update "
                                           "again, all of its micro-batches"):
        with per_layer.accumulating():
            loss().backward()
    per_layer.reset()
    with per_layer.accumulating():
        loss().backward()
    loss().backward()
    assert per_layer.steps == 1 and all(p.grad is None for p in net.parameters())


def test_per_layer_reentrant_checkpoint_is_one_update():
    """A reentrant checkpoint's backward is a graph task nested in the outer one: its gradients belong to the same
    update, which is not refused as if an earlier backward had raised."""
    from torch.utils.checkpoint import checkpoint

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleDict(dict(a=torch.nn.Linear(8, 8), b=torch.nn.Linear(8, 8), head=torch.nn.Linear(8, 1)))

    def loss(m):
        h = torch.tanh(m["a"](x))
        return m["head"](checkpoint(lambda h: torch.tanh(m["b"](h)), h, use_reentrant=True)).sum()

    x = torch.randn(4, 8)
    ref, net = build(), build()
    opt = AdamW(ref.parameters(), lr=1e-2)
    per_layer = attach_per_layer(net, lambda ps: AdamW(ps, lr=1e-2))
    for step in range(3):
        loss(ref).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss(net).backward()
        assert per_layer.steps == step + 1
    assert_same_params(net, ref, "per-layer with a reentrant checkpoint")


def test_per_layer_refuses_an_older_8bit_state_before_loading_any_layer():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128))  # float32 moments, then 8-bit
    make = lambda ps: Adam8bit(ps, lr=1e-2, min_8bit_size=1000)  # noqa: E731
    per_layer = attach_per_layer(net, make)
    for _ in range(3):
        net(torch.randn(4, 64)).sum().backward()
    saved = per_layer.state_dict()
    for one in saved["optimizers"].values():  # the older format: v, not its square root
        for s in one["state"].values():
            for key in [k for k in s if k.startswith("sqrt_")]:
                s[key.removeprefix("sqrt_")] = s.pop(key)
    fresh = attach_per_layer(copy.deepcopy(net), make)
    with pytest.raises(ValueError, match="older format"):
        fresh.load_state_dict(saved)
    assert all(not opt.state for opt in fresh.optimizers.values()) and fresh.steps == 0


def test_per_layer_refuses_another_optimizers_state_with_no_layer_loaded():
    """Each layer's optimizer checks the state it is given as it loads it: a refusal at the second layer (an
    Adam8bit's 8-bit moments, loaded into AdamW) came after the first had loaded its float32 moments, leaving the
    run half resumed. A refusal now leaves every layer with its own state and names the parameters it was for."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128))  # float32 moments, then 8-bit
    per_layer = attach_per_layer(net, lambda ps: Adam8bit(ps, lr=1e-2, min_8bit_size=1000))
    for _ in range(3):
        net(torch.randn(4, 64)).sum().backward()
    twin = copy.deepcopy(net)
    other = attach_per_layer(twin, lambda ps: AdamW(ps, lr=1e-2))
    twin(torch.randn(4, 64)).sum().backward()  # a state of its own, which a refused load must leave as it was
    own = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"^1\.weight, 1\.bias: this state is an Adam8bit's"):
        other.load_state_dict(per_layer.state_dict())
    assert same_state(other.state_dict(), own) and other.steps == 1, "a layer kept the refused state"


def test_per_layer_refuses_a_parameter_trained_after_attach():
    """A parameter frozen at attach_per_layer and unfrozen after had no hook: its gradient piled up, never used, and
    nothing said so. Now the backward that meets it updates the rest, then refuses, naming it."""
    x, y = bigram_batches(3, batch=2, T=8)
    model = tiny_llama()
    model.norm.weight.requires_grad_(False)
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"])
    model.norm.weight.requires_grad_(True)
    for i in range(2):  # and again: refused at every update, not once
        with pytest.raises(RuntimeError, match=r"since then norm\.weight requires grad, so far not updated\. Set "
                                               r"requires_grad .* before attach_per_layer, or call it again"):
            model(x[i], y[i])[1].backward()
        assert model.norm.weight.grad is None and per_layer.steps == i + 1, "its gradient piles up"
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"])  # the fix the refusal names
    before = model.norm.weight.detach().clone()
    model(x[2], y[2])[1].backward()
    assert not torch.equal(model.norm.weight, before) and per_layer.steps == 1
    model.norm.weight.requires_grad_(False)
    per_layer.remove()  # the hooks of the parameters frozen at attach go too
    model.norm.weight.requires_grad_(True)
    model(x[2], y[2])[1].backward()


def test_per_layer_refuses_a_parameter_frozen_after_attach():
    """A parameter frozen after attach_per_layer held its layer's other gradients to the end of backward, silently
    losing the memory saving: the backward now updates the layer, then refuses, naming the parameter."""
    x, y = bigram_batches(1, batch=2, T=8)
    model = tiny_llama()
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"])
    o = model.layers[0].attn.o_proj
    o.A.requires_grad_(False)
    before = o.B.detach().clone()
    with pytest.raises(RuntimeError, match=r"since then layers\.0\.attn\.o_proj\.A no longer requires grad"):
        model(x[0], y[0])[1].backward()
    assert not torch.equal(o.B, before) and o.B.grad is None and per_layer.steps == 1


def test_per_layer_refuses_a_module_replaced_after_attach():
    """A module replaced after attach_per_layer: its new parameters had no hook and were never updated, silently."""
    x, y = bigram_batches(1, batch=2, T=8)
    model = tiny_llama()
    attach_per_layer(model, OPTIMIZERS["AdamW"])
    model.layers[0].attn.o_proj = new = copy.deepcopy(model.layers[0].attn.o_proj)
    with pytest.raises(RuntimeError, match=r"since then layers\.0\.attn\.o_proj\.A, layers\.0\.attn\.o_proj\.B, "
                                           r"layers\.0\.attn\.o_proj\.values was replaced by a new parameter"):
        model(x[0], y[0])[1].backward()
    assert all(p.grad is None for p in new.parameters())


def test_per_layer_remove_detaches():
    x, y = bigram_batches(1, batch=2, T=8)
    model = tiny_llama()
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"])
    per_layer.remove()
    before = [p.detach().clone() for p in model.parameters()]
    model(x[0], y[0])[1].backward()
    assert all(p.grad is not None for p in model.parameters()) and per_layer.steps == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_per_layer_removed_and_dropped_frees_its_optimizers():
    """After remove() the model held the PerLayer still, and with it every layer's optimizer state: a run that went on
    with an ordinary optimizer kept two sets of moments."""
    x, y = bigram_batches(1, batch=2, T=8)
    model = tiny_llama()
    per_layer = attach_per_layer(model, OPTIMIZERS["AdamW"])
    model(x[0], y[0])[1].backward()
    moment = weakref.ref(next(iter(per_layer.optimizers["lm_head"].state.values()))["exp_avg"])
    weak = weakref.ref(per_layer)
    per_layer.remove()
    del per_layer
    gc.collect()
    assert weak() is None and moment() is None, "the removed PerLayer's optimizer state outlived every reference to it"
    assert model._per_layer is None


def test_per_layer_attached_again_replaces_the_first_while_it_is_held():
    """A second attach_per_layer on the same model replaces the first: its hooks went only once it was collected, so
    while the caller held it both updated (or the second found the gradients freed and crashed)."""
    x, y = bigram_batches(1, batch=2, T=8)
    model, twin = tiny_llama(), tiny_llama()
    twin.load_state_dict(model.state_dict())
    first = attach_per_layer(model, OPTIMIZERS["AdamW"])
    second = attach_per_layer(model, OPTIMIZERS["AdamW"])
    alone = attach_per_layer(twin, OPTIMIZERS["AdamW"])
    for m in (model, twin):
        m(x[0], y[0])[1].backward()
    assert (first.steps, second.steps, alone.steps) == (0, 1, 1)
    assert all(not opt.state for opt in first.optimizers.values()), "the replaced PerLayer updated too"
    assert_same_params(model, twin, "attached twice, against once")


def test_a_model_with_per_layer_updates_is_freed_once_dropped():
    """A parameter's hooks are held in C++, out of the garbage collector's sight: hooks that held the PerLayer made a
    cycle (parameter -> hook -> PerLayer -> parameter) that was never freed, so every model given per-layer updates
    in one process (a sweep, a benchmark's settings) kept its parameters and moments to the end."""
    x, y = bigram_batches(2, batch=2, T=8)
    model = tiny_llama()
    per_layer = attach_per_layer(model, OPTIMIZERS["Adam8bit"])
    weak = [weakref.ref(t) for t in (model.layers[0].attn.q_proj.values, per_layer)]
    model(x[0], y[0])[1].backward()
    assert per_layer.steps == 1
    del per_layer  # the model holds it: a caller that drops it still gets its updates
    before = [p.detach().clone() for p in model.parameters()]
    model(x[1], y[1])[1].backward()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "updates stopped with the PerLayer"
    twin = copy.deepcopy(model)  # a copy's parameters have no hooks: no per-layer updates, and no copy of the moments
    assert twin._per_layer is None and model._per_layer.steps == 2
    del model, twin
    gc.collect()
    assert all(ref() is None for ref in weak), "the model or its PerLayer outlived every reference to them"


def test_per_layer_ddp_matches_global_ddp():
    """Two processes on gloo, each with its own data: per-layer DDP ends with the parameters of DDP + one optimizer."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    result = subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True,
                            text=True, timeout=180)
    print(result.stdout)
    assert result.returncode == 0, f"torchrun worker failed:\n{result.stdout}\n{result.stderr[-3000:]}"


def _ddp_worker():
    """The worker of test_per_layer_ddp_matches_global_ddp, started by torchrun."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = 4
    x, y = bigram_batches(2 * steps * world, batch=4, T=16)
    failures = []
    # (optimizer, gradient_as_bucket_view, wrap the first micro-batch in no_sync)
    for name, bucket_view, no_sync in [("AdamW", False, True), ("Adam8bit", True, True), ("AdamW", True, False)]:
        make = OPTIMIZERS[name]
        ref = DDP(tiny_llama(), gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.05)  # several buckets
        per = DDP(tiny_llama(), gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.05)
        opt = make(ref.parameters())
        sched = LambdaLR(opt, warmup)
        per_layer = attach_per_layer(per, make, lr_lambda=warmup)
        worst_norm = 0.0
        for step in range(steps):
            first, last = [(x[i], y[i]) for i in ((2 * step) * world + rank, (2 * step + 1) * world + rank)]
            with ref.no_sync():
                (ref(*first)[1] / 2).backward()
            (ref(*last)[1] / 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            with per.no_sync() if no_sync else contextlib.nullcontext(), per_layer.accumulating():
                (per(*first)[1] / 2).backward()
            (per(*last)[1] / 2).backward()
            if any(p.grad is not None for p in per.parameters()):
                failures.append(f"{name}: gradients still held after backward")
            worst_norm = max(worst_norm, abs(per_layer.grad_norm().item() / norm.item() - 1))
        diff = max(max_diff(a, b) for a, b in zip(ref.parameters(), per.parameters()))
        # the same on every rank: each used the averaged gradient, not its own
        flat = torch.cat([p.detach().flatten() for p in per.parameters()])
        spread = flat.clone()
        dist.broadcast(spread, src=0)
        across = torch.tensor(max_diff(flat, spread))
        dist.all_reduce(across, op=dist.ReduceOp.MAX)
        across = across.item()
        line = (f"{name} bucket_view={bucket_view} no_sync={no_sync}: max diff vs global {diff:.3e}, "
                f"across ranks {across:.3e}, grad_norm rel err {worst_norm:.1e}, steps {per_layer.steps}")
        if rank == 0:
            print(line, flush=True)
        # with no_sync both runs add the same float32 numbers in the same order: equal to the bit. Without it, each
        # micro-batch is all-reduced on its own and summed after, another order of the same sum (seen: up to 3e-6)
        tolerance = 0.0 if no_sync else 2e-5
        if diff > tolerance or across != 0 or worst_norm > 1e-5 or per_layer.steps != steps:
            failures.append(line)
        # DDP's reducers must go before the process group does: a gloo group torn down under them can abort
        per_layer.remove()
        del ref, per, per_layer, opt, sched
        gc.collect()
    # unused parameters come to the hook as zeros in a bucket, indistinguishable from a real gradient: refused
    unused = DDP(tiny_llama(), find_unused_parameters=True)
    try:
        attach_per_layer(unused, OPTIMIZERS["AdamW"])
        failures.append("find_unused_parameters=True was not refused")
    except ValueError as e:
        if "find_unused_parameters=False" not in str(e):
            failures.append(f"find_unused_parameters=True refused with: {e}")
    del unused
    gc.collect()
    dist.destroy_process_group()
    if failures:
        print(f"rank {rank} FAILED:\n" + "\n".join(failures), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("this is the torchrun worker of test_per_layer_ddp_matches_global_ddp; run: python -m pytest -q "
                 "test_per_layer.py")
    _ddp_worker()
