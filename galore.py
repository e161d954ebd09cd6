"""
GaLore (Zhao et al. 2024, "Memory-Efficient LLM Training by Gradient Low-Rank Projection"), the baseline of the
paper's Table 2 and Figure 3: Adam in the space of a low-rank projection of each weight's gradient, over optim.py's
AdamW or Adam8bit.

    G (m, n)  ->  R = G Pᵀ (m, r), P (r, n) the top-r right singular vectors of G, when m >= n
                  R = Pᵀ G (r, n), P (m, r) the top-r left singular vectors of G,  when m < n
    Adam's moments follow R; its normalized step N = m̂ / (√v̂ + ε') goes back, W -= lr · scale · N P (or P N).
    P is recomputed from the current G every update_gap updates; the moments carry over.

Over AdamW, ε is GaLore's own: its AdamW (Hugging Face's) adds ε = 1e-6 to √v, not to √v̂, so ε' = ε / √(1 - β2ᵗ),
100 times torch's 1e-8 and more in the first updates; over Adam8bit, bitsandbytes' ε' = ε = 1e-8, as its code ran.

    groups = galore_param_groups(model.named_parameters(), 128, lambda name, p: name.endswith("_proj.weight"))
    opt = GaLore(groups, lr=1e-2, inner="adam8bit")                 # GaLore on the projections, 8-bit moments

Run the tests:   python -m pytest -q test_galore.py
"""

import math

import torch

from optim import (Adam8bit, _adamw_, _build_tables, _check_8bit_format, _check_block_size, _check_fused,
                   _check_fused_step, _check_hyperparameters, _check_state_fits, _checked_settings, _evaluate, _finite,
                   _fused, _keep_state_dtypes, _step_scalars)


def _adam_step_(kind, target, state, group, lr, weight_decay, compile=False, fused=None):
    """The AdamW or Adam8bit update of one tensor `target` by its `.grad`, with the state dict and group settings of
    that optimizer: the narrow interface through which GaLore reuses them on a projected gradient."""
    beta1, beta2 = group["betas"]
    if kind == "adamw":
        if "step" not in state:  # lazy, as the optimizers themselves (GaLore's projector may be there already)
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
        state["step"] += 1
        eps = group["eps"] / (1 - beta2 ** state["step"]) ** 0.5  # GaLore's AdamW adds ε to √v: to √v̂ this is ε'
        _adamw_([target], [target.grad], [state["exp_avg"]], [state["exp_avg_sq"]],
                _step_scalars(lr, beta1, beta2, eps, weight_decay, state["step"]))
        return
    if "step" not in state:
        Adam8bit._init_state(target, state, group)
    state["step"] += 1
    hyper = _step_scalars(lr, beta1, beta2, group["eps"], weight_decay, state["step"])
    if "exp_avg" in state:  # below min_8bit_size: float32 moments, as Adam8bit
        _adamw_([target], [_finite(target.grad)], [state["exp_avg"]], [state["exp_avg_sq"]], hyper)
    else:
        Adam8bit._update_8bit(target, state, group["block_size"], hyper, compile=compile,
                              fused=_fused(fused, target, group["block_size"]))


def galore_projector(grad, rank):
    """P of the shorter side of grad (m, n): (r, n) right singular vectors if m >= n, else (m, r) left ones."""
    U, _, Vh = torch.linalg.svd(grad.float(), full_matrices=False)  # (m, k), (k,), (k, n) with k = min(m, n)
    return (Vh[:rank] if grad.shape[0] >= grad.shape[1] else U[:, :rank]).clone()


def galore_project(grad, P):
    """G (m, n) -> R: G Pᵀ (m, r) when m >= n, else Pᵀ G (r, n), computed in float32, returned in G's dtype."""
    G, P = grad.float(), P.float()
    return (G @ P.t() if grad.shape[0] >= grad.shape[1] else P.t() @ G).to(grad.dtype)


def galore_project_back(low, P, shape):
    """R-shaped N -> (m, n): N P when m >= n, else P N, in float32."""
    low, P = low.float(), P.float()
    return low @ P if shape[0] >= shape[1] else P @ low


