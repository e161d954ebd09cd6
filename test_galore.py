"""
Tests of GaLore (galore.GaLore) against the equations written out here, its projection schedule and state, its
8-bit and per-layer variants, and exact resume across a projection refresh, in the optimizer and in train.py.

    python -m pytest -q test_galore.py
"""

import copy

import pytest
import torch

import train
from model import LLaMA, config_for
from galore import GaLore, galore_param_groups
from optim import AdamW, Adam8bit
from per_layer import attach_per_layer
from test_optim import step_beside_a_twin_without_non_finite
from test_train import base_args, corpus, final_state, metrics  # noqa: F401  (corpus is a fixture)


def reference_galore(W, grads, rank, gap, lr, scale, betas, eps, weight_decay):
    """GaLore from its equations, in float64: P from the SVD of G every `gap` updates, Adam on R as GaLore's AdamW
    (Hugging Face's) makes it, ε added to √v and the bias corrections in the step size, W -= lr·scale·N."""
    W, (b1, b2) = W.double().clone(), betas
    m = v = P = None
    right = W.shape[0] >= W.shape[1]
    for t, G in enumerate(grads, start=1):
        G = G.double()
        if (t - 1) % gap == 0:
            U, _, Vh = torch.linalg.svd(G.float(), full_matrices=False)
            P = (Vh[:rank] if right else U[:, :rank]).double()  # (r, n) or (m, r)
        R = G @ P.T if right else P.T @ G  # (m, r) or (r, n)
        m = (1 - b1) * R if m is None else b1 * m + (1 - b1) * R
        v = (1 - b2) * R * R if v is None else b2 * v + (1 - b2) * R * R
        N = (1 - b2**t) ** 0.5 / (1 - b1**t) * m / (v.sqrt() + eps)
        W = W * (1 - lr * weight_decay) - lr * scale * (N @ P if right else P @ N)
    return W


@pytest.mark.parametrize("shape", [(24, 10), (10, 24), (12, 12)], ids=["right", "left", "square"])
def test_steps_match_the_equations(shape):
    """Both sides of the projection, and the square case, which GaLore's code projects on the right (m >= n)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(shape))
    grads = [torch.randn(shape) for _ in range(5)]
    hyper = dict(lr=0.01, scale=0.25, betas=(0.9, 0.999), weight_decay=0.1)
    expected = reference_galore(W.detach(), grads, rank=3, gap=2, eps=1e-6, **hyper)  # GaLore's AdamW's default ε
    opt = GaLore([dict(params=[W], rank=3)], update_gap=2, **hyper)
    for G in grads:
        W.grad = G.clone()
        opt.step()
    diff = (W.detach().double() - expected).abs().max().item()
    assert diff < 1e-6, f"GaLore differs from its equations by {diff}"


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_unprojected_weights_step_as_galores_adamw(weight_decay):
    """GaLore's code steps the embeddings, norms and head with the same AdamW as the projections: ε = 1e-6 added to
    √v, and the group's weight decay, decoupled and applied before the update as on the projected weights."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6))
    grads = [torch.randn(6) * 1e-5 for _ in range(4)]  # small: ε weighs
    (b1, b2), lr, expected, m, v = (0.9, 0.999), 1e-2, w.detach().double().clone(), 0, 0
    for t, g in enumerate(grads, start=1):
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        expected *= 1 - lr * weight_decay
        expected -= lr * (1 - b2**t) ** 0.5 / (1 - b1**t) * m / (v.sqrt() + 1e-6)
    opt = GaLore([dict(params=[w], rank=None)], lr=lr, weight_decay=weight_decay)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    diff = (w.detach().double() - expected).abs().max().item()
    assert diff < 1e-6, f"GaLore's plain AdamW differs from GaLore's code by {diff} (weight decay {weight_decay})"


