"""
A compact LLaMA (pre-norm RMSNorm, rotary embeddings, SwiGLU MLP, causal attention, no biases, untied head)
in which every attention and MLP projection can be an SLTrain layer: W = s·BA + S (see sllinear.py).

    from model import LLaMA, config_for
    model = LLaMA(config_for("60m", method="sltrain"))     # the paper's 60M model, 43.53M parameters

Sizes are the paper's (GaLore's LLaMA configs); `tiny` is for tests and quick runs. method="relora" gives the
ReLoRA baseline (W = W0 + s·BA, W0 frozen, merged into every few thousand updates by train.py); method="sltrain_ft"
fine-tunes a pretrained model as the paper's appendix does (W = W0 + s·BA + S, W0 frozen, only B, A and V learn).
Count a model for free:  LLaMA(config_for("7b", method="sltrain"), device="meta").num_params()
"""

import atexit
import gc
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sllinear import SLLinear, one_call, projections

PRETRAINING = ("full", "lowrank", "relora", "sltrain")  # the paper's Table 2 methods
METHODS = PRETRAINING + ("sltrain_ft",)  # and fine-tuning a pretrained model (its appendix)
SPARSE = ("sltrain", "sltrain_ft")  # the methods with a sparse part S (and so a --delta)


@dataclass
class LLaMAConfig:
    vocab_size: int = 32000
    dim: int = 512
    ffn_dim: int = 1376
    n_heads: int = 8
    n_layers: int = 8
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    method: str = "full"    # full | lowrank (W = s·BA) | relora (W = W0 + s·BA, W0 frozen) | sltrain (W = s·BA + S)
    #                         | sltrain_ft (W = W0 + s·BA + S, W0 frozen: fine-tuning)
    rank: int = 128         # r of B (out, r) and A (r, in)
    alpha: float = 32.0     # low-rank scale s = alpha / r
    delta: float = 0.03     # sltrain(_ft): fraction of each weight's entries on the sparse support
    packed_support: bool = False  # sltrain(_ft): each support packed, ~1.1 bytes a position where int32 takes 4


# name -> (dim, ffn_dim, n_heads, n_layers, rank, alpha, delta): the paper's Table 2 and §5.1 defaults
SIZES = {
    "tiny": (64, 176, 4, 2, 16, 32.0, 0.03),
    "60m": (512, 1376, 8, 8, 128, 32.0, 0.03),
    "130m": (768, 2048, 12, 12, 256, 16.0, 0.03),
    "350m": (1024, 2736, 16, 24, 256, 16.0, 0.03),
    "1b": (2048, 5461, 32, 24, 512, 8.0, 0.03),
    "7b": (4096, 11008, 32, 32, 1024, 8.0, 0.05),
}


# sltrain_ft's (rank, alpha, delta) at every size: the paper's fine-tuning table (RoBERTa-base on GLUE, its appendix)
# has r = 8 throughout, and δ = 0.005 and α = 32 are the values its per-task tuning picked most often
FINETUNE = (8, 32.0, 0.005)
# the longest sequence: rotary angles are position x frequency in float32, whose integers are exact to 2^24 only;
# past it two positions would share one rotation
MAX_LENGTH = 2 ** 24


def length_refusal(max_length):
    """The one line refusing a --max_length past MAX_LENGTH, as every command that takes one says it; None if not."""
    if max_length <= MAX_LENGTH:
        return None
    return (f"--max_length must be at most 2^24 = {MAX_LENGTH:,}, the positions a model tells apart (its rotary "
            f"positions are float32, exact to 2^24), got {max_length}")


