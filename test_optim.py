"""
Tests of optim.py against references: torch.optim.AdamW step for step, a brute-force nearest code for the 8-bit
quantization, float32 AdamW for Adam8bit's per-step error and training loss. Per-layer updates: test_per_layer.py.

    python -m pytest -q test_optim.py
"""

import copy
import os

import pytest
import torch

import optim
from bench import count_ops, heavy_tailed
from hostsync import HostSyncs
from model import LLaMA, config_for
from galore import GaLore
from optim import AdamW, Adam8bit, clip_grad_norm32, dequantize_blockwise, dynamic_map, quantize_blockwise
from per_layer import attach_per_layer

VOCAB = 256


@pytest.fixture(autouse=True)
def one_thread():
    # the tensors here are small: one thread is as fast, and immune to stalled OpenMP threads on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def max_diff(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LLaMA(config_for("tiny", method="sltrain", vocab_size=VOCAB))


def bigram_batches(n, batch=8, T=32, seed=0):
    """n batches (x, y) of token streams drawn from a fixed random bigram table whose rows favour a few successors:
    learnable, with an entropy floor well above zero so that loss ratios mean something."""
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(VOCAB, VOCAB, generator=gen) * 3).softmax(-1)
    tokens = torch.empty(n * batch, T + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (n * batch,), generator=gen)
    for t in range(T):
        tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen).squeeze(1)
    tokens = tokens.view(n, batch, T + 1)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def assert_same_params(model, ref, what, atol=0.0):
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=atol,
                                   msg=lambda m: f"{what}: {name} max diff {max_diff(a, b):.3e}\n{m}")


# -----------------------------------------------------------------------------
# AdamW

@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_matches_torch(weight_decay, foreach):
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in [(32, 16), (16,), (7, 5, 3)]]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]  # noqa: E731
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=weight_decay)
    opt = AdamW(groups(ours), lr=1e-2, weight_decay=weight_decay, foreach=foreach)
    for step in range(100):
        for i, (a, b) in enumerate(zip(ref, ours)):
            g = None if (step + i) % 7 == 0 else torch.randn_like(a)  # missing gradients: per-tensor step counts
            a.grad, b.grad = g, None if g is None else g.clone()
        opt_ref.step()
        opt.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, msg=lambda m: f"AdamW vs torch after 100 steps: max diff "
                                                       f"{max_diff(a, b):.3e}\n{m}")


def test_adamws_multi_tensor_calls_hold_a_bounded_temporary(monkeypatch):
    """One multi-tensor call over a whole group made √v̂ + ε for every tensor at once: a copy of all of v beside the
    model and its state at the step's peak (13 GB at 7b). Each call now takes runs of FOREACH_BYTES (a larger tensor
    alone), in order, and the updates are torch's still."""
    monkeypatch.setattr(optim, "FOREACH_BYTES", 4000)  # bytes: runs of a few of these float32 tensors
    calls, sqrt = [], torch._foreach_sqrt
    monkeypatch.setattr(torch, "_foreach_sqrt", lambda ts: calls.append([t.numel() * 4 for t in ts]) or sqrt(ts))
    torch.manual_seed(0)
    shapes = [(10, 30), (400,), (30, 30), (8,), (5, 50), (3000,), (7,)]  # bytes: 1200 1600 3600 32 1000 12000 28
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref, opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1), AdamW(ours, lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ref.step()
        opt.step()
    assert calls == [[1200, 1600], [3600, 32], [1000], [12000], [28]] * 5, calls
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a)


