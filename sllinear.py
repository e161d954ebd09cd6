"""
The SLTrain linear layer: a weight that is low-rank plus sparse with a fixed random support.

    W = s·B A ⊕_I V          B: (out, r), A: (r, in), s = alpha / r
                             I: nnz fixed flat positions in the (out, in) matrix, V: their nnz values

"⊕_I V" scatter-adds the values V into the dense matrix at the positions I (Han et al. 2024, §3.2). For fine-tuning
(the paper's appendix, SLTrain-FT) the merge starts from a frozen pretrained weight instead of zero,
W = W0 + s·B A ⊕_I V; the gradients below are unchanged and W0 gets none.
Only B, A and V are learned. Forward and backward (paper eq. (2)), with x: (N, in), z = x Wᵀ: (N, out)
and g = ∂L/∂z:

    z      = x (s·BA ⊕_I V)ᵀ
    ∂L/∂x  = g W                 W is formed again in backward, never kept from forward
    G      = gᵀ x                the dense weight gradient, a temporary of backward
    ∂L/∂B  = s · G Aᵀ
    ∂L/∂A  = s · Bᵀ G
    ∂L/∂V  = G_I                 G gathered at the support

Between forward and backward only x, B, A, V and I (and W0, itself a weight) are kept: no tensor of the size
of W, which is the paper's memory claim (test_sllinear.py checks it with saved_tensors_hooks). I is kept as int32
positions, or packed in about a byte a position and unpacked at each use (pack_support, train.py --packed_support).

Layers of one input (q, k and v; gate and up) can share a call, a group: one autograd call forms their weights into
the rows of one matrix and gives each layer its own output z_i = x W_iᵀ, the same formulas per layer, each layer's
gradients read from its own rows of G (sl_linear_group, projections).

Run the gradient checks:  python -m pytest -q test_sllinear.py
"""

import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


def scaled_mm(a, b, scale):
    """scale · a @ b, the scale applied by the GEMM itself (alpha; beta = 0 into fresh memory, which is written,
    never read): no scaled copy of an input and no pass over the product."""
    return a.new_empty(a.shape[0], b.shape[1]).addmm_(a, b, beta=0, alpha=scale)


# A support is kept as flat positions (int32, or int64 for a layer of 2³¹ entries or more), or packed (uint8): the
# sorted positions cut into blocks of PACK_BLOCK consecutive entries of the flat (out·in,) weight, each block's
# count of positions in one byte, then each position's offset in its block in one byte. That is nnz + out·in/255
# bytes, 1 + 1/(255·δ) a position (1.13 at δ = 0.03), where int32 takes 4: at 7b the supports are most of what
# SLTrain keeps beyond the method's own parameters and moments (estimate_memory.py). Each use unpacks its layer's
# positions into a temporary of nnz int32, a few small kernels more per layer per pass (SLLinear(packed=True)).
PACK_BLOCK = 255  # a count (0 to 255) and an offset (0 to 254) each fit a byte


