"""
The 8-bit Adam step as one GPU kernel (Triton): what optim._adam8bit_ does in ~35 kernels, in one pass over memory.

On an H200 (2026-11-26) the eager step took 63.9x the time of torch's fused AdamW on the 7b shapes and
torch.compile's 16.4x: six fused kernels, each a pass over the tensor. Here each program takes ROWS whole blocks
(of one tensor, or of a run of tensors laid end to end by optim.Adam8bit, each padded to whole blocks), reads their
parameter, gradient, codes and absmax once, and writes them once: dequantize m and √v with the
256-entry maps, update m, v and the parameter in float32, take each block's new absmax and requantize to the
nearest code through optim._lookup_tables' 2^16 buckets. ~10 bytes an entry where fused AdamW moves 14 (bf16). On
the same H200 this kernel took 1.23x fused AdamW's time (BENCHMARKS.md); ROWS = 4 was the fastest of 1 to 16.

The arithmetic is _adam8bit_'s, operation by operation and with the same roundings: IEEE division and square root
(Triton's default `/` and sqrt are approximate), a bf16 parameter rounded after its decay and again after the step,
as the eager in-place ops round it. A GPU compiler may fuse a multiply and an add into one rounding where the eager
kernels do not, so the results agree with the eager step to float32 rounding, and the state format is the same.

Used by optim.Adam8bit (fused=None, the default) where usable(): float32 or bf16 parameters on a CUDA GPU of compute
capability 8.0 or later, Triton importable (it ships with torch's CUDA builds), a block size of a power of two.
Tested on CPU (test_adam8bit_kernel.py): under Triton's interpreter (TRITON_INTERPRET=1), which runs the same kernel
with numpy, and compiled to sm_80 and sm_90 machine code, which needs no GPU either.
"""

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: then nothing here is launched
    triton = None

ROWS = 4  # blocks per program: with 256-entry blocks, 1024 entries, a tile of 4 warps


def available():
    return triton is not None


if triton is not None:
    @triton.jit
    def _quantize(x, first_ptr, threshold_ptr, BLOCK: tl.constexpr):
        """x (ROWS, BLOCK) float32 -> (absmax (ROWS,), codes (ROWS, BLOCK) uint8), as optim._quantize_."""
        absmax = tl.maximum(tl.max(tl.abs(x), axis=1), 1.1754943508222875e-38)  # float32's smallest normal
        scaled = tl.math.div_rn(x, absmax[:, None])
        bucket = (scaled.to(tl.int32, bitcast=True) >> 16) & 0xFFFF  # the top 16 bits of each float32
        codes = tl.load(first_ptr + bucket) + (scaled > tl.load(threshold_ptr + bucket)).to(tl.uint8)
        return absmax, codes

    @triton.jit
    def _round_to_bf16(x):
        """x float32 rounded to the nearest bfloat16 (ties to even), still as float32: torch's rounding, written out
        because Triton's interpreter truncates where a GPU rounds."""
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
        return tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)  # a NaN stays NaN

    @triton.jit
    def _adam8bit_kernel(param_ptr, grad_ptr, m_codes_ptr, m_absmax_ptr, v_codes_ptr, v_absmax_ptr,
                         m_map_ptr, m_first_ptr, m_threshold_ptr, v_map_ptr, v_first_ptr, v_threshold_ptr,
                         n, blocks, step_size, one_minus_beta1, beta2, one_minus_beta2, eps, decay,
                         sqrt_bias_correction2, HAS_DECAY: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, ON_DEVICE: tl.constexpr):
        if ON_DEVICE:  # step_size, decay and sqrt_bias_correction2 point at this update's values (a CUDA graph's)
            step_size = tl.load(step_size)
            sqrt_bias_correction2 = tl.load(sqrt_bias_correction2)
            if HAS_DECAY:
                decay = tl.load(decay)
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        index = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (ROWS, BLOCK) into the padded flat state
        row_in = rows < blocks
        in_state = row_in[:, None] & (index >= 0)  # every entry of a block that exists, padding included
        in_param = index < n  # the last block's padding is not the parameter's

        m_absmax = tl.load(m_absmax_ptr + rows, mask=row_in, other=0.0)
        v_absmax = tl.load(v_absmax_ptr + rows, mask=row_in, other=0.0)
        m_codes = tl.load(m_codes_ptr + index, mask=in_state, other=0).to(tl.int32)
        v_codes = tl.load(v_codes_ptr + index, mask=in_state, other=0).to(tl.int32)
        m = tl.load(m_map_ptr + m_codes) * m_absmax[:, None]
        v = tl.load(v_map_ptr + v_codes) * v_absmax[:, None]
        v = v * v  # v from √v

        g = tl.load(grad_ptr + index, mask=in_param, other=0.0).to(tl.float32)
        g = tl.where((g == g) & (tl.abs(g) != float("inf")), g, 0.0)  # a non-finite entry counts as zero
        # torch's lerp: m + w·(g - m) for a weight w under 0.5, else g - (g - m)·(1 - w)
        # (the last block's padding, with m = v = 0 and g loaded as 0, stays 0)
        m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * (g - m), g - (g - m) * (1.0 - one_minus_beta1))
        v = v * beta2 + one_minus_beta2 * g * g  # torch's addcmul: v + (value·g)·g
        sqrt_v = tl.minimum(tl.sqrt_rn(v), 3.4028234663852886e38)  # float32's largest: an overflowed v freezes

        p = tl.load(param_ptr + index, mask=in_param, other=0.0)
        p32 = p.to(tl.float32)
        if HAS_DECAY:
            p32 = p32 * decay
            if BF16:  # rounded to the parameter's dtype, as param.mul_ rounds it
                p32 = _round_to_bf16(p32)
        denom = tl.math.div_rn(sqrt_v, sqrt_bias_correction2) + eps
        p32 = p32 + step_size * tl.math.div_rn(m, denom)
        if BF16:
            p32 = _round_to_bf16(p32)  # so that the conversion below, exact now, cannot truncate
        tl.store(param_ptr + index, p32.to(p.dtype), mask=in_param)

        m_absmax, m_codes = _quantize(m, m_first_ptr, m_threshold_ptr, BLOCK)
        v_absmax, v_codes = _quantize(sqrt_v, v_first_ptr, v_threshold_ptr, BLOCK)
        tl.store(m_codes_ptr + index, m_codes, mask=in_state)
        tl.store(v_codes_ptr + index, v_codes, mask=in_state)
        tl.store(m_absmax_ptr + rows, m_absmax, mask=row_in)
        tl.store(v_absmax_ptr + rows, v_absmax, mask=row_in)