def test_adamw_resumed_from_a_torch_adamw_state_keeps_its_multi_tensor_calls(monkeypatch):
    """torch.optim.AdamW's state carries foreach=None, its default, which replaced ours: None read as False, and every
    later step went one tensor at a time (a launch per tensor and operation on a GPU). None means multi-tensor."""
    calls, sqrt = [], torch._foreach_sqrt
    monkeypatch.setattr(torch, "_foreach_sqrt", lambda ts: calls.append(len(ts)) or sqrt(ts))
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 4), (4,), (3,)]]
    ref = torch.optim.AdamW(params, lr=1e-2)
    opt = AdamW(params, lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert calls == [3], f"one multi-tensor call for the three tensors, got calls over {calls}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_global_norm_and_clipping_are_float32_whatever_the_gradients(dtype):
    """train.py's global clipping: the norm of the gradients as they are (float64 reference), where torch's is
    rounded to bf16 for bf16 gradients, and a clipped norm of max_norm to float32 accuracy; float32 gradients get
    torch's norm and torch's clipped gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in ((300, 70), (70,), (5, 3, 7))]
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 0.3).to(dtype)
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params])).item()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins):
        q.grad = p.grad.clone()
    norm = clip_grad_norm32(params, float("inf"))
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(exact, rel=1e-5)
    theirs = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    norm = clip_grad_norm32(params, 1.0)
    assert norm.item() == pytest.approx(exact, rel=1e-5), "the norm before clipping"
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params])).item()
    if dtype == torch.float32:
        assert theirs.item() == pytest.approx(norm.item(), rel=1e-6)
        for p, q in zip(params, twins):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        assert clipped == pytest.approx(1.0, rel=1e-5)
    else:  # the gradients rounded to bf16 after the float32 factor: their norm within bf16 rounding of 1
        assert theirs.dtype == torch.bfloat16 and abs(theirs.item() / exact - 1) > 1e-4, "torch's is rounded"
        assert clipped == pytest.approx(1.0, rel=2e-3)


def test_the_global_norm_and_clipping_take_float64_gradients():
    """Float64 gradients (a float64 model, which AdamW steps as torch's does) are normed in float64, not refused for
    narrowing to float32: the norm and the clipped gradients are torch's, the norm returned in float32."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in ((30, 7), (7,))]
    for p in params:
        p.grad = torch.randn_like(p)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins):
        q.grad = p.grad.clone()
    theirs = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    norm = clip_grad_norm32(params, 1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(theirs.item(), rel=1e-6)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_clipping_one_tensor_clips_it_as_torch_does():
    """torch's clip_grad_norm_ takes one tensor for a list of it; iterated, a tensor gave its rows, which have no
    gradient: the norm came back 0 and nothing was clipped."""
    p, q = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4, 3))
    p.grad, q.grad = torch.full((4, 3), 2.0), torch.full((4, 3), 2.0)
    theirs = torch.nn.utils.clip_grad_norm_(q, 1.0)
    norm = clip_grad_norm32(p, 1.0)
    assert norm.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_adamw_continues_from_torch_adamw_state():
    """A state saved by torch.optim.AdamW (its step a tensor) loads into ours, which then steps as torch's would."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in [(32, 16), (16,)]]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    grads = [[torch.randn_like(p) for p in ref] for _ in range(6)]
    for step in range(6):
        if step == 3:
            ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
            opt = AdamW(ours, lr=1e-2, weight_decay=0.1)
            opt.load_state_dict(copy.deepcopy(opt_ref.state_dict()))
        for i, p in enumerate(ref):
            p.grad = grads[step][i].clone()
        opt_ref.step()
        if step >= 3:
            for i, p in enumerate(ours):
                p.grad = grads[step][i].clone()
            opt.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: Adam8bit(ps, lr=1e-2, weight_decay=0.1),
], ids=["AdamW", "Adam8bit"])
def test_state_dict_round_trip_is_bit_exact(make, tmp_path):
    torch.manual_seed(0)
    # (100, 129) has a partial last block and 8-bit state; (33,) float32 state
    params = [torch.nn.Parameter(torch.randn(100, 129)), torch.nn.Parameter(torch.randn(33))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(10)]
    opt = make(params)
    for step in range(10):
        if step == 5:
            torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, tmp_path / "ck.pt")
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = make(resumed)
    opt2.load_state_dict(saved["opt"])
    if isinstance(opt2, Adam8bit):
        state = opt2.state[resumed[0]]
        assert state["exp_avg_codes"].dtype == torch.uint8 and state["sqrt_exp_avg_sq_absmax"].dtype == torch.float32
    for step in range(5, 10):
        for p, g in zip(resumed, grads[step]):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(params, resumed):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"resume: max diff {max_diff(a, b)}\n{m}")


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2),
    lambda ps: Adam8bit(ps, lr=1e-2),
    lambda ps: GaLore([{"params": ps, "rank": 2}], lr=1e-2),
], ids=["AdamW", "Adam8bit", "GaLore"])
def test_step_with_a_closure_returns_its_loss_and_uses_its_gradients(make):
    # torch.optim's contract: step(closure) re-evaluates under grad mode even inside no_grad, then updates
    torch.manual_seed(0)
    p, ref = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(8, 6))
    with torch.no_grad():
        ref.copy_(p)
    opt, opt_ref = make([p]), make([ref])

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    (ref ** 2).sum().backward()
    opt_ref.step()
    assert loss.item() > 0 and opt.step() is None
    opt_ref.step()
    torch.testing.assert_close(p, ref, rtol=0, atol=0, msg=lambda m: f"closure: max diff {max_diff(p, ref)}\n{m}")


@pytest.mark.parametrize("min_8bit_size", [4096, 10**9], ids=["8-bit", "float32 state"])
def test_adam8bit_refuses_a_state_of_parameters_of_other_sizes(min_8bit_size):
    """A state saved for parameters of other sizes (another model's, or these in another order) is refused at the
    load, in one line that names the parameter: it loaded, and an 8-bit parameter smaller than its state's went on
    stepping with the first blocks of another tensor's moments (torch.optim.AdamW raises at the step). A refused
    state leaves the optimizer as it was."""
    torch.manual_seed(0)
    big, small = torch.nn.Parameter(torch.randn(100, 128)), torch.nn.Parameter(torch.randn(50, 128))
    saved = Adam8bit([big, small], min_8bit_size=min_8bit_size)
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    saved.step()
    state = saved.state_dict()
    swapped = Adam8bit([small, big], min_8bit_size=min_8bit_size)  # the same tensors, in another order
    with pytest.raises(ValueError, match=r"parameter 0 of this optimizer, \(50, 128\), has 6400 entries; the "
                                         r"state's has moments for 12800: .* load it into an optimizer"):
        swapped.load_state_dict(state)
    assert not swapped.state, "a refused state must leave the optimizer as it was"
    fitting = Adam8bit([torch.nn.Parameter(big.detach().clone()), torch.nn.Parameter(small.detach().clone())],
                       min_8bit_size=min_8bit_size)
    fitting.load_state_dict(state)  # parameters of the sizes it was saved with


@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=1e-3), lambda ps: torch.optim.AdamW(ps, lr=1e-3)],
                         ids=["optim.AdamW", "torch.optim.AdamW"])
def test_adam8bit_refuses_an_adamw_state(make):
    """An AdamW's state loaded into Adam8bit kept its float32 moments for every tensor (AdamW's 8 bytes a parameter,
    not 2, without a word), and its param groups, which replace ours, have no block_size or min_8bit_size: a tensor
    that had no state yet stopped the first step with KeyError: 'min_8bit_size'. Refused at the load, in one line."""
    torch.manual_seed(0)
    stepped, not_yet = torch.nn.Parameter(torch.randn(100, 128)), torch.nn.Parameter(torch.randn(50, 128))
    adamw = make([stepped, not_yet])
    stepped.grad = torch.randn_like(stepped)
    adamw.step()
    opt = Adam8bit([stepped, not_yet])
    with pytest.raises(ValueError, match="this state is not an Adam8bit's: its param groups have no block_size .* "
                                         "continue with the optimizer that saved it, or start Adam8bit afresh"):
        opt.load_state_dict(adamw.state_dict())
    assert not opt.state and "block_size" in opt.param_groups[0], "a refused state leaves the optimizer as it was"
    # per-layer updates pack a layer's saved state into the layer optimizer's own groups, which have our settings
    model = torch.nn.Linear(128, 100)  # its weight takes 8-bit moments in Adam8bit
    per = attach_per_layer(model, make)
    model(torch.randn(4, 128)).sum().backward()
    with pytest.raises(ValueError, match=r"it holds float32 moments for parameter 0, \(100, 128\), which Adam8bit "
                                         "keeps in 8 bits"):
        attach_per_layer(model, Adam8bit).load_state_dict(per.state_dict())


@pytest.mark.parametrize("group,message", [
    ({"block_size": 0}, "block_size must be an int >= 1, got 0"),  # was a ZeroDivisionError at the first step
    ({"block_size": 256.0}, r"block_size must be an int >= 1, got 256.0"),  # a TypeError from torch.zeros
    ({"betas": (0.9, 1.5)}, r"betas must be in \[0, 1\), got \(0.9, 1.5\)"),  # a complex bias correction
    ({"lr": -1e-3}, "lr must be >= 0, got -0.001"),  # stepped up the gradient, without a word
], ids=["block_size 0", "block_size float", "betas", "lr"])
def test_adam8bit_checks_each_param_groups_own_settings(group, message):
    """The constructor checked its arguments, but a param group's own lr, betas or block_size reached the first step
    unchecked (after a forward and a backward): each group is checked as it is added, the constructor's and later
    ones, and a refused group is not left half added."""
    p, q = torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(64, 128))
    with pytest.raises(ValueError, match=message):
        Adam8bit([{"params": [p], **group}])
    if "block_size" in group:  # the constructor's own argument too
        with pytest.raises(ValueError, match=message):
            Adam8bit([p], block_size=group["block_size"])
    opt = Adam8bit([p])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [q], **group})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("group,message", [
    ({"lr": -1e-3}, "lr must be >= 0, got -0.001"),  # stepped up the gradient, without a word
    ({"betas": (1.0, 0.999)}, r"betas must be in \[0, 1\), got \(1.0, 0.999\)"),  # a ZeroDivisionError at step
    ({"lr": torch.tensor(1e-3)}, "lr must be a number, got a tensor: pass float"),
    ({"eps": -1e-8}, "eps must be >= 0, got -1e-08"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),  # grew the weights
], ids=["lr", "betas", "tensor lr", "eps", "weight_decay"])
def test_adamw_checks_each_param_groups_own_settings(group, message):
    """AdamW's constructor checked its arguments, but a param group's own settings reached step() unchecked: each
    group is checked as it is added, the constructor's and later ones, and a refused group is not left half added.
    A group that overrides nothing bad still steps as torch.optim.AdamW does."""
    p, q = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=message):
        AdamW([{"params": [p], **group}])
    opt = AdamW([p])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [q], **group})
    assert len(opt.param_groups) == 1
    ref_q = torch.nn.Parameter(q.detach().clone())
    opt.add_param_group({"params": [q], "lr": 1e-2, "weight_decay": 0.1})
    ref = torch.optim.AdamW([{"params": [ref_q], "lr": 1e-2, "weight_decay": 0.1}])
    for _ in range(3):
        g = torch.randn(8, 4)
        q.grad, ref_q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(q, ref_q, rtol=0, atol=1e-6)


def test_adam8bit_refuses_a_non_contiguous_8bit_parameter_when_given_it():
    """The 8-bit state is the parameter's flat storage, which a non-contiguous parameter does not have: refused when
    it is given (it was refused at the first step, after a forward and a backward), in one line that names the fix.
    Below min_8bit_size one takes float32 moments and steps as torch's AdamW does."""
    transposed = torch.nn.Parameter(torch.randn(128, 64).t())  # (64, 128), not contiguous
    with pytest.raises(ValueError, match=r"this \(64, 128\) one is not contiguous: make it contiguous or raise "
                                         "min_8bit_size above its size"):
        Adam8bit([transposed])
    opt = Adam8bit([torch.nn.Parameter(torch.randn(64, 128))])
    with pytest.raises(ValueError, match="not contiguous"):
        opt.add_param_group({"params": [transposed], "lr": 1e-2})
    assert len(opt.param_groups) == 1
    ref = torch.nn.Parameter(transposed.detach().clone())  # contiguous
    opt = Adam8bit([transposed], weight_decay=0.1, min_8bit_size=10**9)
    ref_opt = torch.optim.AdamW([ref], weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(64, 128)
        transposed.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(transposed, ref, rtol=0, atol=0)
    given = torch.nn.Parameter(torch.randn(64, 128))
    opt = Adam8bit([given])
    given.data = torch.randn(128, 64).t()  # made non-contiguous after it was given: refused at the step
    given.grad = torch.randn(64, 128)
    for _ in range(2):  # the same refusal again, not a KeyError of a half-made state
        with pytest.raises(ValueError, match="not contiguous"):
            opt.step()
    assert not opt.state[given], f"a refused step must leave no state, left {dict(opt.state[given])}"


def test_adam8bit_refuses_the_older_state_format():
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = Adam8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()
    s = state["state"][0]
    s["exp_avg_sq_codes"], s["exp_avg_sq_absmax"] = s.pop("sqrt_exp_avg_sq_codes"), s.pop("sqrt_exp_avg_sq_absmax")
    fresh = Adam8bit([p])
    with pytest.raises(ValueError, match="stores v, an older format"):
        fresh.load_state_dict(state)
    assert not fresh.state, "a refused state must leave the optimizer as it was"
    fresh.step()  # and it still works
    galore = GaLore([{"params": [p], "rank": 4}], inner="adam8bit")
    with pytest.raises(ValueError, match="stores v, an older format"):
        galore.load_state_dict(state)
    assert not galore.state


# -----------------------------------------------------------------------------
# 8-bit quantization

@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map(signed):
    code = dynamic_map(signed)
    assert code.shape == (256,) and code.dtype == torch.float32
    assert torch.equal(code, code.sort().values) and code.unique().numel() == 256, "codes must be sorted and distinct"
    assert (code == 0).sum() == 1 and code.max() == 1.0
    assert (code < 0).sum() == (127 if signed else 0)
    # the tree: decade 10^-e holds 2^(6-e) positive codes (2^(7-e) unsigned), finest for the largest magnitudes
    for e in range(7):
        in_decade = ((code >= 0.1 * 10.0**-e) & (code < 10.0**-e)).sum().item()
        assert in_decade == 2 ** (6 - e + (not signed)), f"decade 1e-{e}: {in_decade} codes"


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code(signed):
    torch.manual_seed(0)
    code = dynamic_map(signed)
    mids = ((code[:-1].double() + code[1:].double()) / 2).float()
    n = 20000
    # uniform, log-uniform down to 1e-9, every code, every midpoint and its float32 neighbours, zero and denormals
    around = [torch.nextafter(mids.abs(), torch.tensor(v)) for v in (0.0, 2.0)]
    magnitudes = torch.cat([torch.rand(n), 10.0 ** (-9 * torch.rand(n)), code.abs(), mids.abs(), *around,
                            torch.tensor([0.0, 1e-40, 1e-30, 1.0])])
    x = magnitudes * (torch.randint(0, 2, magnitudes.shape) * 2 - 1 if signed else 1)
    x = torch.cat([x, torch.zeros(-x.numel() % 255)]).view(-1, 255)
    x = torch.cat([torch.ones(x.shape[0], 1), x], dim=1).view(-1)  # a 1 in every block: absmax 1, no rescaling
    codes, absmax = quantize_blockwise(x, signed=signed)
    assert codes.dtype == torch.uint8 and absmax.dtype == torch.float32 and bool((absmax == 1).all())
    brute = (x.double()[:, None] - code.double()[None, :]).abs().argmin(dim=1)  # first minimum: ties go down
    if not signed:  # v: a positive value never rounds to code 0 but to the smallest positive code
        assert int(((brute == 0) & (x > 0)).sum()) > 100, "the test should have positive values nearest to code 0"
        brute = torch.where(x > 0, brute.clamp(min=1), brute)
    bad = (codes.long() != brute).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} codes differ from the brute-force argmin, e.g. x={x[bad[:3]].tolist()}"
    search = torch.bucketize(x.double(), (code[:-1].double() + code[1:].double()) / 2)
    search = search if signed else torch.where(x > 0, search.clamp(min=1), search)
    assert torch.equal(codes.long(), search), "codes differ from bucketize on the midpoints"
    assert torch.equal(dequantize_blockwise(codes, absmax, signed, x.numel()), code[brute])