def test_projection_is_recomputed_every_gap_updates_and_state_is_projected():
    torch.manual_seed(0)
    tall, wide, bias = (torch.nn.Parameter(torch.randn(s)) for s in [(20, 8), (8, 20), (8,)])
    opt = GaLore([dict(params=[tall, wide], rank=2), dict(params=[bias], rank=None)], update_gap=3)
    seen = []
    for t in range(1, 8):
        for p in (tall, wide, bias):
            p.grad = torch.randn_like(p)
        G = tall.grad.clone()
        opt.step()
        state = opt.state[tall]
        seen.append(state["projection_step"])
        if state["projection_step"] == t:  # computed at this update, from this update's gradient
            assert torch.allclose(state["projector"], torch.linalg.svd(G, full_matrices=False)[2][:2])
    assert seen == [1, 1, 1, 4, 4, 4, 7]
    assert opt.state[tall]["exp_avg"].shape == (20, 2) and opt.state[tall]["projector"].shape == (2, 8)  # m x r
    assert opt.state[wide]["exp_avg"].shape == (2, 20) and opt.state[wide]["projector"].shape == (8, 2)  # r x n
    assert opt.state[bias]["exp_avg"].shape == (8,) and "projector" not in opt.state[bias]  # plain Adam


def test_8bit_state_is_the_projected_size_and_tracks_float32():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(512, 64) * 0.02)
    W32, start = torch.nn.Parameter(W.detach().clone()), W.detach().clone()
    opt8 = GaLore([dict(params=[W], rank=16)], inner="adam8bit", lr=1e-3)
    opt32 = GaLore([dict(params=[W32], rank=16)], inner="adamw", lr=1e-3)
    for _ in range(5):
        G = torch.randn(512, 64)
        W.grad, W32.grad = G.clone(), G.clone()
        opt8.step()
        opt32.step()
    state = opt8.state[W]
    assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_codes"].numel() == 512 * 16  # m x r codes
    moved, diff = (W32 - start).norm().item(), (W - W32).norm().item()
    assert diff < 0.05 * moved, f"8-bit GaLore drifts from float32 GaLore by {diff} (relative to a move of {moved})"


def test_8bit_non_finite_gradients_count_as_zero():
    """As Adam8bit (test_optim.py): a non-finite gradient entry counts as zero in 8-bit GaLore, and before the SVD,
    where a single NaN or inf would spoil the projector and with it the whole weight. A twin whose gradient holds
    zeros there steps identically. update_gap=1: the overflowing step computes a projector."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(8, 24))]  # 8-bit and float32
    # moments: (64, 4), past min_8bit_size, and (4, 24) below it
    opt = step_beside_a_twin_without_non_finite(
        lambda ps: GaLore([dict(params=ps, rank=4)], inner="adam8bit", update_gap=1, min_8bit_size=128), params)
    assert "exp_avg_codes" in opt.state[params[0]] and "exp_avg" in opt.state[params[1]]


def test_a_non_finite_gradient_at_a_refresh_goes_through_as_adamw():
    """Over AdamW a non-finite gradient is not zeroed (AdamW's own poisons the weight, and train.py stops the run in
    one line): at a refresh too the step goes on, its projector from the finite entries, where the SVD of the NaN
    gradient would raise LinAlgError out of the run. A finite gradient gives the projector of the gradient itself."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(12, 8))
    opt = GaLore([dict(params=[W], rank=2)], update_gap=1)
    G = torch.randn(12, 8)
    G[0, 0] = float("nan")
    W.grad = G.clone()
    opt.step()
    finite = torch.nan_to_num(G, nan=0.0)
    assert torch.equal(opt.state[W]["projector"], torch.linalg.svd(finite, full_matrices=False)[2][:2])
    assert not W.isfinite().all(), "the NaN goes on into the weight, as in AdamW, for the run's check to stop it"


def test_a_galore_adamw_run_whose_gradient_turns_nan_stops_in_one_line(corpus, tmp_path):  # noqa: F811
    """lr 1e9: the weights after update 1 give a NaN gradient in update 2, a refresh (gap 1); the run stops there
    with the line that a diverged AdamW run gives, not the SVD's LinAlgError traceback."""
    diverge = ["--method", "full", "--optimizer", "galore_adamw", "--galore_rank", "4", "--galore_update_gap", "1",
               "--lr", "1e9", "--warmup_steps", "0"]
    with pytest.raises(SystemExit, match="^non-finite loss or gradient norm at step 2; stopping"):
        train.main(base_args(corpus, tmp_path, 4, *diverge))


def make_galore_for(model, inner, rank=8):
    names = {p: n for n, p in model.named_parameters()}
    return lambda ps: GaLore(galore_param_groups([(names[p], p) for p in ps], rank,
                                                 lambda n, p: p.dim() == 2 and (".attn." in n or ".mlp." in n)),
                             lr=1e-2, update_gap=2, inner=inner, min_8bit_size=256)