def pack_support(positions, n):
    """Sorted distinct flat positions out of n as one packed uint8 tensor: the count of each block, then the
    offsets. The order is kept, so each value stays with its position."""
    positions = positions.long()
    if not sorted_distinct(positions, n):
        raise ValueError(f"a packed support takes sorted distinct positions in [0, {n}); sort the positions "
                         "(and their values with them)")
    counts = torch.bincount(positions // PACK_BLOCK, minlength=-(-n // PACK_BLOCK))
    return torch.cat([counts.to(torch.uint8), (positions % PACK_BLOCK).to(torch.uint8)])


def sorted_distinct(positions, n):
    """Whether flat positions are sorted, distinct and in [0, n): what uniform_support draws, and what a packed
    support keeps."""
    return not positions.numel() or bool((positions[1:] > positions[:-1]).all() and positions[0] >= 0
                                         and positions[-1] < n)


def support_positions(indices, n):
    """The flat positions of a support out of n entries, as stored: int32 or int64 ones as they are, packed ones
    (uint8) unpacked, in int32 below 2³¹ entries. Issues no host sync (the count of positions is the tensor's)."""
    if indices.dtype != torch.uint8:
        return indices
    blocks = -(-n // PACK_BLOCK)
    counts, offsets = indices[:blocks], indices[blocks:]
    dtype = torch.int32 if n < 2**31 else torch.int64
    block = torch.repeat_interleave(counts.to(dtype), output_size=offsets.numel())  # (nnz,): each one's block
    return offsets.add(block, alpha=PACK_BLOCK)  # (nnz,): block · 255 + offset


def merge_into(W, B, A, values, indices, scale, base=None):
    """s·BA ⊕_I V, or W0 + s·BA ⊕_I V with base W0 (fine-tuning), written over W (out, in): a fresh matrix, whose
    content is never read, or a block of rows of a larger one (a group's, below). A zero-rank B (out, 0), A (0, in)
    gives the sparse part alone; empty values/indices give the low-rank part alone."""
    W.addmm_(B, A, beta=0, alpha=scale)  # (out, r) @ (r, in) -> (out, in), scaled by the GEMM (see scaled_mm)
    if base is not None:  # in place, in W's dtype (train.py --amp keeps W0 in bf16: model.frozen_base_to)
        W += base
    W.view(-1).index_add_(0, support_positions(indices, W.numel()), values)  # W ⊕_I V, in place
    return W


def merge(B, A, values, indices, scale, base=None):
    """The dense weight s·BA ⊕_I V (or W0 + s·BA ⊕_I V) of shape (out, in), in a fresh matrix."""
    return merge_into(B.new_empty(B.shape[0], A.shape[1]), B, A, values, indices, scale, base)


# A group is one or more layers that share their input: q, k and v of attention, gate and up of the MLP. Each layer
# is its (B, A, values, indices, base) with base None but in fine-tuning. Their weights are formed into the rows of
# one (Σ out, in) matrix, and the group takes one autograd Function call where its layers would take one each: fewer
# operations for the host to issue, which is what SLTrain's layers wait on at 350m on a GPU (BENCHMARKS.md). Each
# layer keeps its own GEMMs with x and its own output, a tensor of its own: one GEMM for the group, its output split
# into views, made the attention's and the MLP's elementwise work run on strided rows and backward cat the outputs'
# gradients, and measured slower on an H200 than a call per layer (BENCHMARKS.md). The arithmetic is each layer's.

def _cast(dtype, *tensors):
    return tensors if dtype is None else [t.to(dtype) for t in tensors]


def _rows(W, group):
    """W's blocks of rows, one per layer of the group (views, contiguous)."""
    return (W,) if len(group) == 1 else W.split([layer[0].shape[0] for layer in group])


def _weights(group, scale, dtype):
    """The group's weights in one (Σ out, in) matrix in dtype (if given), each B, A and V cast to it first: what
    forward and backward each form."""
    B, A = group[0][:2]
    W = B.new_empty(sum(layer[0].shape[0] for layer in group), A.shape[1], dtype=dtype or B.dtype)
    for rows, (B, A, values, indices, base) in zip(_rows(W, group), group):
        merge_into(rows, *_cast(dtype, B, A, values), indices, scale, base)
    return W


def _product(x, group, scale, dtype):
    """[x W_iᵀ for each layer] for the group's W, B, A and V cast to dtype (if given) inside: the forward's
    arithmetic, each output a tensor of its own."""
    return [x @ W.t() for W in _rows(_weights(group, scale, dtype), group)]  # (..., in) @ (in, out) -> (..., out)


# Compiled, the group's forward and backward are each one operator the compiler cannot see into (SLLinearFunction).
# They are defined on the dispatcher directly, each calling its Python function with no layer between: an operator
# made with torch.library.custom_op passes through its Python wrappers on every call, which cost about as much host
# time again as the arithmetic inside (BENCHMARKS.md), and compiled SLTrain's step waits on its host.
_LIBRARY = torch.library.Library("sltrain", "DEF")
_LIBRARY.define("product(Tensor x, Tensor[] Bs, Tensor[] As, Tensor[] values, Tensor[] indices, Tensor?[] bases, "
                "float scale, ScalarType? dtype) -> Tensor[]")
_LIBRARY.define("gradients(Tensor x, Tensor?[] gs, Tensor[] Bs, Tensor[] As, Tensor[] values, Tensor[] indices, "
                "Tensor?[] bases, float scale, bool need_x, bool[] needs) -> Tensor[]")


def _opaque_product(x, Bs, As, values, indices, bases, scale, dtype):
    """_product as one operator. Seeing the casts of B, A and V in forward and the same casts in backward, the
    compiler would merge them and keep the bf16 copies for backward (2 bytes per parameter). Not differentiable
    (SLLinearFunction is its autograd), so it records no graph when called where gradients are on."""
    with torch.no_grad():
        return _product(x, list(zip(Bs, As, values, indices, bases)), scale, dtype)


def _fake_product(x, Bs, As, values, indices, bases, scale, dtype):
    return [x.new_empty(*x.shape[:-1], B.shape[0], dtype=x.dtype) for B in Bs]


def _gradients(x, gs, group, scale, need_x, needs):
    """Backward's arithmetic for a group whose B, A and V are in the compute dtype: [∂L/∂x, if need_x] and then each
    layer's ∂L/∂B, ∂L/∂A and ∂L/∂V that needs (three a layer) asks for, in that order. gs: each layer's output
    gradient (N, out), or None where the layer needs none."""
    in_features = x.shape[-1]
    # each support as flat positions, unpacked once (if packed) for both W's merge and V's gather
    group = [(B, A, values, support_positions(indices, B.shape[0] * in_features), base)
             for B, A, values, indices, base in group]
    # W is formed for ∂L/∂x alone; G needs only its memory
    out_features = sum(layer[0].shape[0] for layer in group)
    W = _weights(group, scale, None) if need_x else group[0][0].new_empty(out_features, in_features)
    got = []
    if need_x:  # ∂L/∂x = Σ g_i W_i, with W rebuilt from the factors, summed by the GEMMs themselves
        grad_x = None
        for g, W_i in zip(gs, _rows(W, group)):
            if g is not None:  # (N, out) @ (out, in) -> (N, in)
                grad_x = g @ W_i if grad_x is None else grad_x.addmm_(g, W_i)
        got.append(grad_x.view(*x.shape[:-1], in_features))

    # G_i = g_iᵀ x, each layer's dense weight gradient, shared by its B, A and V; written over its rows of W,
    # which are no longer needed, so backward holds one weight-sized temporary, not two
    x = x.reshape(-1, in_features)
    for i, (g, W_i, (B, A, values, indices, base)) in enumerate(zip(gs, _rows(W, group), group)):
        need_B, need_A, need_V = needs[3 * i:3 * i + 3]
        if not (need_B or need_A or need_V):
            continue
        G = torch.mm(g.t(), x, out=W_i)  # (out, in)
        if need_B:  # ∂L/∂B = s · G Aᵀ
            got.append(scaled_mm(G, A.t(), scale))  # (out, in) @ (in, r) -> (out, r)
        if need_A:  # ∂L/∂A = s · Bᵀ G
            got.append(scaled_mm(B.t(), G, scale))  # (r, out) @ (out, in) -> (r, in)
        if need_V:  # ∂L/∂V = G gathered at the support I
            got.append(G.view(-1).index_select(0, indices))  # (out·in,)[I] -> (nnz,)
    return got


def _opaque_gradients(x, gs, Bs, As, values, indices, bases, scale, need_x, needs):
    """_gradients as one operator, for compiled backward (see SLLinearFunction.backward)."""
    with torch.no_grad():
        return _gradients(x, gs, list(zip(Bs, As, values, indices, bases)), scale, need_x, needs)


def _fake_gradients(x, gs, Bs, As, values, indices, bases, scale, need_x, needs):
    like = [x] if need_x else []
    for i, layer in enumerate(zip(Bs, As, values)):
        like += [t for t, need in zip(layer, needs[3 * i:3 * i + 3]) if need]
    return [t.new_empty(t.shape) for t in like]


for _name, _kernel, _fake in (("product", _opaque_product, _fake_product),
                              ("gradients", _opaque_gradients, _fake_gradients)):
    _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"sltrain::{_name}", _fake, lib=_LIBRARY)


class SLLinearFunction(torch.autograd.Function):
    """y = x Wᵀ with W = s·BA ⊕_I V (or W0 + s·BA ⊕_I V) formed on the fly and formed again in backward; for a
    group, each layer's output y_i = x W_iᵀ. Called as apply(x, scale, dtype, *layers), layers being the group's
    (B, A, values, indices, base) one after the other; returns the outputs, one per layer."""

    @staticmethod
    def forward(ctx, x, scale, dtype, *layers):
        # dtype: mixed precision's compute dtype (sl_linear passes autocast's). x, B, A and V are cast to it here
        # and B, A, V again in backward, so what is kept is the parameters themselves, never a copy of them
        x_dtype, x = x.dtype, x if dtype is None else x.to(dtype)
        group = [layers[i:i + 5] for i in range(0, len(layers), 5)]
        if torch.compiler.is_compiling():
            ys = torch.ops.sltrain.product(x, *map(list, zip(*group)), scale, dtype)
        else:
            ys = _product(x, group, scale, dtype)
        # saved: the inputs only; W dies in product and is rebuilt in backward for one more (out, r, in) GEMM
        ctx.save_for_backward(x, *layers)
        ctx.scale, ctx.dtype, ctx.x_dtype = scale, dtype, x_dtype
        ctx.set_materialize_grads(False)  # an output left out of the loss: its layer gets no gradient, as alone
        # (eagerly; compiled, it gets zeros, as a layer alone does there)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grad_ys):
        # a second derivative (create_graph=True: a gradient penalty, a Hessian-vector product) is refused in one
        # line, here: backward is not itself differentiable. (torch's once_differentiable refused it only when an
        # output's gradient required grad; a layer whose output enters the loss linearly, as y.sum(), gave gradients
        # that silently carried no graph, and a penalty on them gave B, A and V none of its gradient)
        if torch.is_grad_enabled():
            raise RuntimeError("the SLTrain layer has no second derivative: its backward is not differentiable; "
                               "drop create_graph=True")
        x, *layers = ctx.saved_tensors
        group = [(*_cast(ctx.dtype, *layers[i:i + 3]), *layers[i + 3:i + 5]) for i in range(0, len(layers), 5)]
        gs = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grad_ys]  # (N, out) each
        need_x = ctx.needs_input_grad[0] and any(g is not None for g in gs)
        # ∂L/∂B, ∂L/∂A and ∂L/∂V of each layer, if asked for and its output has a gradient
        needs = [need and g is not None for g, i in zip(gs, range(3, len(ctx.needs_input_grad), 5))
                 for need in ctx.needs_input_grad[i:i + 3]]
        if not need_x and not any(needs):
            return None, None, None, *[None] * len(layers)
        # B, A and V are already in the compute dtype. Compiled, backward too is one operator the compiler cannot see
        # into: traced, its in-place writes into one matrix's rows became copies of the whole matrix
        if torch.compiler.is_compiling():
            got = torch.ops.sltrain.gradients(x, gs, *map(list, zip(*group)), ctx.scale, need_x, needs)
        else:
            got = _gradients(x, gs, group, ctx.scale, need_x, needs)
        got = iter(got)
        grad_x = next(got) if need_x else None
        grads = [next(got) if j < 3 and needs[3 * i + j] else None for i in range(len(group)) for j in range(5)]
        if ctx.dtype is not None:  # mixed precision: the gradients in the dtypes of the inputs (float32 ones)
            grad_x = None if grad_x is None else grad_x.to(ctx.x_dtype)
            grads = [None if d is None else d.to(t.dtype) for d, t in zip(grads, layers)]
        # outside mixed precision nothing is cast: each call here is host time a GPU may wait for
        return grad_x, None, None, *grads