def test_quantize_decodes_denormal_and_zero_blocks():
    x = torch.tensor([1e-40, 0.0, 3e-39, -2e-39, 0.0, 0.0, 0.0, 0.0])  # a block of denormals, and one of zeros
    codes, absmax = quantize_blockwise(x, signed=True, block_size=4)
    back = dequantize_blockwise(codes, absmax, True, x.numel())
    torch.testing.assert_close(back, x, rtol=0.2, atol=0, msg=lambda m: f"denormal block: {back.tolist()}\n{m}")


# -----------------------------------------------------------------------------
# Adam8bit

def test_adam8bit_state_bytes_per_param():
    big, small = torch.nn.Parameter(torch.randn(1024, 1024)), torch.nn.Parameter(torch.randn(64))
    opt = Adam8bit([big, small])
    big.grad, small.grad = torch.randn_like(big), torch.randn_like(small)
    opt.step()
    def state_bytes(p):
        return sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))

    per_param = state_bytes(big) / big.numel()
    print(f"Adam8bit state on a 1024x1024 tensor: {per_param:.5f} bytes/param")
    assert per_param <= 2.04, f"{per_param:.4f} bytes/param"
    assert opt.state[small]["exp_avg"].dtype == torch.float32 and state_bytes(small) == 8 * small.numel()