@pytest.mark.parametrize("inner", ["adamw", "adam8bit"])
def test_per_layer_matches_global_step(inner):
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="full", vocab_size=64))
    ref = copy.deepcopy(model)
    per = attach_per_layer(model, make_galore_for(model, inner))
    opt = make_galore_for(ref, inner)(list(ref.parameters()))
    for _ in range(4):
        idx = torch.randint(64, (2, 17))
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        ref(idx[:, :-1], idx[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max()}"


def test_resume_is_exact_across_a_refresh():
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method="full", vocab_size=64))
    batches = [torch.randint(64, (2, 17)) for _ in range(5)]

    def train_steps(m, opt, bs):
        for idx in bs:
            m(idx[:, :-1], idx[:, 1:])[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    straight = copy.deepcopy(model)
    train_steps(straight, make_galore_for(straight, "adam8bit")(list(straight.parameters())), batches)
    first = copy.deepcopy(model)
    opt = make_galore_for(first, "adam8bit")(list(first.parameters()))
    train_steps(first, opt, batches[:2])  # the next update (3) recomputes every projection
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(first.state_dict())
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(weights)
    opt = make_galore_for(resumed, "adam8bit")(list(resumed.parameters()))
    opt.load_state_dict(saved)
    train_steps(resumed, opt, batches[2:])
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max()}"


@pytest.mark.parametrize("inner", ["adamw", "adam8bit"])
def test_state_saved_in_bf16_loads_into_float32_parameters(inner):
    """As torch.optim and our AdamW: loaded moments and projectors take the parameters' dtype, while 8-bit Adam's
    codes and float32 absmax keep theirs. (bf16 moments beside float32 parameters failed the next step.)"""
    torch.manual_seed(0)

    def stepped(dtype):
        params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in ((96, 64), (64,))]
        opt = GaLore(galore_param_groups(list(zip("Wb", params)), 4), inner=inner, min_8bit_size=16)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        return params, opt

    _, saved = stepped(torch.bfloat16)
    params, opt = stepped(torch.float32)
    opt.load_state_dict(saved.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                expected = torch.uint8 if key.endswith("codes") else torch.float32
                assert value.dtype == expected, f"{tuple(p.shape)} {key}: {value.dtype}"
        assert p.isfinite().all()


def test_train_resume_is_bit_exact_across_a_refresh(corpus, tmp_path):  # noqa: F811
    # 8-bit GaLore with per-layer updates, Figure 3's baseline; the other variants resume through the same state
    extra = ["--method", "full", "--galore_update_gap", "2", "--galore_rank", "8", "--optimizer",
             "galore_adam8bit_per_layer"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(base_args(corpus, straight, 6, *extra))
    train.main(base_args(corpus, split, 6, "--stop_after", "3", *extra))  # refreshes at updates 1, 3, 5
    train.main(base_args(corpus, split, 6, "--resume", *extra))
    assert [r["loss"] for r in metrics(straight)[0]] == [r["loss"] for r in metrics(split)[0]]
    sa, sb = final_state(straight), final_state(split)
    for name, t in sa["model"].items():
        assert torch.equal(t, sb["model"][name]), f"{name} differs by {(t - sb['model'][name]).abs().max()}"


def test_train_flags():
    args = train.get_args(["--size", "60m", "--method", "full", "--optimizer", "galore_adam8bit_per_layer"])
    assert (args.lr, args.galore_rank, args.galore_scale, args.galore_update_gap) == (1e-2, 128, 0.25, 200)
    assert (args.optimizer, args.per_layer) == ("galore_adam8bit", True)
    args = train.get_args(["--method", "full", "--optimizer", "galore_adamw", "--lr", "3e-3"])
    assert args.lr == 3e-3
    with pytest.raises(SystemExit):
        train.get_args(["--optimizer", "galore_adamw"])  # sltrain weights: GaLore needs --method full


def test_every_param_group_is_checked_when_it_is_added():
    """The constructor's groups and those added later (add_param_group, as a schedule of layers would) get the same
    checks, at once, not at the first step: an int rank within the weight's sides, an int update_gap >= 1."""
    W, b = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8))
    opt = GaLore([{"params": [W], "rank": 4}])
    for group, message in [({"params": [b], "rank": 2}, r"2-D weights .* \(8,\) parameter"),
                           ({"params": [torch.nn.Parameter(torch.randn(8, 8))], "rank": 50},
                            r"rank in \[1, min\(m, n\)\]; got rank 50"),
                           ({"params": [torch.nn.Parameter(torch.randn(8, 8))], "rank": 2.5}, "rank must be an int"),
                           ({"params": [torch.nn.Parameter(torch.randn(8, 8))], "update_gap": 2.5},
                            "update_gap must be an int >= 1, got 2.5")]:
        with pytest.raises(ValueError, match=message):
            opt.add_param_group(group)
    for kwargs, message in [({"rank": 2.5}, "rank must be an int"), ({"update_gap": 0}, "update_gap must be an int"),
                            ({"rank": True}, "rank must be an int")]:
        with pytest.raises(ValueError, match=message):
            GaLore([W], **kwargs)
    opt.add_param_group({"params": [b]})  # rank None: plain Adam
    W.grad, b.grad = torch.randn(8, 12), torch.randn(8)
    opt.step()
    assert opt.state[W]["projector"].shape == (8, 4) and "projector" not in opt.state[b]