def sl_linear_group(x, group, scale):
    """(x W_1ᵀ, x W_2ᵀ, ...) for a group of layers sharing x, each (B, A, values, indices, base), W_i = s·B_i A_i ⊕
    V_i (+ W0_i): a tuple of outputs, (..., out_i) each. For a sparse-only layer pass B (out, 0) and A (0, in)."""
    device = x.device.type
    # meta has no autocast state. (Not torch.amp.is_autocast_available: torch 2.11's compiler cannot trace it and
    # would break each compiled block's graph at every SLTrain layer.)
    flat = [t for layer in group for t in layer]
    if device != "meta" and torch.is_autocast_enabled(device):
        # mixed precision: autocast does not reach inside an autograd.Function, so the Function casts x and the
        # (float32) weights to the autocast dtype itself: W is formed and multiplied in bf16 alone and the gradients
        # come back in float32. Casts outside it, as autocast makes for nn.Linear, would keep a bf16 copy of B, A
        # and V for backward: 2 bytes more per parameter between forward and backward (6 GB at 7b, batch 1).
        with torch.autocast(device, enabled=False):
            return SLLinearFunction.apply(x, scale, torch.get_autocast_dtype(device), *flat)
    return SLLinearFunction.apply(x, scale, None, *flat)


def sl_linear(x, B, A, values, indices, scale, base=None):
    """Functional form: x (s·BA ⊕_I V)ᵀ, or x (W0 + s·BA ⊕_I V)ᵀ with base W0 (frozen: it gets no gradient).
    For a sparse-only layer pass B (out, 0) and A (0, in)."""
    return sl_linear_group(x, [(B, A, values, indices, base)], scale)[0]