@pytest.mark.parametrize("sync_to", ["8-bit", "float32"])
def test_adam8bit_per_step_error_vs_adamw(sync_to):
    """bitsandbytes' protocol: every step both optimizers start from the same parameter and moments and take the same
    gradient; the mean absolute and relative differences of the updates must stay under 6e-5 and 6e-4.
    sync_to="8-bit": the float32 AdamW takes the dequantized 8-bit moments, as in bitsandbytes' test; this checks that
    the parameter moves with the step's float32 moments, at every step. sync_to="float32": the 8-bit optimizer takes
    the quantized float32 moments, so each step also carries one round of quantization; checked on the 50-step mean."""
    torch.manual_seed(0)
    p32 = torch.nn.Parameter(torch.randn(300, 1030) * 0.1)  # 5 chunks, a partial last block
    p8 = torch.nn.Parameter(p32.detach().clone())
    ref, opt = AdamW([p32]), Adam8bit([p8])
    errors, relative = [], []
    for step in range(50):
        g = torch.randn_like(p32) * 0.01
        p32.grad, p8.grad = g, g.clone()
        ref.step()
        opt.step()
        err = (p8 - p32).detach().abs()
        errors.append(err.mean().item())
        relative.append((err / (p32.detach().abs() + 1e-9)).mean().item())
        with torch.no_grad():  # re-sync
            p8.copy_(p32)
        s, r = opt.state[p8], ref.state[p32]
        for name, key, signed in [("exp_avg", "exp_avg", True), ("exp_avg_sq", "sqrt_exp_avg_sq", False)]:
            power = 1 if signed else 2  # the 8-bit state holds m and √v
            if sync_to == "8-bit":
                stored = dequantize_blockwise(s[f"{key}_codes"], s[f"{key}_absmax"], signed, g.numel())
                r[name].view(-1).copy_(stored**power)
            else:
                s[f"{key}_codes"], s[f"{key}_absmax"] = quantize_blockwise(r[name] ** (1 / power), signed)
    mean_err, mean_rel = sum(errors) / len(errors), sum(relative) / len(relative)
    print(f"Adam8bit vs AdamW, synced to the {sync_to} state every step: mean abs error of the update {mean_err:.2e} "
          f"(worst step {max(errors):.2e}), relative {mean_rel:.2e} (worst step {max(relative):.2e})")
    if sync_to == "8-bit":  # the same float32 moments in, the same update out: only rounding may differ
        assert max(errors) < 1e-9, f"the update does not use the step's float32 moments: error {max(errors):.3e}"
    err, rel = (max(errors), max(relative)) if sync_to == "8-bit" else (mean_err, mean_rel)
    assert err < 6e-5, f"mean abs error of the update {err:.3e}"
    assert rel < 6e-4, f"mean relative error of the update {rel:.3e}"