def config_for(size, **overrides):
    """The config of a named size; keyword overrides (method, rank, alpha, delta, ...) win. None means default."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    dim, ffn_dim, n_heads, n_layers, rank, alpha, delta = SIZES[size]
    if overrides.get("method") == "sltrain_ft":  # fine-tuning: the paper's settings for it, not its pretraining ones
        rank, alpha, delta = FINETUNE
    config = LLaMAConfig(dim=dim, ffn_dim=ffn_dim, n_heads=n_heads, n_layers=n_layers,
                         rank=rank, alpha=alpha, delta=delta)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"unknown config field {key!r}; fields are {', '.join(vars(config))}")
        if value is not None:
            setattr(config, key, value)
    if config.method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {config.method!r}")
    if config.method in ("lowrank", "relora") and not config.rank >= 1:  # (sltrain may be sparse alone)
        raise ValueError(f"methods lowrank and relora train rank-r factors, so they need a rank of at least 1, got "
                         f"{config.rank}; pass --rank 1 or more")
    return config


def make_linear(in_features, out_features, config, device):
    """A projection of the transformer: dense, or re-parameterized as low-rank (+ sparse)."""
    if config.method == "full":
        return nn.Linear(in_features, out_features, bias=False, device=device)
    if config.method == "relora":
        return ReLoRALinear(in_features, out_features, config.rank, config.alpha, device=device)
    delta = config.delta if config.method in SPARSE else 0.0
    base = config.method == "sltrain_ft"  # <-- SLTrain-FT: a frozen pretrained W0 under the factors
    return SLLinear(in_features, out_features, config.rank, delta, config.alpha, device=device, base=base,
                    packed=config.packed_support)


class ReLoRALinear(nn.Module):
    """The ReLoRA baseline (Lialin et al. 2023): W = W0 + s·BA with W0 (out, in) a frozen buffer, initialized as a
    dense layer, and B (out, r), A (r, in) trained as in LoRA. merge_and_reinit() folds s·BA into W0 and restarts
    the factors; train.py does it every --relora_reset updates. W0 is stored, which is what SLTrain avoids."""

    def __init__(self, in_features, out_features, rank, alpha, device=None):
        super().__init__()
        if not 0 < rank < min(in_features, out_features):
            raise ValueError(f"rank must be in [1, min(in, out)) = [1, {min(in_features, out_features)}), got {rank}")
        self.in_features, self.out_features, self.rank, self.scale = in_features, out_features, rank, alpha / rank
        self.register_buffer("W0", torch.empty(out_features, in_features, device=device))
        self.A = nn.Parameter(torch.empty(rank, in_features, device=device))
        self.B = nn.Parameter(torch.empty(out_features, rank, device=device))
        if not (device is not None and torch.device(device).type == "meta"):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.normal_(self.W0, mean=0.0, std=0.02)  # as the dense layers of LLaMA._init_weights
        self._reinit_factors()

    def _reinit_factors(self, generator=None):
        # LoRA's start, BA = 0: B zero, A as kaiming_uniform_(a=√5), i.e. U[-1/√in, 1/√in], drawn on the CPU
        # generator given, so that every DDP rank (and a resumed run) draws the same A
        bound = 1 / math.sqrt(self.in_features)
        self.A.copy_(torch.empty(self.A.shape).uniform_(-bound, bound, generator=generator))
        nn.init.zeros_(self.B)

    @torch.no_grad()
    def merge_and_reinit(self, generator=None):
        """W0 += s·BA, then a fresh A and B = 0: the layer computes the same function, with new factors to train.
        The sum is formed in float32 and rounded once into W0's dtype, as export.py merges: in bf16, s·B and s·BA
        each rounded before the add would round twice (test_relora's layer: 32% of W0's entries off, each restart).
        It holds a float32 (out, in) copy of one layer's W0 for the moment."""
        # (out, r) @ (r, in) -> (out, in)
        self.W0.copy_(torch.addmm(self.W0.float(), self.B.float(), self.A.float(), alpha=self.scale))
        self._reinit_factors(generator)

    def forward(self, x):
        return F.linear(x, self.W0) + ((x @ self.A.t()) * self.scale) @ self.B.t()  # <-- ReLoRA: W0 x + s·B(A x)

    @torch.no_grad()
    def merged_weight(self):
        """The dense (out, in) weight W0 + s·BA, for inspection, export and spectrum analysis."""
        return torch.addmm(self.W0, self.B, self.A, alpha=self.scale)  # (out, r) @ (r, in) -> (out, in)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scale={self.scale:g}"


def is_projection(name):
    """Whether a parameter of a full-rank LLaMA is an attention or MLP projection weight: the layers the other
    methods re-parameterize, and those whose gradients GaLore projects."""
    return name.endswith("_proj.weight")


