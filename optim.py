"""
The optimizers, written from scratch in plain PyTorch: AdamW and 8-bit Adam with block-wise quantized moments
(Dettmers et al. 2022), and gradient norms in float32. For the ReLoRA baseline: the pruning of the moments at each
restart. Per-layer updates, which step each layer's optimizer inside backward, are per_layer.py; the GaLore
baseline, over these optimizers, is galore.py. With SLTrain's W = s·BA + S and per-layer updates, 8-bit Adam gives
the paper's memory headline.

    opt = Adam8bit(model.parameters(), lr=3e-3)                     # a drop-in torch.optim.Optimizer

Run the tests:   python -m pytest -q test_optim.py
Measure them:    python bench.py --only step heavy host   (step time, 8-bit on heavy tails, per-layer host time)
"""

import functools
import math
from collections import defaultdict

import torch

import adam8bit_kernel

CHUNK = 131072  # elements per chunk of the 8-bit step: its temporaries stay in cache (6x faster than unchunked)
# device types whose 8-bit step goes chunk by chunk. Elsewhere (GPUs) every operation is a kernel launch, so the
# step works in pieces of up to PIECE entries: a tensor of up to that size in a fixed number of operations (70,
# views included), a larger one in a few pieces, so that its float32 temporaries (~31 bytes per entry) stay ~32 MB
# (a 7b embedding whole would take 4 GB), and consecutive smaller tensors together, one launch per operation for all
# of them (_update_8bit_together)
CHUNKED_DEVICES = {"cpu"}
PIECE = 1 << 20
# The one-kernel 8-bit step (adam8bit_kernel.py) takes consecutive tensors of up to KERNEL_RUN entries in all end to
# end, one launch for them, for a few aten copies (parameters and gradients; the states stay end to end): on the
# H200's host a per-layer update of 350m SLTrain with one launch per 8-bit tensor (506) took 3.2 times full's (170)
# for 1.6 times the aten operations, which points at the launches; on an H100 a launch cost the host 33 µs, an aten
# operation 7 µs, and the runs (then still copying the states) gave 0.765 of full AdamW's throughput against 0.730
# with a launch per tensor (BENCHMARKS.md). Larger tensors, whose launch is small beside their work, take their own.
# 0: one launch per tensor.
KERNEL_RUN = 1 << 22


def _check_hyperparameters(lr, betas, eps, weight_decay):
    if torch.is_tensor(lr):  # torch's fused and capturable paths take one; these steps read lr as a number
        raise ValueError("lr must be a number, got a tensor: pass float(lr)")
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"betas must be in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _check_block_size(block_size):
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


def _check_flat(p):
    """An 8-bit state is its parameter's flat storage, which a non-contiguous parameter does not have."""
    if not p.is_contiguous():
        raise ValueError(f"Adam8bit quantizes a parameter's flat storage; this {tuple(p.shape)} one is not "
                         "contiguous: make it contiguous or raise min_8bit_size above its size")


def _checked_group(optimizer, param_group):
    """A param group as torch.optim will take it (its params read once: a generator), refused where a parameter is
    complex: torch.optim.AdamW steps one as its real and imaginary parts (v of |g|²), where these steps would take
    g² for it (AdamW) or keep the real part alone (Adam8bit's moments)."""
    params = param_group["params"]
    params = [params] if torch.is_tensor(params) else params if isinstance(params, set) else list(params)
    for p in params:  # a set stays one: torch refuses it (its order is not kept)
        if torch.is_tensor(p) and p.is_complex():
            raise ValueError(f"{type(optimizer).__name__} takes real parameters, not a {tuple(p.shape)} "
                             f"{str(p.dtype).removeprefix('torch.')} one: use torch.optim.AdamW, which steps the real "
                             "and imaginary parts")
    return dict(param_group, params=params)


def _checked_settings(optimizer, param_group):
    """(group, settings): a param group as torch.optim will take it (_checked_group), and its settings, the
    optimizer's defaults under the group's own, checked as the constructor checks its arguments: a group's own lr,
    betas, eps, weight decay or block size reached the first step unchecked (a negative lr stepped up the gradient,
    betas[0] = 1 or block_size 0 stopped it with a ZeroDivisionError). Under fused=True (set once the constructor's
    groups are in, which _check_fused checks), a group added later is held to it too: it took the eager step."""
    group = _checked_group(optimizer, param_group)
    settings = {**optimizer.defaults, **group}
    _check_hyperparameters(settings["lr"], settings["betas"], settings["eps"], settings["weight_decay"])
    if "block_size" in settings:
        _check_block_size(settings["block_size"])
    if getattr(optimizer, "fused", None):
        _check_fused_group(settings)
    return group, settings