@pytest.mark.parametrize("shape", [(64, 128), (10,)], ids=["8-bit", "float32 state"])
def test_adam8bit_weight_decay_is_adamws(shape):
    """Decoupled weight decay, p ← p·(1 - lr·wd), as torch's AdamW, on both of Adam8bit's paths (8-bit moments, and
    the float32 ones of a tensor under min_8bit_size). With zero gradients the moments stay 0 and the decay is all
    that moves the weights: the same to the bit; with real gradients the small tensors' path is AdamW's math."""
    torch.manual_seed(0)
    p8 = torch.nn.Parameter(torch.randn(shape))
    p32, start = torch.nn.Parameter(p8.detach().clone()), p8.detach().clone()
    opt, ref = Adam8bit([p8], lr=0.05, weight_decay=0.1), torch.optim.AdamW([p32], lr=0.05, weight_decay=0.1)
    for step in range(3):
        p8.grad, p32.grad = torch.zeros_like(p8), torch.zeros_like(p32)
        opt.step()
        ref.step()
        torch.testing.assert_close(p8, p32, rtol=0, atol=0, msg=lambda m: f"step {step}: {max_diff(p8, p32)}\n{m}")
    assert torch.allclose(p8, start * (1 - 0.05 * 0.1) ** 3), "three steps of decay, and nothing else"
    if len(shape) == 1:
        for step in range(3):
            g = torch.randn(shape)
            p8.grad, p32.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            torch.testing.assert_close(p8, p32, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}: {m}")


def test_adam8bit_small_tensors_keep_float32_moments_for_bf16_parameters():
    """train.py keeps bf16 parameters on a GPU: a tensor under min_8bit_size (norms, biases) still gets float32
    moments, not bf16 ones, whose v would lose the small squared gradients."""
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = Adam8bit([p])
    opt.step()
    assert {k: t.dtype for k, t in opt.state[p].items() if torch.is_tensor(t) and t.is_floating_point()} == \
        {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}


def step_beside_a_twin_without_non_finite(make, params, steps=4):
    """make(params) and make(twins of params) take the same random gradients for `steps` steps, but in step 1 three
    entries of each gradient are NaN, inf and -inf, and the twin's are 0: the parameters must stay finite and equal to
    their twins'. Returns the first optimizer."""
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, twin_opt = make(params), make(twins)
    for step in range(steps):
        for p, t in zip(params, twins):
            g = torch.randn_like(p)
            p.grad, t.grad = g.clone(), g.clone()
            if step == 1:  # an overflowing step
                p.grad.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
                t.grad.view(-1)[:3] = 0.0
        opt.step()
        twin_opt.step()
        for p, t in zip(params, twins):
            assert bool(p.isfinite().all()), f"step {step}: non-finite entries in the {tuple(p.shape)} parameter"
            torch.testing.assert_close(p, t, rtol=0, atol=0, msg=lambda m: f"step {step}: {max_diff(p, t)}\n{m}")
    return opt


def test_adam8bit_non_finite_gradients_count_as_zero():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(10))]  # 8-bit and float32
    opt = step_beside_a_twin_without_non_finite(Adam8bit, params)
    s = opt.state[params[0]]
    assert bool(s["exp_avg_absmax"].isfinite().all() and s["sqrt_exp_avg_sq_absmax"].isfinite().all())


@pytest.mark.parametrize("big", [1e22, 3e38])
def test_adam8bit_gradient_that_overflows_v_freezes_its_entry_as_adamw_does(big):
    """A finite |g| past ~1e19 makes (1-β2)·g² inf: torch's AdamW then holds that entry still (m / inf = 0) and
    goes on; the 8-bit state must not turn the entry's whole block into NaN. The block's other entries do stall:
    their √v are coded against the block's absmax, float32's largest value, so none decodes below ~1e32 (the cost of
    one scale per 256 entries, until β2 decays it); every other block goes on as in AdamW."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))  # 8-bit state; blocks of 256: (0, 3) is in rows 0 and 1
    ref = torch.nn.Parameter(p.detach().clone())
    lr, steps = 1e-3, 4
    opt, ref_opt = Adam8bit([p], lr=lr), torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    start = p.detach().clone()
    for step in range(steps):
        g = torch.randn_like(p)
        if step == 0:
            g[0, 3] = big
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert bool(p.isfinite().all()), f"{int((~p.isfinite()).sum())} non-finite entries"
    assert p[0, 3] == start[0, 3] == ref[0, 3], "the entry whose v overflowed stays where it was, as in AdamW"
    others = max_diff(p[2:], ref[2:])
    assert others <= steps * lr / 10, f"max diff {others} from torch AdamW outside the overflow's block"
    stalled = max_diff(p[:2], start[:2])  # after the first step (each entry's first move is m/√v, about lr)
    assert stalled <= 1.01 * lr, f"the overflow's block moved {stalled}, which its absmax should stall"


@pytest.mark.parametrize("method", ["sltrain", "full"])
def test_adam8bit_trains_tiny_llama_like_adamw(method):
    x, y = bigram_batches(204)
    losses = {}
    for name, make in [("AdamW", lambda ps: AdamW(ps, lr=3e-3)),
                       ("Adam8bit", lambda ps: Adam8bit(ps, lr=3e-3, min_8bit_size=0))]:  # every tensor in 8 bits
        torch.manual_seed(0)
        model = LLaMA(config_for("tiny", method=method, vocab_size=VOCAB))
        opt = make(model.parameters())
        for step in range(200):
            model(x[step], y[step])[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # held-out batches
            losses[name] = sum(model(x[i], y[i])[1].item() for i in range(200, 204)) / 4
    ratio = losses["Adam8bit"] / losses["AdamW"]
    print(f"tiny {method} LLaMA, 200 steps: loss AdamW {losses['AdamW']:.4f}, Adam8bit {losses['Adam8bit']:.4f}, "
          f"ratio {ratio:.4f}")
    assert losses["AdamW"] < 4.0, f"the reference did not learn: loss {losses['AdamW']:.3f}"
    assert abs(ratio - 1) < 0.02, f"loss ratio Adam8bit / AdamW = {ratio:.4f}"


@pytest.mark.parametrize("case", ["short rows", "long rows", "values"])
def test_adam8bit_heavy_tailed_gradients_stay_near_adamw(case):
    """Blocks that mix gradients 1000x apart (rows shorter than a block, rows of several blocks, a values vector of
    random rows): over 200 steps every update stays within 10·lr (float32 AdamW's are about 1·lr), and the 8-bit
    parameters end within half of float32 AdamW's whole move from float32 AdamW's. Storing v with code 0 allowed
    gave updates up to 7.7e3·lr / 3.1e4·lr and ended 6.1x / 22.7x AdamW's move away on short rows / values."""
    worst32, worst8, distance = heavy_tailed(case)
    print(f"heavy-tailed {case}: max |update|/lr AdamW {worst32:.2f}, Adam8bit {worst8:.2f}; "
          f"||p8 - p32|| / ||p32 - p0|| {distance:.3f}")
    assert worst8 <= 10, f"an update of {worst8:.1f}·lr"
    assert distance <= 0.5, f"||p8 - p32|| / ||p32 - p0|| = {distance:.3f} after 200 steps"


def test_adam8bit_whole_tensor_path_has_bounded_ops_and_matches_chunks(monkeypatch):
    """The path taken on GPUs, forced on CPU: one step issues a fixed number of operations whatever the tensor's
    size, and gives the parameters and state of the chunked CPU path to the bit."""
    import optim

    def run(shape, whole, steps=3):
        monkeypatch.setattr(optim, "CHUNKED_DEVICES", set() if whole else {"cpu"})
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(shape) * 0.1)
        opt = Adam8bit([p], weight_decay=0.1)
        for _ in range(steps - 1):
            p.grad = torch.randn(shape) * 0.01
            opt.step()
        p.grad = torch.randn(shape) * 0.01
        return p, opt.state[p], count_ops(opt.step)

    small, large = (64, 1030), (600, 1030)  # 1 and 5 chunks on CPU, partial last blocks
    ops = {(shape, whole): run(shape, whole)[2] for shape in (small, large) for whole in (True, False)}
    print(f"ops of one step: whole tensor {ops[small, True]} / {ops[large, True]}, "
          f"chunked {ops[small, False]} / {ops[large, False]} ({small} / {large})")
    assert ops[small, True] == ops[large, True] <= 80, f"whole-tensor step: {ops[small, True]} / {ops[large, True]}"
    assert ops[large, False] > ops[small, False], "the chunked path should issue more operations on more chunks"
    (p_whole, s_whole, _), (p_chunk, s_chunk, _) = run(large, True), run(large, False)
    torch.testing.assert_close(p_whole, p_chunk, rtol=0, atol=0)
    for key in s_whole:
        assert torch.equal(torch.as_tensor(s_whole[key]), torch.as_tensor(s_chunk[key])), f"state {key} differs"