class GaLore(torch.optim.Optimizer):
    """GaLore (Zhao et al. 2024, "Memory-Efficient LLM Training by Gradient Low-Rank Projection") over our AdamW
    (inner="adamw") or Adam8bit (inner="adam8bit", 8-bit moments of the projected gradient).

    A param group with rank=r (an int) projects each of its 2-D weights; rank=None groups get plain AdamW/Adam8bit,
    with the same ε as GaLore's code (module docstring). See galore_param_groups. The state of a projected weight
    holds the moments of the projected gradient, the projector P and `projection_step`, the update at which P was
    computed: a checkpoint resumes exactly. Weight decay is decoupled and applied to the full weight, before the
    update (GaLore's code decays after it; the same at its default of 0)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=None, weight_decay=0.0, rank=None,
                 update_gap=200, scale=0.25, inner="adamw", block_size=256, min_8bit_size=4096, compile=False,
                 fused=None):
        if inner not in ("adamw", "adam8bit"):
            raise ValueError(f"inner must be adamw or adam8bit, got {inner!r}")
        eps = (1e-6 if inner == "adamw" else 1e-8) if eps is None else eps  # GaLore's AdamW's; bitsandbytes'
        _check_hyperparameters(lr, betas, eps, weight_decay)
        _check_block_size(block_size)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rank=rank, update_gap=update_gap,
                        scale=scale, block_size=block_size, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        if fused and inner != "adam8bit":  # train.py's --compile passes compile for either inner; fused it does not
            raise ValueError(f"fused=True is the one-kernel update of 8-bit moments; inner={inner!r} has none: pass "
                             "inner='adam8bit' or leave fused unset")
        # compile, fused: the 8-bit update as in Adam8bit(compile=..., fused=...)
        self.inner, self.compile, self.fused = inner, compile, _check_fused(fused, self)
        if inner == "adam8bit":
            _build_tables(self)

    def add_param_group(self, group):
        """Every group, the constructor's and any added later, checked: an int rank within each weight's sides (or
        None), an int update_gap >= 1, a finite scale > 0, and the settings AdamW and Adam8bit check (a group's own
        negative lr stepped up the gradient, its scale 0 stepped nothing, both without a word)."""
        group, settings = _checked_settings(self, group)
        scale = settings["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        gap, rank = settings["update_gap"], settings["rank"]
        if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
            raise ValueError(f"update_gap must be an int >= 1, got {gap!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise ValueError(f"rank must be an int (or None for plain Adam), got {rank!r}")
        for p in group["params"] if rank is not None else []:
            if p.dim() != 2 or not 0 < rank <= min(p.shape):
                raise ValueError(f"GaLore projects 2-D weights to a rank in [1, min(m, n)]; got rank {rank} for a "
                                 f"{tuple(p.shape)} parameter: put it in a rank=None group")
        super().add_param_group(group)  # after the checks: a refused group is not left half added

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        _check_fused_step(self)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("GaLore does not take sparse gradients")
                state = self.state[p]
                if group["rank"] is None:
                    _adam_step_(self.inner, p, state, group, group["lr"], group["weight_decay"], self.compile,
                                self.fused)
                else:
                    self._projected_step(p, state, group)
        return loss

    def _projected_step(self, p, state, group):
        grad = _finite(p.grad) if self.inner == "adam8bit" else p.grad
        updates = state.get("step", 0)  # done so far; P is (re)computed before updates 1, 1 + gap, 1 + 2·gap, ...
        if updates % group["update_gap"] == 0:
            # the SVD of a NaN gradient raises: over AdamW, which zeroes no entry, the projector is that of the finite
            # entries and the NaN goes on into the step, as in AdamW, for train.py's check to stop the run in one line
            state["projector"] = galore_projector(_finite(grad), group["rank"]).to(p.dtype)  # stored as the weight
            state["projection_step"] = updates + 1
        P = state["projector"]
        R = galore_project(grad, P)  # (m, r) or (r, n)
        # the inner optimizer steps a zero stand-in parameter whose gradient is R, with lr 1 and no decay:
        # afterwards it holds -N = -m̂ / (√v̂ + ε), the normalized update in the projected space
        low = torch.zeros_like(R)
        low.grad = R
        _adam_step_(self.inner, low, state, group, 1.0, 0.0, self.compile, self.fused)
        back = galore_project_back(low, P, p.shape)  # (m, n)
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(back.to(p.dtype), alpha=group["lr"] * group["scale"])

    def load_state_dict(self, state_dict):
        """Refused before anything loads where the state is not a GaLore's of this inner optimizer for these
        parameters (optim._check_state_fits): an AdamW's or Adam8bit's stopped the first step with KeyError 'rank',
        and one of these parameters in another order stepped the first with another's moments, or failed mid-step."""
        if self.inner == "adam8bit":
            _check_8bit_format(state_dict)
        kind = f"GaLore(inner={self.inner!r})"
        if not all("rank" in group and "update_gap" in group for group in state_dict["param_groups"]):
            raise ValueError(f"this state is not a GaLore's: its param groups have no rank (an AdamW's or an "
                             f"Adam8bit's?); continue with the optimizer that saved it, or start {kind} afresh")
        _check_state_fits(self, state_dict, kind, self.inner == "adam8bit", _shapes)
        super().load_state_dict(state_dict)
        # torch's cast to the parameter's dtype is right for the projector and AdamW's moments, which are kept in it
        if self.inner == "adam8bit":
            _keep_state_dtypes(self, state_dict, but="projector")


def _shapes(p, group):
    """The shapes of p's moments and projector in a GaLore group: its projected gradient's, (m, r) or (r, n), and
    P's, (r, n) or (m, r), under a rank (galore_projector); p's and none without one, or for what is not a matrix."""
    rank = group["rank"]
    if rank is None or p.dim() != 2:
        return p.shape, None
    m, n = p.shape
    return (torch.Size((m, rank)), torch.Size((rank, n))) if m >= n else (torch.Size((rank, n)), torch.Size((m, rank)))


def galore_param_groups(named_parameters, rank, projected=lambda name, p: p.dim() == 2):
    """Two param groups for GaLore: the weights `projected(name, p)` selects, with rank; all others, rank=None.
    In train.py the projected ones are the attention and MLP projections, the layers SLTrain re-parameterizes."""
    groups = [dict(params=[], rank=rank), dict(params=[], rank=None)]
    for name, p in named_parameters:
        if p.requires_grad:
            groups[0 if projected(name, p) else 1]["params"].append(p)
    return [g for g in groups if g["params"]]