def _evaluate(closure):
    """step(closure)'s loss: the closure runs with gradients on, as torch.optim's optimizers run it."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _step_scalars(lr, beta1, beta2, eps, weight_decay, step):
    """The numbers an Adam update uses (_adamw_, _adam8bit_ and its kernel), each computed here once, in Python: the
    compiled 8-bit update takes them as graph inputs, and torch 2.11's compiler recompiles for every new value of a
    float it has to do arithmetic on (every step's bias correction, every lr of a schedule). Eagerly the same values
    as computing them in place."""
    decay = 1 - lr * weight_decay if weight_decay != 0 else None
    return -(lr / (1 - beta1**step)), 1 - beta1, beta2, 1 - beta2, eps, decay, (1 - beta2**step) ** 0.5


def _hyper(optimizer, group, state):
    """_step_scalars for the tensors of a param group whose step count is state's. Under a CUDA graph
    (optimizer.device_scalars set, cudagraph.DeviceScalars) the ones that change from update to update, the step
    size, the decay and the bias correction, come as 0-dim tensors on the device instead: a replay reads each
    update's there, where a number would stay the one of the capture."""
    beta1, beta2 = group["betas"]
    hyper = _step_scalars(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], state["step"])
    scalars = optimizer.device_scalars
    return hyper if scalars is None else scalars.on_device(group, state, hyper)


# -----------------------------------------------------------------------------
# AdamW

# AdamW's multi-tensor calls take consecutive tensors of up to FOREACH_BYTES in all (a larger tensor alone): the
# √v̂ + ε temporary of a call is that small, where one call over a whole group held a copy of every v (13 GB at 7b)
FOREACH_BYTES = 1 << 26


def _adamw_(params, grads, exp_avgs, exp_avg_sqs, hyper):
    """One AdamW update of tensors that share a step count, in the order of operations of torch.optim.AdamW's
    multi-tensor path, so that the two agree step for step. hyper: _hyper()'s numbers for their step."""
    step_size, one_minus_beta1, beta2, one_minus_beta2, eps, decay, sqrt_bias_correction2 = hyper
    if decay is not None:
        _scale_(params, decay)  # decoupled: shrink the weight, not the gradient
    torch._foreach_lerp_(exp_avgs, grads, one_minus_beta1)  # m = β1·m + (1-β1)·g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, one_minus_beta2)  # v = β2·v + (1-β2)·g²
    denom = torch._foreach_sqrt(exp_avg_sqs)
    _scale_(denom, sqrt_bias_correction2, divide=True)
    torch._foreach_add_(denom, eps)
    if not torch.is_tensor(step_size):
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)  # p -= lr·m̂ / (√v̂ + ε)
        return
    for p, m, d in zip(params, exp_avgs, denom):  # addcdiv's arithmetic, (step·m) / d, with the step on the device
        p.add_(m.float().mul(step_size).div_(d))


def runs_of(tensors, limit, size=lambda t: t.numel() * t.element_size(), key=lambda t: None):
    """The tensors in order, in runs of consecutive ones of one key, their sizes (bytes, unless `size` says) at most
    `limit` in all; a larger tensor is a run of its own."""
    runs, total = [], 0
    for t in tensors:
        if runs and total + size(t) <= limit and key(t) == key(runs[-1][0]):
            runs[-1].append(t)
            total += size(t)
        else:
            runs.append([t])
            total = size(t)
    return runs


def _scale_(tensors, factor, divide=False):
    """Each tensor multiplied (or divided) in place by factor: a number, or a 0-dim float32 tensor (under a CUDA
    graph, this update's value on the device). A tensor factor is applied in float32 and the result rounded once,
    as a number is: a kernel that cast the factor to a bf16 tensor's own dtype would round 1 - lr·decay to 1."""
    if not torch.is_tensor(factor):
        (torch._foreach_div_ if divide else torch._foreach_mul_)(tensors, factor)
        return
    for t in tensors:
        scaled = t.float().div(factor) if divide else t.float().mul(factor)
        t.copy_(scaled)


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019) and bias correction; matches torch.optim.AdamW.

    foreach=None or True updates a group's tensors with multi-tensor calls per (device, dtype, step), each over
    FOREACH_BYTES of them, which bounds the temporaries (the √v̂ + ε denominator) to that, or the largest tensor;
    False goes one tensor at a time, bounding them to one tensor's size."""

    device_scalars = None  # a cudagraph.DeviceScalars while its updates are captured in a CUDA graph (_hyper)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=None):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach is not False)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """Each group checked as it is added, the constructor's and any later one (_checked_settings)."""
        super().add_param_group(_checked_settings(self, param_group)[0])  # after the checks: none left half added

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            lists = defaultdict(list)  # tensors that can share one multi-tensor call
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not take sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:  # lazy: the state appears at the first step that sees a gradient
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                lists[(p.device, p.dtype, state["step"])].append(p)
            for params in lists.values():
                # None as True (a torch.optim.AdamW state loaded brings its default, None); 0: one at a time
                for chunk in runs_of(params, 0 if group["foreach"] is False else FOREACH_BYTES):
                    states = [self.state[p] for p in chunk]
                    _adamw_(chunk, [p.grad for p in chunk], [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], _hyper(self, group, states[0]))
        return loss

    def load_state_dict(self, state_dict):
        for group in state_dict["param_groups"]:  # a torch.optim.AdamW (or Adam) state may ask for what this lacks
            unknown = [flag for flag in ("amsgrad", "maximize") if group.get(flag)]
            if unknown or torch.is_tensor(group.get("lr")):
                what = f"{'=True, '.join(unknown)}=True" if unknown else "a tensor lr"
                raise ValueError(f"this state is of an AdamW with {what}, which optim.AdamW does not have: continue "
                                 "with torch.optim.AdamW, or start the optimizer afresh")
            if group.get("decoupled_weight_decay") is False and group.get("weight_decay"):  # torch.optim.Adam's
                raise ValueError("this state is of an Adam whose weight decay is added to the gradient (L2), with "
                                 "decoupled_weight_decay=False, which optim.AdamW does not have: continue with "
                                 "torch.optim.Adam, or start the optimizer afresh")
        _check_state_fits(self, state_dict)  # before loading: a refused state leaves the optimizer as it was
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch.optim.AdamW's state keeps its step as a tensor; ours, an int
            if torch.is_tensor(state.get("step")):
                state["step"] = int(state["step"].item())