@pytest.mark.parametrize("on_device", [False, True], ids=["numbers", "on_device"])
def test_adam8bit_compiled_step_agrees_with_eager_and_compiles_once(on_device):
    """compile=True, the fused step meant for GPUs, run here by inductor on CPU: the same state format, the same
    parameters up to float32 rounding (and the few codes that rounding sends the other way), and one graph for
    every size (of a number of dimensions), learning rate and step count, so a schedule never recompiles. The same
    with the step sizes read from the device (on_device: as under train.py --cuda_graph --per_layer --compile)."""
    from cudagraph import DeviceScalars
    torch._dynamo.reset()  # compiled anew here, whatever other tests compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    lr, steps = 1e-3, 12
    for shape in ((64, 1030), (40, 256), (5000,), (4096,)):  # partial last blocks; two sizes through each graph
        p0 = torch.randn(shape) * 0.05
        params = [torch.nn.Parameter(p0.clone()) for _ in range(2)]
        eager, compiled = [Adam8bit([p], lr=lr, weight_decay=0.1, compile=c) for p, c in zip(params, (False, True))]
        if on_device:
            eager.device_scalars, compiled.device_scalars = (DeviceScalars(torch.device("cpu")) for _ in range(2))
        for step in range(steps):
            g = torch.randn(shape) * 1e-3
            for p, opt in zip(params, (eager, compiled)):
                opt.param_groups[0]["lr"] = lr * (step + 1) / steps  # a warm-up: a new lr every step
                p.grad = g.clone()
                opt.step()
        diff = (params[0] - params[1]).abs()
        assert diff.max() < 0.25 * lr and diff.mean() < 1e-4 * lr, (shape, diff.max().item(), diff.mean().item())
        s_eager, s_compiled = eager.state[params[0]], compiled.state[params[1]]
        assert {k: (v.dtype, v.shape) for k, v in s_eager.items() if torch.is_tensor(v)} == \
            {k: (v.dtype, v.shape) for k, v in s_compiled.items() if torch.is_tensor(v)}
        for key in ("exp_avg_codes", "sqrt_exp_avg_sq_codes"):
            assert (s_eager[key] != s_compiled[key]).float().mean() < 1e-3, (shape, key)
        assert (params[0] - p0).abs().max() > 5 * lr, "the parameters should have moved"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    assert graphs == 2, f"{graphs} graphs compiled for 2-D and 1-D tensors: a size, lr or step count recompiled"


def test_adam8bit_compiled_rounds_a_bf16_parameter_as_eager_does():
    """Eager (as torch's AdamW, and the one-kernel step) rounds a bf16 parameter after its weight decay and again
    after the step; fused into the compiled update, the decayed value stayed float32 and a fifth of the entries
    came out a bf16 step apart after one update. The decay now comes first, eagerly: the two agree but for the odd
    entry that float32 rounding of the update sends the other way."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    p0 = torch.randn(20000).bfloat16()
    params = [torch.nn.Parameter(p0.clone()) for _ in range(2)]
    eager, compiled = [Adam8bit([p], lr=1e-2, weight_decay=0.1, compile=c) for p, c in zip(params, (False, True))]
    for _ in range(3):
        g = torch.randn(20000).bfloat16()
        for p, opt in zip(params, (eager, compiled)):
            p.grad = g.clone()
            opt.step()
    apart = (params[0] != params[1]).float().mean().item()
    assert apart < 1e-3, f"{apart:.2%} of the bf16 entries differ between the eager and the compiled step"
    assert (params[0].float() - p0.float()).abs().max() > 1e-2, "the parameters should have moved"


def test_adam8bit_gpu_path_keeps_temporaries_to_a_piece(monkeypatch):
    """Off CPU (forced here) a tensor larger than optim.PIECE is updated piece by piece: no temporary of its size
    (~31 bytes per entry: 4 GB for a 7b embedding whole), and to the bit the same as in one piece."""
    import optim
    monkeypatch.setattr(optim, "CHUNKED_DEVICES", set())

    def step(piece):
        monkeypatch.setattr(optim, "PIECE", piece)
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(300, 1000).to(torch.bfloat16))
        opt = Adam8bit([p], weight_decay=0.1)
        for i in range(3):
            p.grad = (torch.randn(300, 1000) * 1e-2).to(torch.bfloat16)
            if i == 0:
                opt.step()  # the first step allocates the state
            else:
                largest = largest_new_tensor(opt.step)
        return p, opt.state[p], largest

    (p_pieces, s_pieces, largest), (p_whole, s_whole, whole) = step(32768), step(1 << 20)
    assert largest <= 32768 < 300 * 1000 <= whole, (largest, whole)
    assert torch.equal(p_pieces, p_whole) and same_state(s_pieces, s_whole)


def largest_new_tensor(fn):
    """The most entries of a tensor that fn() allocates (views, aliases and in-place results aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if torch.is_tensor(a)}
            fresh = [t for t in (out if isinstance(out, (list, tuple)) else [out])
                     if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs]  # not views or aliases
            Largest.n = max([Largest.n] + [t.numel() for t in fresh])
            return out

    with Largest():
        fn()
    return Largest.n