def uniform_support(n, nnz, generator=None, device=None):
    """nnz distinct positions out of n, uniformly at random, sorted. Drawn with the generator passed (a CPU one from
    train.py's --support_seed gives the same supports on any device), on its device; else on `device` (default
    the CPU) with that device's global generator, which torch.manual_seed seeds too. A layer built on a GPU draws
    there: a 7B model's 224 draws take seconds of CPU each (BENCHMARKS.md, "The support draw"). For a small
    fraction, distinct values of random draws are far cheaper than a permutation of all n (a 7B layer has 45M
    entries); by symmetry they are a uniformly random subset either way."""
    device = generator.device if generator is not None else torch.device("cpu" if device is None else device)
    if nnz > n // 4:
        return torch.randperm(n, generator=generator, device=device)[:nnz].sort().values
    support = torch.empty(0, dtype=torch.long, device=device)
    while support.numel() < nnz:
        draws = torch.randint(n, (int(1.1 * (nnz - support.numel())) + 16,), generator=generator, device=device)
        support = torch.cat([support, draws]).unique()  # sorted
    keep = torch.zeros(support.numel(), dtype=torch.bool, device=device)  # nnz of them at random; a mask keeps
    keep[torch.randperm(support.numel(), generator=generator, device=device)[:nnz]] = True  # them in order, where
    return support[keep]  # sorting the pick cost twice as much