def train_only(model, leaves):
    """Only the parameters whose own name (A, B, values, weight) is in leaves learn; the others stay as they are."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1] in leaves)


def freeze_all_but_values(model):
    """--freeze lowrank (Table 1's sparse training): only SLTrain's sparse values V learn; B, A, embeddings, norms
    and head stay as they are."""
    train_only(model, ("values",))


def _cast(module, dtype, base_dtype):
    """The module, its weights in dtype, then SLTrain-FT's W0 in base_dtype (each None: as they are)."""
    if dtype is not None:
        module.to(dtype)
    if base_dtype is not None:
        frozen_base_to(module, base_dtype)
    return module


def frozen_base_to(model, dtype):
    """SLTrain-FT's frozen W0 in dtype, the compute dtype under mixed precision (train.py --amp): it has no gradient
    and no optimizer state, and only ever enters the bf16 W, so float32 would double the largest tensor for
    nothing (26 GB against 13 GB at 7b)."""
    for module in model.modules():
        if isinstance(module, SLLinear) and module.W0 is not None:
            module.W0 = module.W0.to(dtype)


def relora_merge(model, generator=None):
    """Merge every ReLoRA layer of the model (see ReLoRALinear.merge_and_reinit), drawing the new A's from the CPU
    `generator`; returns the reset A and B, whose optimizer state the caller prunes."""
    layers = [m for m in model.modules() if isinstance(m, ReLoRALinear)]
    for layer in layers:
        layer.merge_and_reinit(generator)
    return [p for layer in layers for p in (layer.A, layer.B)]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x):
        # normalize in float32 for stability under bf16, as LLaMA does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rope_cache(T, head_dim, theta, device):
    """cos and sin of the rotary angles, each (T, head_dim), in the half-split layout of HF LLaMA."""
    if T > MAX_LENGTH:
        raise ValueError(f"{T:,} positions: rotary positions are float32, exact up to MAX_LENGTH = 2^24")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    fuse = True  # SLTrain's q, k and v in one call (sllinear.projections); LLaMA.fuse_projections sets it

    def __init__(self, config, device=None):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.dim // config.n_heads
        self.q_proj = make_linear(config.dim, config.dim, config, device)
        self.k_proj = make_linear(config.dim, config.dim, config, device)
        self.v_proj = make_linear(config.dim, config.dim, config, device)
        self.o_proj = make_linear(config.dim, config.dim, config, device)

    def shared_input(self):
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, kv=None):
        B, T, C = x.shape
        q, k, v = projections(x, self.shared_input(), self.fuse)  # (B, T, C) each
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # generation: attend to the cached positions too (KVCache.store)
            k, v = kv(k, v)  # (B, nh, T_past + T, hs)
        y = F.scaled_dot_product_attention(q, k, v, **causal(T, k.size(2), q.device))  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


def causal(T, S, device):
    """The causal mask for T queries that are the last of S positions, as scaled_dot_product_attention's arguments:
    its is_causal aligns the mask to the first position, which is right only when T == S."""
    if T == S:
        return dict(is_causal=True)
    if T == 1:  # one new token sees every position
        return {}
    return dict(attn_mask=torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T))