def same_state(a, b):
    """Two (nested) optimizer states hold equal values, tensors to the bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make,rows", [
    (lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1), 1),  # one multi-tensor update of both
    (lambda ps: Adam8bit(ps, lr=1e-2, weight_decay=0.1, min_8bit_size=64, block_size=32), 2)],  # each its own
    ids=["adamw", "adam8bit"])
def test_step_sizes_read_from_the_device_update_as_numbers_do(make, rows, dtype):
    """With device_scalars set (cudagraph.DeviceScalars, under a CUDA graph), the step size, decay and bias
    correction come as 0-dim tensors: the same update as with numbers, to the bit, float32 and bf16 parameters.
    Small (float32 moments) and 8-bit tensors both."""
    from cudagraph import DeviceScalars
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in ((8,), (16, 12))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    numbers, tensors = make(params), make(twins)
    tensors.device_scalars = DeviceScalars(torch.device("cpu"))
    for step in range(1, 4):
        for a, b in zip(params, twins):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        for opt in (numbers, tensors):
            opt.param_groups[0]["lr"] = 1e-2 / step
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(params, twins)), step
    assert same_state(numbers.state_dict(), tensors.state_dict())
    assert len(tensors.device_scalars.groups) == rows  # one row of numbers on the device per update call


@pytest.mark.parametrize("per_layer,compile,dtype,kernel", [(True, False, torch.bfloat16, False),
                                                            (False, False, torch.bfloat16, False),
                                                            (True, True, torch.float32, False),
                                                            (True, False, torch.bfloat16, True)],
                         ids=["per-layer", "global", "per-layer-compiled", "per-layer-kernel"])
def test_adam8bit_small_tensors_together_match_one_by_one(monkeypatch, per_layer, compile, dtype, kernel):
    """Off CPU (forced here) consecutive small 8-bit tensors are updated as one run: the same parameters and state,
    to the bit, as one update per tensor, in far fewer operations; with the one-kernel step (here: told it can run,
    its launch the eager update), in far fewer launches."""
    import adam8bit_kernel
    import optim
    monkeypatch.setattr(optim, "CHUNKED_DEVICES", set())
    launches = []
    if kernel:
        monkeypatch.setattr(adam8bit_kernel, "why_not", lambda device, dtype, block_size: None)
        monkeypatch.setattr(adam8bit_kernel, "adam8bit_", lambda *a: launches.append(1) or optim._adam8bit_(*a))

    def train(together, steps=3):
        if not together:
            monkeypatch.setattr(optim.Adam8bit, "_runs", lambda self, params, limit: [[p] for p in params])
        launches.clear()
        torch.manual_seed(0)
        model = LLaMA(config_for("tiny", method="sltrain", vocab_size=VOCAB)).to(dtype)
        make = lambda ps: Adam8bit(ps, lr=1e-3, weight_decay=0.1, min_8bit_size=65, compile=compile)  # noqa: E731
        per = attach_per_layer(model, make) if per_layer else None
        opt = None if per_layer else make(model.parameters())
        x, y = bigram_batches(steps + 1, batch=2, T=16)

        def step(i):
            model(x[i], y[i])[1].backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        for i in range(steps - 1):
            step(i)
        with watcher.watch(ops=not compile):
            step(steps - 1)
        ops = count_ops(lambda: step(steps)) if not compile else None
        return model, (per or opt).state_dict(), ops, len(launches)

    watcher = HostSyncs()

    (together, state, ops, launched), (alone, state_alone, ops_alone, launched_alone) = train(True), train(False)
    syncs = watcher.summary()
    assert_same_params(together, alone, "together vs one by one")
    assert same_state(state, state_alone), "the 8-bit state differs"
    if kernel:
        assert 0 < launched < 0.5 * launched_alone, (launched, launched_alone)
    if not compile:
        print(f"ops of a step: {ops} together, {ops_alone} one by one")
        assert ops < 0.75 * ops_alone, (ops, ops_alone)
        assert syncs == "none", f"the runs' copies made the host wait: {syncs}"


def test_a_runs_states_stay_end_to_end_so_later_updates_copy_none_of_them(monkeypatch, tmp_path):
    """After a run's first update (off CPU, forced here) each tensor's 8-bit state is its view of the run's, end to
    end, one storage per kind: later updates neither cat the states nor copy them back (on a GPU, 4 copies in and 4
    out per run and update, of ~2 bytes an entry). A checkpoint of such views loads and goes on to the bit as the
    optimizer that was never saved."""
    import optim
    from bench import ops_by_name
    monkeypatch.setattr(optim, "CHUNKED_DEVICES", set())
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7000, 10000, 3000)]  # 7000: the last block padded
    make = lambda: Adam8bit(params, lr=1e-2, weight_decay=0.1, min_8bit_size=256)  # noqa: E731
    opt = make()

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    step(0)
    for key in ("exp_avg_codes", "exp_avg_absmax", "sqrt_exp_avg_sq_codes", "sqrt_exp_avg_sq_absmax"):
        parts = [opt.state[p][key] for p in params]
        assert len({t.untyped_storage().data_ptr() for t in parts}) == 1, key
        ends = [t.storage_offset() + t.numel() for t in parts]
        assert [t.storage_offset() for t in parts] == [0] + ends[:-1], key
    ops = ops_by_name(lambda: step(1))
    assert ops["cat"] == 0 and ops["_foreach_copy_"] == 3, ops  # parameters and gradients in, parameters out
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = [p.detach().clone() for p in params]
    step(2)
    straight = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, q in zip(params, saved):
            p.copy_(q)
    opt = make()
    opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
    step(2)
    assert all(torch.equal(p, q) for p, q in zip(params, straight))
    state_bytes = sum(t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert os.path.getsize(tmp_path / "opt.pt") < 1.2 * state_bytes  # each storage once, not once per view


def test_what_these_optimizers_lack_is_refused():
    """A tensor lr (torch's fused and capturable paths take one), and a torch.optim.AdamW state with amsgrad or
    maximize, would be stepped as something else: each is refused in one line that names the fix."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    for make in (lambda lr: AdamW([p], lr=lr), lambda lr: Adam8bit([p], lr=lr), lambda lr: GaLore([p], lr=lr)):
        with pytest.raises(ValueError, match=r"lr must be a number, got a tensor: pass float\(lr\)"):
            make(torch.tensor(0.01))
    for flag in ("amsgrad", "maximize"):
        ref = torch.optim.AdamW([p], lr=1e-2, **{flag: True})
        p.grad = torch.randn(8, 8)
        ref.step()
        with pytest.raises(ValueError, match=f"with {flag}=True, which optim.AdamW does not have: continue with torch"):
            AdamW([p], lr=1e-2).load_state_dict(ref.state_dict())
    # torch.optim.Adam's weight decay is added to the gradient (L2), not decoupled: stepped here it would be AdamW's
    ref = torch.optim.Adam([p], lr=1e-2, weight_decay=0.1)
    ref.step()
    with pytest.raises(ValueError, match="decoupled_weight_decay=False, which optim.AdamW does not have: continue "
                                         "with torch.optim.Adam"):
        AdamW([p], lr=1e-2).load_state_dict(ref.state_dict())
    AdamW([p], lr=1e-2).load_state_dict(torch.optim.Adam([p], lr=1e-2).state_dict())  # without decay: the same Adam


def test_complex_parameters_are_refused():
    """torch.optim.AdamW steps a complex parameter as its real and imaginary parts (v of |g|², not g²); ours took it
    as it came: AdamW's v became g² (complex) and its updates another optimizer's, Adam8bit's moments kept the real
    part alone and the imaginary part never trained. Refused, in one line that names the fix, when the parameter is
    given (the constructor, or a param group added later); GaLore too, whose plain-Adam groups are these steps."""
    z, real = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64)), torch.nn.Parameter(torch.randn(8, 8))
    for make in (AdamW, Adam8bit, GaLore):
        with pytest.raises(ValueError, match=rf"^{make.__name__} takes real parameters, not a \(4, 3\) complex64 one: "
                                             r"use torch.optim.AdamW"):
            make([real, z])
        opt = make([real])
        with pytest.raises(ValueError, match="takes real parameters"):
            opt.add_param_group({"params": [z]})
        assert len(opt.param_groups) == 1, "a refused group is not added"
    for make in (lambda ps: AdamW(ps), lambda ps: Adam8bit(ps), GaLore, torch.optim.AdamW):  # a generator, read once
        assert len(make(p for p in [real]).param_groups[0]["params"]) == 1