@pytest.mark.parametrize("group,message", [
    ({"lr": -1e-2}, "lr must be >= 0, got -0.01"),  # stepped up the gradient, without a word
    ({"betas": (1.0, 0.999)}, r"betas must be in \[0, 1\)"),  # a ZeroDivisionError at the first step
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ({"scale": 0}, "scale must be a finite number > 0, got 0"),  # stepped nothing
    ({"scale": float("nan")}, "scale must be a finite number > 0, got nan"),
    ({"block_size": 0}, "block_size must be an int >= 1, got 0"),
], ids=["lr", "betas", "weight_decay", "scale 0", "scale nan", "block_size"])
def test_a_param_groups_own_optimizer_settings_are_checked_too(group, message):
    """Beside its rank and gap, a group's own lr, betas, weight decay, scale and block size reached the first step
    unchecked (the constructor checked its arguments, not a group's): checked as the group is added, in the
    constructor's groups and later ones, and a refused group is not left half added."""
    W, V = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match=message):
        GaLore([{"params": [W], "rank": 4, **group}], inner="adam8bit")
    opt = GaLore([{"params": [W], "rank": 4}], inner="adam8bit")
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [V], "rank": 4, **group})
    assert len(opt.param_groups) == 1
    if "scale" in group:  # the constructor's own argument too
        with pytest.raises(ValueError, match=message):
            GaLore([W], scale=group["scale"])


@pytest.mark.parametrize("inner", ["adamw", "adam8bit"])
@pytest.mark.parametrize("rank", [None, 4], ids=["plain", "projected"])
def test_a_state_that_is_not_for_these_parameters_is_refused_at_load(inner, rank):
    """torch maps a saved state to the parameters by position only, and GaLore checked nothing: these parameters in
    another order stepped with another's moments (8-bit: its first blocks), or failed mid-step, and an AdamW's or
    Adam8bit's state stopped the first step with KeyError 'rank'. Each is refused at the load, in one line, leaving
    the optimizer as it was; the state loads into its own parameters."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((64, 128), (32, 128))]
    make = lambda ps, inner=inner: GaLore([{"params": ps, "rank": rank}], inner=inner, min_8bit_size=256)  # noqa
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    fresh = make(params[::-1])
    theirs = r"a \(64, 4\) one" if rank else "moments for 8192"
    with pytest.raises(ValueError, match=rf"^parameter 0 of this optimizer, \(32, 128\), has 4096 entries.*; the "
                                         rf"state's has {theirs}: .* in their order$"):
        fresh.load_state_dict(saved)
    assert not fresh.state, "a refused state must leave the optimizer as it was"
    other = "adam8bit" if inner == "adamw" else "adamw"
    with pytest.raises(ValueError, match="8-bit moments for parameter 0" if inner == "adam8bit" else
                       "holds float32 moments for parameter 0"):
        make(params, other).load_state_dict(saved)
    for plain in (AdamW(params), Adam8bit(params)):
        plain.step()
        with pytest.raises(ValueError, match=r"^this state is not a GaLore's: its param groups have no rank"):
            make(params).load_state_dict(plain.state_dict())
    resumed = make(params)
    resumed.load_state_dict(saved)
    resumed.step()