class KVCache:
    """The keys and values of the positions a model has seen, for generation: each new token's attention reads them
    instead of recomputing the whole prefix. model(idx, cache=c) takes idx as the tokens after c.pos ones already
    seen, stores their keys and values and moves c.pos on. Holds at most `length` positions of one batch; allocated
    on first use in the dtype and device of the keys, and refuses keys of another batch, dtype or device.
    Generation runs eager: compiled blocks would recompile for each layer's store and each new length."""

    def __init__(self, n_layers, length):
        self.n_layers, self.length, self.pos = n_layers, length, 0
        self.k = self.v = None  # (n_layers, B, nh, length, hs) each

    def store(self, layer, k, v):
        """k, v (B, nh, T, hs) of the next T positions into layer's slots -> the keys and values of all positions so
        far, (B, nh, pos + T, hs) each."""
        end = self.pos + k.size(2)
        if self.k is not None and (k.size(0), k.dtype, k.device) != (self.k.size(1), self.k.dtype, self.k.device):
            # else another batch's keys were broadcast into its rows (or rounded into its dtype) and the attention
            # failed on shapes or dtypes, naming neither the cache nor the fix
            raise ValueError(f"this cache holds keys of a batch of {self.k.size(1)} in {self.k.dtype} on "
                             f"{self.k.device}, got a batch of {k.size(0)} in {k.dtype} on {k.device}; start a new "
                             "KVCache for each batch, and after casting or moving the model")
        if end > self.length:
            raise ValueError(f"the cache holds {self.length} positions; {end} were asked for: make a KVCache of "
                             f"{end} or more, or crop the window to the cache (as sample.generate does past its "
                             "context)")
        if self.k is None:
            self.k = k.new_empty(self.n_layers, *k.shape[:2], self.length, k.size(3))
            self.v = torch.empty_like(self.k)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class MLP(nn.Module):
    fuse = True  # SLTrain's gate and up in one call (sllinear.projections); LLaMA.fuse_projections sets it

    def __init__(self, config, device=None):
        super().__init__()
        self.gate_proj = make_linear(config.dim, config.ffn_dim, config, device)
        self.up_proj = make_linear(config.dim, config.ffn_dim, config, device)
        self.down_proj = make_linear(config.ffn_dim, config.dim, config, device)

    def shared_input(self):
        return self.gate_proj, self.up_proj

    def forward(self, x):
        gate, up = projections(x, self.shared_input(), self.fuse)
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class Block(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, device)
        self.attn = Attention(config, device)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, device)
        self.mlp = MLP(config, device)

    def forward(self, x, cos, sin, kv=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        return x + self.mlp(self.mlp_norm(x))


# The loss goes through the logits a chunk of rows at a time: chunks of LOSS_CHUNK logits (16 MB in float32) and at
# most LOSS_CHUNKS of them, so a large batch takes a few large chunks rather than many launches of small ones.
LOSS_CHUNK, LOSS_CHUNKS = 1 << 22, 16


def loss_chunk_rows(n, vocab):
    """Rows per chunk of the loss for n rows of vocab logits."""
    return max(1, LOSS_CHUNK // vocab, -(-n // LOSS_CHUNKS))


def _logsumexp32(x):
    """torch.logsumexp(x.float(), dim=1) with one float32 temporary of x's size instead of two."""
    top = x.amax(dim=1, keepdim=True).float()
    return x.to(torch.float32, copy=True).sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))