@pytest.mark.parametrize("make", [lambda ps: AdamW(ps, lr=1e-2), lambda ps: Adam8bit(ps, lr=1e-2)],
                         ids=["AdamW", "Adam8bit"])
def test_a_state_of_other_parameters_is_refused_at_load(make):
    """torch.optim matches a saved state to the parameters by position only. Passed in another order (or of another
    model), a float32 state of another shape failed mid-step, after the parameters before it had moved (AdamW's
    decay applied). Refused at load, in one line, leaving the optimizer as it was; the state loads into its own
    parameters, in their order."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 128), (32, 128), (33,)]]
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    fresh = make([params[i] for i in (1, 0, 2)])
    with pytest.raises(ValueError, match=r"parameter 0 of this optimizer, \(32, 128\), has 4096 entries; the state's "
                                         r"has moments for 8192: .* in their order"):
        fresh.load_state_dict(saved)
    assert not fresh.state, "a refused state must leave the optimizer as it was"
    make(params).load_state_dict(saved)


def test_adamw_refuses_an_adam8bit_state():
    """An Adam8bit's codes loaded into AdamW failed at the step with a KeyError; refused at the load."""
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = Adam8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    with pytest.raises(ValueError, match=r"this state is an Adam8bit's \(8-bit moments for parameter 0\), not an "
                                         "AdamW's; continue with the optimizer that saved it, or start AdamW afresh"):
        AdamW([p]).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2), lambda ps: Adam8bit(ps, lr=1e-2), lambda ps: Adam8bit(ps, lr=1e-2, min_8bit_size=1),
    lambda ps: GaLore([{"params": ps, "rank": None}], lr=1e-2, inner="adam8bit"),
    lambda ps: GaLore([{"params": ps, "rank": 2}], lr=1e-2),
], ids=["AdamW", "Adam8bit", "Adam8bit 8-bit", "GaLore plain", "GaLore projected"])
def test_sparse_gradients_are_refused_at_every_step(make):
    """A sparse gradient (nn.Embedding(sparse=True)) is refused in one line, at the first step and at a later one,
    as after a resume from a run with dense gradients: Adam8bit refused it only when it made the state, and later
    stopped in torch's aten::lerp_ or reshape (having counted the step) instead."""
    emb = torch.nn.Embedding(64, 8, sparse=True)
    opt = make(emb.parameters())
    for dense in (False, True, False):
        emb.weight.grad = None
        emb(torch.tensor([1, 5])).sum().backward()
        if dense:  # a state as a dense run (or its checkpoint) leaves it
            emb.weight.grad = emb.weight.grad.to_dense()
            opt.step()
            continue
        counted = lambda: [s.get("step") for s in opt.state.values() if s]  # noqa: E731
        before, steps = emb.weight.detach().clone(), counted()
        with pytest.raises(RuntimeError, match="does not take sparse gradients"):
            opt.step()
        assert torch.equal(emb.weight, before) and counted() == steps, f"a refused step counted: {counted()}"