class SLLinear(nn.Module):
    """A bias-free linear layer with weight s·BA ⊕_I V: rank-r factors plus nnz = int(delta·in·out) learned
    values on a support drawn once, uniformly at random, and kept fixed (a buffer, saved in checkpoints).

    rank=0 gives a sparse-only layer (no A, B); delta=0 a low-rank-only layer, which never forms W:
    (x Aᵀ) Bᵀ costs N·r·(in+out) instead of N·in·out. The support is stored as int32 when in·out < 2³¹,
    4 bytes per entry where the paper counts int64's 8; larger layers fall back to int64. packed=True stores it
    packed (pack_support: about 1.1 bytes an entry), unpacked at each use; support() gives the positions either way.

    base=True gives SLTrain-FT (the paper's appendix): W = W0 + s·BA ⊕_I V with W0 (out, in) a frozen buffer, the
    pretrained weight, and B = 0, V = 0 at the start, so that the layer starts as W0; with delta=0 it is LoRA
    (W0 x + s·B(A x), the paper's fine-tuning baseline), which never forms W either.
    """

    def __init__(self, in_features, out_features, rank, delta, alpha, device=None, dtype=None, base=False,
                 packed=False):
        super().__init__()
        if not 0 <= delta < 1:
            raise ValueError(f"delta must be in [0, 1), got {delta}")
        if not 0 <= rank < min(in_features, out_features):
            raise ValueError(f"rank must be in [0, min(in, out)) = [0, {min(in_features, out_features)}), got {rank}")
        nnz = int(delta * in_features * out_features)  # truncated, as the authors' code
        if delta > 0 and nnz == 0:
            raise ValueError(f"delta={delta} gives no sparse entries in a {out_features}x{in_features} layer; "
                             "raise delta or pass delta=0 for a low-rank-only layer")
        if rank == 0 and nnz == 0:
            raise ValueError("rank and delta are both 0: the layer would have no parameters; set rank > 0 or delta > 0")
        self.in_features, self.out_features, self.rank, self.delta = in_features, out_features, rank, delta
        self.scale = alpha / rank if rank > 0 else 0.0
        kw = dict(device=device, dtype=dtype)
        if rank > 0:
            self.A = nn.Parameter(torch.empty(rank, in_features, **kw))
            self.B = nn.Parameter(torch.empty(out_features, rank, **kw))
        else:
            self.register_parameter("A", None)
            self.register_parameter("B", None)
        if nnz > 0:
            index_dtype = torch.int32 if in_features * out_features < 2**31 else torch.int64
            if packed:  # each block's count, then each position's offset (pack_support)
                index_dtype, size = torch.uint8, nnz + -(-in_features * out_features // PACK_BLOCK)
            self.values = nn.Parameter(torch.empty(nnz, **kw))
            self.register_buffer("indices", torch.empty(size if packed else nnz, device=device, dtype=index_dtype))
        else:
            self.register_parameter("values", None)
            self.register_buffer("indices", None)
        self.register_buffer("W0", torch.empty(out_features, in_features, **kw) if base else None)
        if not (device is not None and torch.device(device).type == "meta"):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """§3.3: A Kaiming-uniform and B zero (as LoRA), values U[-1/√in, 1/√in], a uniform random support. A
        low-rank-only layer draws B Kaiming-uniform too (as early versions of ReLoRA's code did for its low-rank-only
        baseline; later ones start B at zero): with B zero and no S, W = 0 in every layer, and so are all their input
        and factor gradients, a point no update leaves. With a base, W0 is drawn as a dense layer
        (LLaMA._init_weights; a pretrained one replaces it) and V = 0."""
        if self.rank > 0:
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
            if self.values is None and self.W0 is None:
                nn.init.kaiming_uniform_(self.B, a=math.sqrt(5))
            else:
                nn.init.zeros_(self.B)
        if self.values is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.values, -bound, bound)
            n = self.in_features * self.out_features
            self.set_support(uniform_support(n, self.values.numel(), device=self.indices.device))
        if self.W0 is not None:  # <-- SLTrain-FT: W = W0 at the start
            nn.init.normal_(self.W0, mean=0.0, std=0.02)
            if self.values is not None:
                nn.init.zeros_(self.values)

    @property
    def packed(self):
        return self.indices is not None and self.indices.dtype == torch.uint8

    def support(self):
        """The support's flat positions in the (out·in,) weight, sorted (int32, or int64 from 2³¹ entries)."""
        return support_positions(self.indices, self.in_features * self.out_features)

    @torch.no_grad()
    def set_support(self, positions):
        """Take these sorted distinct flat positions, one per value, as the support, stored in the layer's own format.
        Checked in either format: flat positions are copied as they are, and copy_ would spread one position over
        every value, and keep a position past the weight (an error only at the next forward) or out of order (one
        only at a resume with --packed_support)."""
        n = self.in_features * self.out_features
        if positions.shape != self.values.shape:
            raise ValueError(f"the support of this {self.out_features}x{self.in_features} layer has "
                             f"{self.values.numel()} positions, got a tensor of shape {tuple(positions.shape)}; pass "
                             "one position per value")
        if not sorted_distinct(positions, n):
            raise ValueError(f"a support takes sorted distinct positions in [0, {n}); sort the positions (and their "
                             "values with them)")
        self.indices.copy_(pack_support(positions, n) if self.packed else positions)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a support saved in the other format (packed or flat positions) is converted to this layer's: the format
        # is storage, not model, so a run may resume with or without train.py --packed_support. One of another
        # layer's size is left as it is, for torch's size mismatch to name: converted, it was unpacked as if of this
        # layer's blocks (an error naming no tensor) or packed as positions past this layer's weight
        key = prefix + "indices"
        saved = state_dict.get(key)
        if saved is not None and self.indices is not None and (saved.dtype == torch.uint8) != self.packed:
            n, nnz = self.in_features * self.out_features, self.values.numel()
            if saved.numel() == (nnz + -(-n // PACK_BLOCK) if saved.dtype == torch.uint8 else nnz):
                state_dict[key] = pack_support(saved, n) if self.packed else support_positions(saved, n)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _factors(self, like):
        """B and A, or zero-size stand-ins of the right shape for a sparse-only layer."""
        if self.rank > 0:
            return self.B, self.A
        return like.new_empty(self.out_features, 0), like.new_empty(0, self.in_features)

    def forward(self, x):
        if self.values is None:  # low-rank only: never form W
            # (N, in) -> (N, r) -> (N, out); s on the (N, r) product: scaling B instead would save a scaled copy of B
            y = ((x @ self.A.t()) * self.scale) @ self.B.t()  # for backward, in every layer (7b: 2.8 GB at batch 1)
            return y if self.W0 is None else F.linear(x, self.W0) + y  # LoRA: W0 x + s·B(A x)
        return sl_linear_group(x, [self.factors()], self.scale)[0]  # <-- SLTrain: W = s·BA + S (+ W0)

    def factors(self):
        """(B, A, values, indices, W0): the layer as sl_linear_group takes it (zero-size B, A if sparse-only)."""
        values = self.values
        return *self._factors(values), values, self.indices, self.W0

    def call_key(self):
        """What layers sharing a call must have alike (input width, scale, dtype, whether a W0), or None for a layer
        that cannot share one (no sparse part: it never forms W)."""
        # read from the module's own dicts, not through nn.Module's attribute lookup: this runs at every forward. A
        # parametrized V (torch.nn.utils.parametrize) is not there: that layer is called on its own
        values = self._parameters.get("values")
        return None if values is None else (self.in_features, self.scale, values.dtype, self._buffers.get("W0") is None)

    @torch.no_grad()
    def merged_weight(self):
        """The dense (out, in) weight in the parameters' dtype (also under autocast), for inspection, export and
        spectrum analysis."""
        device = (self.values if self.values is not None else self.A).device.type
        with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext():
            if self.values is None:
                W = scaled_mm(self.B, self.A, self.scale)
                return W if self.W0 is None else W.add_(self.W0)
            B, A = self._factors(self.values)
            return merge(B, A, self.values, self.indices, self.scale, self.W0)

    def extra_repr(self):
        nnz = 0 if self.values is None else self.values.numel()
        base = ", W0 frozen" if self.W0 is not None else ""
        packed = ", support packed" if self.packed else ""
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, nnz={nnz}, "
                f"scale={self.scale:g}{base}{packed}")


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = tuple("_global" + hooks for hooks in HOOKS)  # nn.modules.module's, the hooks of every module


def one_call(layers):
    """Whether layers of one input can share a call: SLTrain layers alike (SLLinear.call_key). A shared call runs no
    layer's forward nor the module call around it, so a layer with a forward of its own, or a hook (forward or
    backward, on it or on every module), is called on its own: its forward runs and its hooks see it. The group's
    gradients appear together, in backward's one call: with per-layer updates they are alive at once
    (estimate_memory.py counts them so). Asked at every forward, so it reads each layer once."""
    every = nn.modules.module
    if any(getattr(every, hooks) for hooks in GLOBAL_HOOKS):
        return False
    keys = set()
    for layer in layers:
        if not isinstance(layer, SLLinear) or type(layer).forward is not SLLinear.forward \
                or "forward" in vars(layer) or any(getattr(layer, hooks) for hooks in HOOKS):
            return False
        keys.add(layer.call_key())
    return len(keys) == 1 and None not in keys


def projections(x, layers, fuse=True):
    """[layer(x) for layer in layers] for layers of one input x (q, k and v; gate and up). SLTrain layers that can
    (one_call) go through one call, a group (sl_linear_group); fuse=False calls each layer on its own."""
    if fuse and one_call(layers):
        return sl_linear_group(x, [layer.factors() for layer in layers], layers[0].scale)
    return [layer(x) for layer in layers]
