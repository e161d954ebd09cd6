"""
optim.Adam8bit beside bitsandbytes' Adam8bit, the optimizer the paper ran: the same quantization maps and block
format, the same first step to the bit, and on gradients whose scales differ within a block (where ours stores √v
and bitsandbytes v) a trajectory at least as close to float32 AdamW. Runs when bitsandbytes is installed (its CPU
kernels; written against 0.50.2), skipped otherwise, as in CI.

    pip install bitsandbytes && python -m pytest -q test_bitsandbytes.py
"""

import pytest
import torch

from bench import HEAVY_CASES, bench_heavy, bench_step, heavy_tailed, report_heavy
from optim import Adam8bit, dequantize_blockwise, dynamic_map, quantize_blockwise

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_maps_are_bitsandbytes_maps(signed):
    assert torch.equal(dynamic_map(signed), F.create_dynamic_map(signed=signed))


def cases():
    gen = torch.Generator().manual_seed(0)
    scales = torch.exp(2.3 * torch.randn(400, 1, generator=gen))  # a scale per row of 250: blocks mix rows
    return {"normal": torch.randn(100_003, generator=gen),  # a partial last block
            "mixed scales": (torch.randn(400, 250, generator=gen) * scales).view(-1),
            "ten decades": torch.randn(100_000, generator=gen) * 10 ** (-10 * torch.rand(100_000, generator=gen)),
            "one block": torch.randn(7, generator=gen)}


@pytest.mark.parametrize("case", ["normal", "mixed scales", "ten decades", "one block"])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_blockwise_is_bitsandbytes_format_with_the_nearest_codes(case, signed):
    """The same absmax per block of 256, and codes in the same map that are the nearest to each value (bitsandbytes'
    own search misses it at times, most often at small magnitudes), except, by design, a positive value nearest to
    0 in the unsigned map, which ours codes 1 (optim._lookup_tables), so that the √v of a live entry never decodes
    to 0. Its codes then decode to the same values as its own decoding gives, to the bit."""
    x = cases()[case]
    x = x if signed else x.abs()
    theirs, state = F.quantize_blockwise(x, code=F.create_dynamic_map(signed=signed), blocksize=256)
    codes, absmax = quantize_blockwise(x, signed, 256)
    assert torch.equal(absmax, state.absmax)
    codes = codes[: x.numel()]
    code, blocks = dynamic_map(signed).double(), torch.arange(x.numel()) // 256
    scaled = (x / absmax[blocks]).double()  # the float32 division both make
    ours_off, theirs_off = (code[codes.long()] - scaled).abs(), (code[theirs.long()] - scaled).abs()
    by_design = (x > 0) & (scaled <= code[1] / 2) if not signed else torch.zeros_like(x, dtype=torch.bool)
    assert bool(by_design.any()) or signed or case != "ten decades"  # the case has values below the first midpoint
    assert torch.equal(codes[by_design], torch.ones_like(codes[by_design]))
    assert bool((ours_off[~by_design] <= theirs_off[~by_design]).all()), "ours must be the nearest code"
    nearer = int((ours_off < theirs_off).sum())
    print(f"{case}, {'unsigned' if not signed else 'signed'}: {nearer} of {x.numel()} codes nearer than "
          f"bitsandbytes', {int(by_design.sum())} positive values coded 1 where 0 is nearer")
    # and our dequantization reads their state as they do, to the bit
    padded = torch.zeros(absmax.numel() * 256, dtype=torch.uint8)
    padded[: x.numel()] = theirs
    assert torch.equal(dequantize_blockwise(padded, absmax, signed, x.numel()), F.dequantize_blockwise(theirs, state))


@pytest.mark.parametrize("shape", [(4096,), (5000,), (64, 128), (300, 1030)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam8bit_first_step_is_bitsandbytes_to_the_bit(shape, weight_decay):
    """From the zero state both take the step's float32 moments: the same update, bit for bit (after it the
    stored moments differ: √v here, v there)."""
    torch.manual_seed(0)
    p0, grad = 0.1 * torch.randn(shape), 0.01 * torch.randn(shape)
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    for p, opt in ((ours, Adam8bit([ours], lr=1e-3, weight_decay=weight_decay)),
                   (theirs, bnb.optim.Adam8bit([theirs], lr=1e-3, weight_decay=weight_decay))):
        p.grad = grad.clone()
        opt.step()
    assert not torch.equal(ours, p0)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max().item()


@pytest.mark.parametrize("case", HEAVY_CASES)
def test_adam8bit_follows_adamw_at_least_as_closely_as_bitsandbytes(case):
    """bench.heavy_tailed's 200 steps, row scales exp(2.3·N(0,1)). Where a block of 256 mixes rows ("short rows",
    "values", as SLTrain's S does), v spans decades that √v halves: ours must end at most half as far from float32
    AdamW. Where each block is one row ("long rows"), v's finer steps win a little: ours within 1.25x."""
    _, _, ours = heavy_tailed(case)
    _, _, theirs = heavy_tailed(case, make=lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3))
    print(f"{case}: ||p8 - p32|| / ||p32 - p0|| ours {ours:.4f}, bitsandbytes {theirs:.4f}")
    assert ours <= (1.25 if case == "long rows" else 0.5) * theirs


def test_bench_heavy_puts_bitsandbytes_beside_ours(capsys):
    """python bench.py --only heavy: where bitsandbytes is installed, its figures in each case's row."""
    r = bench_heavy(steps=5)
    assert r["bitsandbytes"] == bnb.__version__
    for case in HEAVY_CASES:
        v = r["cases"][case]
        assert v["bnb_distance"] > 0 and v["bnb_adam8bit"] > 0 and v["bnb_distance"] != v["distance"]
    report_heavy({"heavy": r})
    out = capsys.readouterr().out
    assert out.count("| bitsandbytes: ") == len(HEAVY_CASES) and f"bitsandbytes {bnb.__version__}'s Adam8bit" in out


def test_bench_step_times_bitsandbytes_beside_ours():
    """python bench.py --only step: where bitsandbytes is installed, its Adam8bit's step is a row of the table."""
    r = bench_step(size=256, steps=2, warmup=1, rounds=1)
    assert r["variants"]["bitsandbytes Adam8bit"]["ms"] > 0 and r["variants"]["bitsandbytes Adam8bit"]["ratio"] > 0