def adam8bit_(param, grad, m, v, tables, block_size, hyper):
    """optim._adam8bit_'s update, in place, as one kernel launch: param (n,) and grad (n,) flat and contiguous; m
    and v the (codes (nb·bs,), absmax (nb,)) of m and √v; tables the (map, first, threshold) of the signed and
    unsigned maps (optim._lookup_tables); hyper = optim._step_scalars(...), or optim._hyper's with the step size,
    decay and bias correction as 0-dim float32 tensors on the device, which the kernel reads there (a CUDA graph's
    replays read each update's). block_size: a power of two."""
    (m_codes, m_absmax), (v_codes, v_absmax), (signed, unsigned) = m, v, tables
    step_size, one_minus_beta1, beta2, one_minus_beta2, eps, decay, sqrt_bias_correction2 = hyper
    blocks = m_absmax.numel()
    with on_its_device(param):
        _adam8bit_kernel[(triton.cdiv(blocks, ROWS),)](
            param, grad, m_codes, m_absmax, v_codes, v_absmax, *signed, *unsigned,
            param.numel(), blocks, step_size, one_minus_beta1, beta2, one_minus_beta2, eps,
            1.0 if decay is None else decay, sqrt_bias_correction2, HAS_DECAY=decay is not None,
            BF16=param.dtype == torch.bfloat16, BLOCK=block_size, ROWS=ROWS, ON_DEVICE=torch.is_tensor(step_size))


def on_its_device(tensor):
    """Triton launches on the current CUDA device (and its current stream), not on its arguments' device as torch's
    operations do: for a parameter on another GPU than the current one (a model on cuda:1 in a process that never
    called torch.cuda.set_device), the launch is made with that GPU current."""
    if tensor.device.type == "cuda" and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def usable(param, block_size):
    """Whether Adam8bit can take this kernel for a parameter (see why_not)."""
    return why_not(param.device, param.dtype, block_size) is None


def why_not(device, dtype, block_size):
    """None where the kernel can run for a parameter of this device and dtype in blocks of block_size entries: a CUDA
    GPU of compute capability 8.0 or later (Ampere, Hopper: what it is built and tested for), Triton, float32 or bf16
    (the two whose roundings the kernel writes out), a power of two from 16 to 8192 (whole tiles). Else what is
    missing, in words."""
    device = torch.device(device)
    if device.type != "cuda":  # the nearer reason on a CPU, whose torch has no Triton either
        return f"it runs on a CUDA GPU, not on {device.type}"
    if not available():
        return "Triton is not installed (it comes with torch's CUDA builds)"
    if _capability(device) < (8, 0):
        major, minor = _capability(device)
        return f"it needs a GPU of compute capability 8.0 or later; {device} has {major}.{minor}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 or bfloat16 parameters, not {dtype}"
    if block_size & (block_size - 1) or not 16 <= block_size <= 8192:
        return f"its block size must be a power of two from 16 to 8192, not {block_size}"
    return None


@functools.lru_cache(maxsize=None)
def _capability(device):
    return torch.cuda.get_device_capability(device)