class CrossEntropySum(torch.autograd.Function):
    """Σ over the rows whose target is not negative of -log softmax(logits)[target], in float32, for logits
    (N, vocab) of any dtype. F.cross_entropy(logits.float()) saves the float32 log-probabilities for backward,
    twice the bytes of bf16 logits, and its backward holds two more float32 tensors of their size at once: ~100 MB at
    the peak of a 350m step at batch 1 × 256, ~6 GB at batch 64. This saves the logits themselves and one log-sum-exp
    per row, and forms the gradient (softmax - one-hot)·grad in backward, chunk by chunk (loss_chunk_rows)."""

    @staticmethod
    def forward(ctx, logits, targets):
        lse = torch.cat([_logsumexp32(chunk) for chunk in logits.split(loss_chunk_rows(*logits.shape))])  # (N,)
        counted = targets >= 0  # a negative target is ignored: data.py's -1, and -100, Hugging Face's
        picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1).float()  # the targets' logits
        ctx.save_for_backward(logits, targets, lse)
        return torch.where(counted, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse = ctx.saved_tensors
        rows = loss_chunk_rows(*logits.shape)
        scale = (targets >= 0).float().mul_(grad_loss)  # (N,): rows not counted get no gradient
        grad = torch.empty_like(logits)
        for start in range(0, logits.size(0), rows):
            part = slice(start, start + rows)
            p = logits[part].to(torch.float32, copy=True).sub_(lse[part].unsqueeze(1)).exp_()  # softmax
            p.scatter_add_(1, targets[part].clamp(min=0).unsqueeze(1), p.new_full((p.size(0), 1), -1.0))
            grad[part] = p.mul_(scale[part].unsqueeze(1))
            del p  # before the next chunk's is made
        return grad, None


class LLaMA(nn.Module):
    def __init__(self, config, device=None, dtype=None, base_dtype=None):
        """dtype: the weights' (default float32); base_dtype: SLTrain-FT's frozen W0's (default dtype; train.py --amp
        gives bf16 under float32 weights). The weights are drawn in float32 and rounded, the numbers of
        LLaMA(config).to(dtype), but a block at a time as it is drawn: the build holds the model in dtype and one
        block in float32, not all of it (at 7b in float32 ReLoRA's takes 37 GB, SLTrain-FT's 27 and full rank's 27,
        where their bf16 steps with 8-bit Adam per layer take 26, 15 and, with GaLore, 21)."""
        super().__init__()
        # checked here, before any weight is made: torch builds a layer of width 0 (and range() a model of no blocks)
        # without a word, and a head count of 0 would fail in the split below
        sizes = ("vocab_size", "dim", "ffn_dim", "n_heads", "n_layers")
        if bad := [f"{name} {getattr(config, name)}" for name in sizes if not getattr(config, name) >= 1]:
            raise ValueError(f"a model's sizes must be at least 1, got {', '.join(bad)}; pass a size of model.SIZES "
                             "or positive overrides")
        if config.dim % config.n_heads or (config.dim // config.n_heads) % 2:
            raise ValueError(f"dim {config.dim} must split into {config.n_heads} heads of even size")
        self.config = config
        self.activation_checkpointing = False  # recompute each block in backward to save activations
        self.autocast = None  # a dtype (bfloat16): mixed precision, the parameters stay float32 (train.py --amp)
        self.embed = _cast(nn.Embedding(config.vocab_size, config.dim, device=device), dtype, base_dtype)
        self.layers = nn.ModuleList([_cast(Block(config, device), dtype, base_dtype) for _ in range(config.n_layers)])
        self.norm = _cast(RMSNorm(config.dim, config.norm_eps, device), dtype, base_dtype)
        self.lm_head = _cast(nn.Linear(config.dim, config.vocab_size, bias=False, device=device), dtype, base_dtype)
        if not (device is not None and torch.device(device).type == "meta"):
            self.apply(self._init_weights)
        if config.method == "sltrain_ft":  # fine-tuning: the pretrained embeddings, norms and head stay as they are
            train_only(self, ("A", "B", "values"))

    @staticmethod
    @torch.no_grad()
    def _init_weights(module):
        # dense weights as HF LLaMA (normal, std 0.02), drawn in float32 (a layer's at a time) and rounded into the
        # weight's dtype, as a float32 model cast after; SLLinear keeps its own §3.3 initialization
        if isinstance(module, (nn.Linear, nn.Embedding)):
            weight = module.weight
            weight.copy_(torch.empty(weight.shape, device=weight.device).normal_(mean=0.0, std=0.02))

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), mean loss over targets >= 0, or None). To train, keep only
        the loss (model(x, y)[1]): the loss saves what its backward needs, and logits held by the caller would stay
        alive through backward beside it. With a KVCache, idx are the tokens at positions cache.pos onwards (see
        sample.py)."""
        if self.autocast is None:
            return self._forward(idx, targets, cache)
        # matmuls in self.autocast, norms and the loss in float32; backward follows the dtypes of the forward
        with torch.autocast(idx.device.type, dtype=self.autocast):
            return self._forward(idx, targets, cache)

    def _forward(self, idx, targets, cache):
        B, T = idx.shape
        start = 0 if cache is None else cache.pos
        cos, sin = rope_cache(start + T, self.config.dim // self.config.n_heads, self.config.rope_theta, idx.device)
        if start:
            cos, sin = cos[start:], sin[start:]  # the rotations of positions start .. start + T - 1
        x = self.embed(idx)  # (B, T, C)
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, None if cache is None else partial(cache.store, i))
        if cache is not None:
            cache.pos += T
        logits = self.lm_head(self.norm(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            # a mean over the counted targets; a batch with none counted gives 0, not 0/0
            loss = CrossEntropySum.apply(logits.view(-1, logits.size(-1)), targets.reshape(-1)) \
                / (targets >= 0).sum().clamp(min=1)
        return logits, loss

    def compile_blocks(self, **options):
        """torch.compile each transformer block in place (regional compilation; options go to torch.compile). The
        blocks are alike, so one graph serves them all and compiling takes one block's time; and each block's
        backward stays its own, so per-layer updates free a block's gradients before the next block's exist, where
        a whole-model graph would return every gradient at once. The embedding, the head and the loss stay eager."""
        for block in self.layers:
            block.compile(**options)
        return self

    def fuse_projections(self, on=True):
        """Whether SLTrain's projections of one input (q, k and v; gate and up) share one call, as they do by
        default (sllinear.projections): the same arithmetic per output, fewer operations for the host to issue.
        Off, each is its own call, for comparison (suite.py's model section times both)."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.fuse = on
        return self

    def shared_calls(self):
        """The groups of projections that share one call as the model stands (sllinear.projections)."""
        return [m.shared_input() for m in self.modules()
                if isinstance(m, (Attention, MLP)) and m.fuse and one_call(m.shared_input())]

    def num_params(self):
        """Parameter counts by kind: dense (embeddings, norms, head, full-rank projections), lowrank (B, A),
        sparse (values), and total. Works on the meta device."""
        counts = {"dense": 0, "lowrank": 0, "sparse": 0}
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            kind = "lowrank" if leaf in ("A", "B") else "sparse" if leaf == "values" else "dense"
            counts[kind] += p.numel()
        counts["total"] = sum(counts.values())
        return counts


def slow_width(config):
    """On a GPU, a note on an MLP width that is not a multiple of 8 (1b's 5461, the paper's): a bf16 matmul whose rows
    are not 16-byte aligned falls back to slower kernels. Measured on an H200 (BENCHMARKS.md, the sixth GPU
    measurements): a 1b forward and backward at 5461 took 1.8x (SLTrain) to 2.4x (full rank) as long as at 5464.
    None where the width is aligned."""
    if config.ffn_dim % 8 == 0:
        return None
    aligned = -(-config.ffn_dim // 8) * 8
    return (f"note: the MLP width {config.ffn_dim} is not a multiple of 8, and a GPU runs bf16 matmuls of such a "
            f"width slowly (a 1b step at 5461 takes 1.8x (SLTrain) to 2.4x (full rank) as long as at 5464 on an "
            f"H200); --ffn_dim {aligned} trains a model {aligned / config.ffn_dim - 1:.2%} wider in its MLPs at full "
            "speed")


def describe(model):
    """One line of parameter counts in millions, e.g. for the start of a training run."""
    n = model.num_params()
    c = model.config
    frozen = sum(b.numel() for name, b in model.named_buffers() if name.endswith("W0"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (f"{c.method} LLaMA: {n['total'] / 1e6:.2f}M parameters = {n['dense'] / 1e6:.2f}M dense + "
            f"{n['lowrank'] / 1e6:.2f}M low-rank + {n['sparse'] / 1e6:.2f}M sparse"
            + (f" (+ {frozen / 1e6:.2f}M frozen in W0)" if frozen else "")
            + (f"; {trained / 1e6:.2f}M of them trained" if trained < n["total"] else ""))


if __name__ == "__main__":
    import argparse
    import signal
    # no flags: --help says what it prints, and a flag (estimate_memory.py's --size) is refused, not ignored
    argparse.ArgumentParser(description="The parameter counts of every size, full-rank, low-rank and SLTrain, in "
                            "millions (the paper's Table 2), counted on the meta device. No flags: estimate_memory.py "
                            "counts one configuration's parameters and memory.").parse_args()
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a reader that stops (| head) ends the table, not a traceback
    # the parameter table of the paper (Table 2), counted on the meta device
    # relora trains as many parameters as lowrank and Table 2 lists its merged model, as many as full: not repeated
    shown = [m for m in PRETRAINING if m != "relora"]
    print(f"{'size':>5} " + " ".join(f"{m:>9}" for m in shown) + "   (millions)")
    for size in SIZES:
        row = [LLaMA(config_for(size, method=m), device="meta").num_params()["total"] / 1e6 for m in shown]
        print(f"{size:>5} " + " ".join(f"{v:9.2f}" for v in row))