# -----------------------------------------------------------------------------
# 8-bit Adam: block-wise dynamic quantization of both moments

def dynamic_map(signed):
    """The 256 sorted values of the dynamic (tree) quantization map of Dettmers et al.

    A value is 10^-e · f: the exponent e in 0..6 picks a decade, the fraction f is one of the midpoints of 2^(6-e)
    equal steps across [0.1, 1] (twice as many for the unsigned map, which spends the sign bit on the fraction).
    Large magnitudes get fine steps, small ones a wide range: 127 negatives, 0 and 128 positives up to 1 when
    signed (for Adam's m), or 0 and 255 positives up to 1 when unsigned (for √v, which is never negative)."""
    values = [0.0, 1.0]
    for e in range(7):
        steps = 2 ** (6 - e) if signed else 2 ** (7 - e)
        edges = torch.linspace(0.1, 1.0, steps + 1)
        magnitudes = 10.0**-e * (edges[:-1] + edges[1:]) / 2
        values += magnitudes.tolist() + ((-magnitudes).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _lookup_tables(signed, device):
    """(map, first, threshold) for quantizing to the nearest code of the map.

    Nearest means: count the midpoints between consecutive codes that lie below x (bucketize on the midpoints).
    A binary search per element measured 7x the time of a whole AdamW step on CPU, so the search is done once
    here for the 2^16 buckets of float32 values that share their top 16 bits (sign, exponent, 7 mantissa bits):
    `first` is the nearest code of the bucket's lowest value, `threshold` the one midpoint inside the bucket
    (+inf if none), and then nearest(x) = first + (x > threshold): two gathers per element."""
    code = dynamic_map(signed)
    mids = (code[:-1].double() + code[1:].double()) / 2  # exact in float64
    top = torch.arange(2**16, dtype=torch.int64) << 16
    lo, hi = [torch.where(t >= 2**31, t - 2**32, t).to(torch.int32).view(torch.float32) for t in (top, top | 0xFFFF)]
    low, high = torch.minimum(lo, hi).double(), torch.maximum(lo, hi).double()  # the bucket's value range
    finite = low.isfinite() & high.isfinite()
    first = torch.where(finite, torch.searchsorted(mids, low.nan_to_num()), 0)  # midpoints below the bucket
    inside = torch.where(finite, torch.searchsorted(mids, high.nan_to_num()) - first, 0)  # ...and inside it
    assert int(inside.max()) <= 1, "the map has codes closer than the float32 bucket width"
    # round each midpoint down to float32, so that for every float32 x: x > rounded <=> x > exact midpoint
    mids32 = mids.float()
    mids32 = torch.where(mids32.double() > mids, torch.nextafter(mids32, torch.tensor(-float("inf"))), mids32)
    threshold = torch.where(inside == 1, mids32[first.clamp(max=len(mids) - 1)], float("inf"))
    if not signed:
        # v: a positive second moment never becomes code 0. A v stored as 0 beside an m that is not makes the next
        # step m̂/(√v̂ + ε) huge (seen: 2e4·lr on heavy-tailed rows); the smallest positive code bounds it.
        positive = top < 2**31  # sign bit clear; bucket 0 holds +0.0 and the smallest denormals
        threshold = torch.where(positive & (first == 0), float("inf"), threshold)
        first = torch.where(positive & (first == 0), 1, first)
        first[0], threshold[0] = 0, 0.0  # +0.0 stays code 0 (so do all-zero blocks), anything above it is code 1
    return code.to(device), first.to(torch.uint8).to(device), threshold.to(device)


def _build_tables(optimizer):
    """The lookup tables of every device the optimizer's parameters are on, built (and cached) now, not inside the
    first step: building them reads values on the host, which on a GPU would stall the step (train.py --sync_debug)."""
    for device in {p.device for group in optimizer.param_groups for p in group["params"]}:
        _lookup_tables(True, device), _lookup_tables(False, device)


def _dequantize(codes, absmax, code, block_size):
    """codes (nb·bs,) uint8 and absmax (nb,) -> the float32 values (nb, bs)."""
    return code.index_select(0, codes.int()).view(-1, block_size).mul_(absmax.unsqueeze(1))


def _quantize_(x, absmax_out, codes_out, tables):
    """Quantize x (nb, bs) block-wise into absmax_out (nb,) and codes_out (nb·bs,); x is overwritten."""
    _, first, threshold = tables
    torch.amax(x.abs(), dim=1, out=absmax_out)  # measured 4x faster than aminmax
    # stored as divided by: no smaller than float32's smallest normal, so all-zero blocks stay 0 and denormal ones
    # decode to their values
    absmax_out.clamp_(min=torch.finfo(torch.float32).tiny)
    x.div_(absmax_out.unsqueeze(1))  # into [-1, 1]
    flat = x.view(-1)
    bucket = (flat.view(torch.int32) >> 16) & 0xFFFF  # the top 16 bits of each float32
    torch.index_select(first, 0, bucket, out=codes_out)
    codes_out.add_(flat > threshold.index_select(0, bucket))  # uint8 += bool: the code one above, where x is past it


def quantize_blockwise(x, signed, block_size=256):
    """x (any shape) -> (codes (nb·bs,) uint8, absmax (nb,) float32), the state format of Adam8bit; the last block
    is padded with zeros."""
    flat = x.detach().reshape(-1).float()
    blocks = -(-flat.numel() // block_size)
    padded = torch.zeros(blocks * block_size, device=x.device)
    padded[: flat.numel()] = flat
    codes = torch.empty(blocks * block_size, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(blocks, device=x.device)
    _quantize_(padded.view(blocks, block_size), absmax, codes, _lookup_tables(signed, x.device))
    return codes, absmax


def dequantize_blockwise(codes, absmax, signed, numel):
    """The inverse of quantize_blockwise up to rounding: the first `numel` float32 values, flat."""
    code = _lookup_tables(signed, codes.device)[0]
    return _dequantize(codes, absmax, code, codes.numel() // absmax.numel()).view(-1)[:numel]


def _finite(grad):
    # a non-finite gradient entry counts as zero: an overflow must not turn a whole block's absmax into NaN or inf
    return torch.nan_to_num(grad.float(), nan=0.0, posinf=0.0, neginf=0.0)


def _check_8bit_format(state_dict):
    if any("exp_avg_sq_codes" in s for s in state_dict["state"].values()):
        raise ValueError("this 8-bit Adam state stores v, an older format; ours stores √v: restart the optimizer "
                         "state or resume with the optim.py that saved it")


def _check_state_fits(optimizer, state_dict, kind=None, eight_bit=None, shapes=lambda p, group: (p.shape, None)):
    """Refuses, before anything loads, a state that is not this optimizer's kind's for these parameters. torch maps
    saved states to parameters by position only: a flat 8-bit state larger than its parameter would be stepped with,
    its first blocks taken for the parameter's, and a float32 one of another shape fails only at the step, after
    the parameters before it have moved. Into Adam8bit an AdamW's state would keep float32 moments for every tensor
    (AdamW's memory), its groups without our settings; into AdamW an Adam8bit's codes would fail at the step.
    GaLore passes its kind, whether its moments are 8-bit, and shapes(p, group): the shape of p's moments (its
    projected gradient's) and of its projector (None where it has none)."""
    eight_bit = isinstance(optimizer, Adam8bit) if eight_bit is None else eight_bit
    kind = kind or type(optimizer).__name__
    a = "an" if kind[0] in "AEIOU" else "a"
    fix = f"continue with the optimizer that saved it, or start {kind} afresh"
    if eight_bit and not all("block_size" in g and "min_8bit_size" in g for g in state_dict["param_groups"]):
        raise ValueError(f"this state is not {a} {kind}'s: its param groups have no block_size (an AdamW's?); {fix}")
    saved = [(i, group) for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, ((i, group), p) in enumerate(zip(saved, params)):
        state = state_dict["state"].get(i, {})
        shape, projector = shapes(p, group)
        numel = math.prod(shape)
        if "exp_avg_codes" in state:
            if not eight_bit:
                raise ValueError(f"this state is an Adam8bit's (8-bit moments for parameter {index}), not {a} "
                                 f"{kind}'s; {fix}")
            blocks = -(-numel // group["block_size"])
            size, fits = state["exp_avg_codes"].numel(), state["exp_avg_absmax"].numel() == blocks
        elif "exp_avg" in state:
            size, fits = state["exp_avg"].numel(), state["exp_avg"].shape == shape
            if eight_bit and fits and numel >= group["min_8bit_size"]:  # an AdamW's state in our groups
                raise ValueError(f"this state is not {a} {kind}'s: it holds float32 moments for parameter {index}, "
                                 f"{tuple(p.shape)}, which {kind} keeps in 8 bits (an AdamW's?); {fix}")
        else:
            continue
        of = "" if shape == p.shape else f" (moments of {numel}, its projected gradient's)"
        theirs = f"moments for {size}"
        if fits and "projector" in state and state["projector"].shape != projector:
            fits, of = False, f" and a {tuple(projector)} projector"
            theirs = f"a {tuple(state['projector'].shape)} one"
        if not fits:
            raise ValueError(f"parameter {index} of this optimizer, {tuple(p.shape)}, has {p.numel()} entries{of}; "
                             f"the state's has {theirs}: the state is of another model's parameters, or of "
                             "these in another order; load it into an optimizer of the parameters it was saved "
                             "with, in their order")


def _keep_state_dtypes(optimizer, state_dict, but=None):
    """After torch.optim.Optimizer.load_state_dict, which casts every state tensor to its parameter's dtype: put
    back the saved dtypes (uint8 codes, float32 absmax and moments), on the parameter's device."""
    ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in zip(ids, params):
        for key, value in state_dict["state"].get(i, {}).items():
            if torch.is_tensor(value) and key != but:
                optimizer.state[p][key] = value.to(p.device, copy=True)


class Adam8bit(torch.optim.Optimizer):
    """AdamW with both moments stored in 8 bits, block-wise (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
    Quantization"): each block of `block_size` entries keeps one float32 absmax, and each entry one uint8 code into
    the 256-value dynamic map, signed for m and unsigned for √v. That is 2 + 8/block_size bytes per parameter
    instead of 8. Storing √v rather than v (as Dettmers et al. do) halves the decades a block must span: where one
    block mixes gradients 1000x apart, v spans 10^6 and its small entries fall between the map's sparse lowest codes.

    A step works through chunks of blocks (optim.CHUNK entries on CPU, optim.PIECE elsewhere): dequantize m and v,
    update them in float32, move the parameter with these float32 moments, take the new absmax of each block and
    requantize to the nearest code, except that a positive v never rounds to 0. Tensors under `min_8bit_size`
    entries (norms, small factors) keep float32 moments: they are cheap and quantization hurts them
    most. Weight decay is decoupled, as in AdamW. A non-finite gradient entry counts as zero, for that step.

    On a CUDA GPU with Triton (fused=None, the default), the 8-bit update is one kernel (adam8bit_kernel.py): one
    launch and one pass over memory, where the eager update is ~35 kernels and ~65 operations the host issues, which
    bound a GPU step whose many tensors each launch their own; consecutive tensors of up to KERNEL_RUN entries in
    all (a layer's, under per-layer updates) share a launch. fused=True asks for it (refused where it cannot run:
    when given, and at each step, for a parameter moved since), fused=False never uses it. Where it is not used,
    runs of consecutive small 8-bit tensors are updated as one too, to the bit the same: one launch per operation
    for all of them (_update_8bit_together), and compile=True runs the update through torch.compile, a few fused
    kernels. Both the kernel's and the compiled results agree with the
    eager step to float32 rounding, not bit for bit; the state format is the same."""

    device_scalars = None  # a cudagraph.DeviceScalars while its updates are captured in a CUDA graph (_hyper)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, block_size=256,
                 min_8bit_size=4096, compile=False, fused=None):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        _check_block_size(block_size)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                        min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        # not group settings: a checkpoint's param_groups must not switch them on resume
        self.compile, self.fused = compile, _check_fused(fused, self)
        _build_tables(self)

    def add_param_group(self, param_group):
        """Each group checked as it is added, the constructor's and any later one (_checked_settings), and each of its
        8-bit tensors contiguous."""
        param_group, settings = _checked_settings(self, param_group)
        for p in param_group["params"]:  # when given, not at the first step
            if p.numel() >= settings["min_8bit_size"]:
                _check_flat(p)
        super().add_param_group(param_group)  # after the checks: a refused group is not left half added

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        _check_fused_step(self)
        for group in self.param_groups:
            eight_bit = {True: [], False: []}  # by whether the one kernel updates them
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:  # at every step: a state resumed from dense gradients is there before the first
                    raise RuntimeError("Adam8bit does not take sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:
                    self._init_state(p, state, group)
                state["step"] += 1
                if "exp_avg" in state:  # a small tensor: float32 moments and the AdamW math
                    _adamw_([p], [_finite(p.grad)], [state["exp_avg"]], [state["exp_avg_sq"]],
                            _hyper(self, group, state))
                else:
                    eight_bit[_fused(self.fused, p, group["block_size"])].append(p)
            for fused, limit in ((True, KERNEL_RUN), (False, PIECE)):
                for run in self._runs(eight_bit[fused], limit):
                    states = [self.state[p] for p in run]
                    hyper = _hyper(self, group, states[0])
                    if len(run) > 1:
                        _update_8bit_together(run, states, group["block_size"], hyper, compile=self.compile,
                                              fused=fused)
                    else:
                        self._update_8bit(run[0], states[0], group["block_size"], hyper, compile=self.compile,
                                          fused=fused)
        return loss

    def _runs(self, params, limit):
        """params in runs to update as one: consecutive, of one dtype and step count, `limit` entries at most; one
        by one on CPU, whose chunks keep the temporaries in cache."""
        if len(params) < 2 or params[0].device.type in CHUNKED_DEVICES:
            return [[p] for p in params]
        return runs_of(params, limit, size=lambda p: self.state[p]["exp_avg_codes"].numel(),
                       key=lambda p: (p.dtype, p.device, self.state[p]["step"]))

    def load_state_dict(self, state_dict):
        _check_8bit_format(state_dict)  # before loading: a refused state leaves the optimizer as it was
        _check_state_fits(self, state_dict)
        super().load_state_dict(state_dict)
        _keep_state_dtypes(self, state_dict)

    @staticmethod
    def _init_state(p, state, group):
        if p.numel() < group["min_8bit_size"]:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            return
        # checked when given too; here for a parameter whose .data was replaced since, before any state is written
        # (a state of its step alone would be read as 8-bit at the next step: a KeyError)
        _check_flat(p)
        state["step"] = 0
        blocks = -(-p.numel() // group["block_size"])
        for name in ("exp_avg", "sqrt_exp_avg_sq"):
            # absmax 0 makes every code decode to 0: the zero state, whatever the codes
            state[f"{name}_codes"] = torch.zeros(blocks * group["block_size"], dtype=torch.uint8, device=p.device)
            state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    @staticmethod
    def _update_8bit(p, state, block_size, hyper, compile=False, fused=False):
        tables = _lookup_tables(True, p.device), _lookup_tables(False, p.device)
        m_codes, m_absmax = state["exp_avg_codes"], state["exp_avg_absmax"]
        v_codes, v_absmax = state["sqrt_exp_avg_sq_codes"], state["sqrt_exp_avg_sq_absmax"]
        param, grad = p.view(-1), p.grad.reshape(-1)
        if fused:  # the whole tensor in one kernel
            adam8bit_kernel.adam8bit_(param, grad, (m_codes, m_absmax), (v_codes, v_absmax), tables,
                                      block_size, hyper)
            return
        if compile:  # the whole tensor in one call of fused kernels
            _compiled_update(p, grad, (m_codes, m_absmax), (v_codes, v_absmax), tables, block_size, hyper)
            return
        chunk = block_size * max(1, (CHUNK if p.device.type in CHUNKED_DEVICES else PIECE) // block_size)
        for start in range(0, param.numel(), chunk):
            stop = min(start + chunk, param.numel())
            blocks = slice(start // block_size, -(-stop // block_size))
            padded = slice(blocks.start * block_size, blocks.stop * block_size)
            _adam8bit_(param[start:stop], grad[start:stop], (m_codes[padded], m_absmax[blocks]),
                       (v_codes[padded], v_absmax[blocks]), tables, block_size, hyper)


def _fused(fused, p, block_size):
    """Whether p's 8-bit update runs as adam8bit_kernel's one kernel: never with fused=False; always with fused=True,
    which the step has held p to (_check_fused_step); with None, where it can."""
    return fused is True or fused is None and adam8bit_kernel.usable(p, block_size)


def _check_fused(fused, optimizer):
    """fused=True refused, in one line, where a parameter that takes 8-bit state could not run the kernel."""
    if fused not in (None, True, False):
        raise ValueError(f"fused must be None (where it can), True or False, got {fused!r}")
    for group in optimizer.param_groups if fused else []:
        _check_fused_group(group)
    return fused


def _check_fused_group(group, state=None):
    """_check_fused for one group, its settings filled in: the constructor's, and each one added later (a group
    added after the constructor, unchecked, took the eager step under fused=True without a word). At a step
    (state: the optimizer's, _check_fused_step), each tensor with a gradient that the step updates in 8 bits."""
    for p in group["params"]:
        if state is not None and p.grad is None:
            continue
        eight_bit = p.numel() >= group["min_8bit_size"] or state is not None and "exp_avg_codes" in state.get(p, ())
        reason = eight_bit and adam8bit_kernel.why_not(p.device, p.dtype, group["block_size"])
        if reason:
            dtype = str(p.dtype).removeprefix("torch.")
            moved = "" if state is None else f" for a {tuple(p.shape)} {dtype} parameter on {p.device}, as it is now"
            raise ValueError(f"fused=True: the one-kernel 8-bit step cannot run here{moved}: {reason}; pass "
                             "fused=None to use it only where it can run")


def _check_fused_step(optimizer):
    """fused=True held at each step too, before any tensor is updated: a parameter moved to another device or dtype
    since it was given (model.to(...), .half()), or a state loaded with another block size, took the eager step
    without a word. The same one look per 8-bit tensor that choosing the kernel for it took."""
    for group in optimizer.param_groups if optimizer.fused else []:
        _check_fused_group(group, optimizer.state)


def _update_8bit_together(params, states, block_size, hyper, compile=False, fused=False):
    """The 8-bit updates of several tensors as one: their parameters, gradients and states laid end to end, each
    padded to whole blocks (no block mixes two tensors; the padding is zeros and stays zero), one update of the
    whole, the parameters copied back. The states stay end to end: each tensor's becomes its view of the run's (the
    first update's cat), so that later updates of the same run copy them neither in nor out (_end_to_end); a
    checkpoint saves each such storage once. Element by element the same arithmetic as one update per tensor, to the
    bit, in a fixed number of operations: a GPU's host issues them once per run of tensors instead of once per
    tensor. compile: the update of the whole through torch.compile (the copies around it stay eager); fused: the
    one-kernel step, one launch for the run."""
    sizes = [state["exp_avg_codes"].numel() for state in states]  # each tensor's entries, padded to whole blocks
    device, n = params[0].device, sum(sizes)
    # the gradients in float32, as _finite takes them; the kernel reads them in their own dtype (half the copy)
    grad_dtype = params[0].grad.dtype if fused else torch.float32
    param, grad = (torch.zeros(n, dtype=dtype, device=device) for dtype in (params[0].dtype, grad_dtype))
    unpadded = lambda flat: [part[: p.numel()] for part, p in zip(flat.split(sizes), params)]  # noqa: E731
    flat_params, param_parts = [p.view(-1) for p in params], unpadded(param)  # views, used going in and out
    torch._foreach_copy_(param_parts, flat_params)
    torch._foreach_copy_(unpadded(grad), [p.grad.reshape(-1) for p in params])
    keys = ("exp_avg_codes", "exp_avg_absmax", "sqrt_exp_avg_sq_codes", "sqrt_exp_avg_sq_absmax")
    whole, new = zip(*(_end_to_end([state[key] for state in states]) for key in keys))
    tables = _lookup_tables(True, device), _lookup_tables(False, device)
    update = adam8bit_kernel.adam8bit_ if fused else _compiled_update if compile else _adam8bit_
    update(param, grad, whole[:2], whole[2:], tables, block_size, hyper)
    torch._foreach_copy_(flat_params, param_parts)
    for key, flat, cat in zip(keys, whole, new):
        if cat:  # the states now live in it, end to end, as views: the next update of this run copies none of them
            per_tensor = [size // (1 if key.endswith("codes") else block_size) for size in sizes]
            for state, part in zip(states, flat.split(per_tensor)):
                state[key] = part


def _end_to_end(tensors):
    """(flat, new): flat tensors laid end to end as one. Where they already lie so, in one storage (the views an
    earlier update of the same run left), a view of them (new False); else their cat (new True)."""
    first = tensors[0]
    storage, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != end:
            return torch.cat(tensors), True
        end += t.numel()
    return first.as_strided((end - first.storage_offset(),), (1,)), False


def _adam8bit_(param, grad, m, v, tables, block_size, hyper):
    """One 8-bit Adam update of a run of whole blocks, in place: param (n,) and grad (n,) flat; m and v the
    (codes (nb·bs,), absmax (nb,)) of m and √v; the lookup tables of the signed and unsigned maps; hyper =
    _step_scalars(...). The last block may be padded."""
    (m_codes, m_absmax), (v_codes, v_absmax), (signed, unsigned) = m, v, tables
    step_size, one_minus_beta1, beta2, one_minus_beta2, eps, decay, sqrt_bias_correction2 = hyper
    m = _dequantize(m_codes, m_absmax, signed[0], block_size)  # (nb, bs)
    v = _dequantize(v_codes, v_absmax, unsigned[0], block_size).square_()  # (nb, bs) from √v
    g = _finite(grad)
    m_, v_ = m.view(-1)[: param.numel()], v.view(-1)[: param.numel()]  # without the padding of the last block
    m_.lerp_(g, one_minus_beta1)  # m = β1·m + (1-β1)·g
    v_.mul_(beta2).addcmul_(g, g, value=one_minus_beta2)  # v = β2·v + (1-β2)·g²
    if torch.is_tensor(decay):
        _scale_([param], decay)
    elif decay is not None:
        param.mul_(decay)  # 1 - lr·weight decay
    # the parameter moves with this step's float32 moments; only what is carried to the next step is rounded
    # √v: what is stored, and the denominator's. A finite |g| past ~1e19 overflows v to inf; AdamW then freezes that
    # entry (m / inf = 0), and so do we, without an inf absmax, whose code-0 neighbours would decode to 0·inf = NaN
    # (they still stall: coded against the largest float32, none of their √v decodes below ~1e32)
    v.sqrt_().clamp_(max=torch.finfo(torch.float32).max)
    denom = v_.div(sqrt_bias_correction2).add_(eps)
    # the same arithmetic (bit for bit in eager) with the step size as a tensor operand: compiled, where a Python
    # number would recompile for every lr, or read from the device under a CUDA graph (_hyper)
    if torch.compiler.is_compiling() or torch.is_tensor(step_size):
        param.add_(m_ * step_size / denom)
    else:
        param.addcdiv_(m_, denom, value=step_size)  # step_size = -lr / (1 - β1^t)
    _quantize_(m, m_absmax, m_codes, signed)
    _quantize_(v, v_absmax, v_codes, unsigned)


@functools.cache
def _adam8bit_compiled():
    """_adam8bit_ through torch.compile (Adam8bit(compile=True)): eagerly it is ~35 kernels per tensor, each a
    pass over memory and a launch the host must issue; compiled, a few fused ones. Sizes are dynamic: one graph
    serves every parameter of a dtype and number of dimensions (the flat view passed in is guarded on its base's).
    The hyperparameters are graph inputs, so a new lr or step count does not recompile. Not fullgraph: should a
    torch version recompile past its limit, the update falls back to eager with a warning instead of stopping a run
    (test_optim.py checks the graph count)."""
    return torch.compile(_adam8bit_, dynamic=True)


def _compiled_update(param, grad, m, v, tables, block_size, hyper):
    """_adam8bit_compiled's update, its weight decay applied first, eagerly: fused into the update, inductor keeps
    a bf16 parameter's decayed value in float32 where the eager step and the kernel round it once after the decay
    and again after the step (a decay too small for bf16 is then lost in both, applied in part here)."""
    *before, decay, sqrt_bias_correction2 = hyper
    if torch.is_tensor(decay):
        _scale_([param], decay)
    elif decay is not None:
        param.mul_(decay)  # 1 - lr·weight decay
    # flat after the decay: a view taken before it would reach the compiler with its base changed since
    _adam8bit_compiled()(param.view(-1), grad, m, v, tables, block_size, (*before, None, sqrt_bias_correction2))


# -----------------------------------------------------------------------------
# Gradient norms in float32 (the logged norm, clipping, and per-layer.py's per-tensor clipping)

def _by_pieces(t):
    """Whether t's float32 norm goes by pieces: CUDA reduces bf16 in float32 as it reads; the CPU kernel first
    copies the whole tensor to float32 (65 MB for a 60m embedding's gradient, the peak of a step)."""
    return t.device.type == "cpu" and t.dtype != torch.float32 and t.numel() > PIECE


def _norm32(t):
    """The 2-norm of t accumulated in float32, by pieces where a whole float32 copy would be made (_by_pieces). A
    float64 t is reduced in float64 (vector_norm refuses to narrow it) and its norm given in float32, as the others."""
    if t.dtype == torch.float64:
        return torch.linalg.vector_norm(t).float()
    if not _by_pieces(t):
        return torch.linalg.vector_norm(t, dtype=torch.float32)
    parts = [torch.linalg.vector_norm(part, dtype=torch.float32) for part in t.reshape(-1).split(PIECE)]
    return torch.linalg.vector_norm(torch.stack(parts))


def _norms32(grads):
    """[_norm32(g) for g in grads], in one multi-tensor launch (a few for many tensors) where it needs no float32
    copy of a whole tensor: on a GPU, where a launch a tensor is host time that per-layer updates wait on."""
    if any(_by_pieces(g) or g.dtype == torch.float64 for g in grads):
        return [_norm32(g) for g in grads]
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32))


def clip_grad_norm32(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_ with the global norm and the clipping factor in float32, whatever the
    gradients' dtype: for bf16 gradients torch's are bf16 (the logged norm off by up to 2⁻⁹ of itself, and the
    clipped norm up to 0.7% from max_norm in 20 random draws, where this one's is within bf16's rounding of the
    gradients). Returns the norm before clipping, a float32 0-dim tensor on the gradients' device; when clipping, as
    torch's: a NaN norm makes every gradient NaN, an infinite one scales by 0 (its inf entries become NaN, the finite
    ones 0)."""
    parameters = [parameters] if torch.is_tensor(parameters) else parameters  # one tensor, as torch's takes it
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack(_norms32(grads)))
    if max_norm != float("inf"):
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


# -----------------------------------------------------------------------------
# ReLoRA's optimizer reset: prune the moments of the restarted factors by magnitude (Lialin et al. 2023)

def _prune_(x, fraction):
    """Zero the `fraction` of x's entries smallest in magnitude, in place. The count is fraction·n rounded down, as
    computed exactly: in floating point 0.7·90 is 62.99999999999999, which int() took for 62."""
    k = int(round(fraction * x.numel(), 6))
    if k > 0:
        threshold = x.abs().view(-1).kthvalue(k).values
        x.mul_(x.abs() > threshold)


@torch.no_grad()
def prune_state_(optimizers, params, fraction=0.99):
    """Zero the `fraction` smallest-magnitude entries of each Adam moment of `params`, in whichever of `optimizers`
    (AdamW, Adam8bit or GaLore; several for per-layer updates) holds them; the step count stays, so bias
    correction goes on. 8-bit moments are decoded, pruned and encoded again."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    wanted = set(params)
    for opt in optimizers:
        for p, state in opt.state.items():
            if p not in wanted:
                continue
            for name, signed in (("exp_avg", True), ("exp_avg_sq", False), ("sqrt_exp_avg_sq", False)):
                if name in state:
                    _prune_(state[name], fraction)
                elif f"{name}_codes" in state:
                    codes, absmax = state[f"{name}_codes"], state[f"{name}_absmax"]
                    # the moment's own size, without the padding: GaLore's is the projected gradient's, r·max(m, n)
                    n = min(state["projector"].shape) * max(p.shape) if "projector" in state else p.numel()
                    values = dequantize_blockwise(codes, absmax, signed, n)
                    _prune_(values, fraction)
                    new_codes, new_absmax = quantize_blockwise(values, signed, codes.numel() // absmax.numel())
                    codes.copy_(new_codes)
                    absmax.copy_(new_absmax)
