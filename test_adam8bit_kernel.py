"""
The one-kernel 8-bit Adam step (adam8bit_kernel.py) against the eager step it replaces on a GPU.

No test needs a GPU. Where Triton is installed (torch's CUDA builds bring it; CI's CPU build does not, and those
tests skip there), the kernel runs under Triton's interpreter, which executes the same kernel with numpy on the CPU,
and is compiled for Hopper (sm_90) and Ampere (sm_80) to machine code, which needs no GPU either: the code a GPU
would run is built, and the arithmetic is checked. The refusals run everywhere.

    python -m pytest -q test_adam8bit_kernel.py
"""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adam8bit_kernel
import optim
from galore import GaLore

needs_triton = pytest.mark.skipif(not adam8bit_kernel.available(), reason="Triton is not installed (a CPU torch)")


def interpreted(check):
    """Runs check(adam8bit_kernel) in a fresh Python under Triton's interpreter, which must be chosen before Triton
    is imported (its own library functions are decorated then); fails with the child's output if it fails. The
    interpreter is slow: the suite's sections take about 4 minutes there (2 cores, torch 2.11's Triton 3.6)."""
    code = f"import adam8bit_kernel, test_adam8bit_kernel as t; t.{check.__name__}(adam8bit_kernel)"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]


def state(n, block_size, device="cpu"):
    blocks = -(-n // block_size)
    return [[torch.zeros(blocks * block_size, dtype=torch.uint8, device=device), torch.zeros(blocks, device=device)]
            for _ in range(2)]


def gradients(n, dtype, steps, zero_block):
    """Heavy-tailed gradients (magnitudes 1e-5 to 10 in one block), a NaN and infinities, one block all zeros."""
    torch.manual_seed(0)
    for _ in range(steps):
        g = torch.randn(n) * 10.0 ** torch.randint(-5, 2, (n,)).float()
        g[3], g[5], g[7] = float("nan"), float("inf"), -float("inf")
        g[zero_block] = 0
        yield g.to(dtype)


CASES = [(dtype, *case) for dtype in (torch.float32, torch.bfloat16)
         for case in ((3000, 256, 0.9, 0.1), (1000, 64, 0.3, 0.0), (256, 256, 0.9, 0.0))]


def said(case, step):
    """assert_close's message: the case and step, then torch's own (how many entries differ, the greatest
    difference and where), which a message given as a string replaces."""
    return lambda torchs: f"{case}: step {step}\n{torchs}"


def same_updates_as_eager(kernel, device="cpu", cases=CASES, exact=None):
    """Five steps of each, state carried: a bf16 parameter to the bit (the kernel writes out torch's rounding of
    it, after the decay and after the step); a float32 one to float32 rounding (the eager CPU kernels fuse some
    multiply-adds that numpy does not); the codes the same but for the odd value on a rounding edge, the absmax to
    float32 rounding. beta1 0.3 takes torch's other lerp formula; n = 1000 pads its last block; no decay skips it.

    On a GPU the eager step's CUDA kernels and the compiled kernel each fuse multiply-adds of their own, so an odd
    √v lands on the other side of a code's edge (232 of a million entries in a step on an H200), and from there the
    two runs' states differ by more than a code (the next step's absmax and codes are taken from another √v). So
    there each step starts from the eager step's state, and is held to the step's own tolerance: a code, or a bf16
    parameter, one step off at at most 1% of the entries (on the H200: 0.02 to 0.1%). carried_updates_stay_close
    checks the runs carried. (exact: whether to carry the state and ask for the bf16 bits; by default on CPU, where
    the interpreter runs the kernel.)"""
    device = torch.device(device)
    exact = device.type == "cpu" if exact is None else exact
    edges = lambda n: max(1, n // (1000 if exact else 100))  # noqa: E731 (entries allowed on a rounding edge)
    tables = optim._lookup_tables(True, device), optim._lookup_tables(False, device)
    for dtype, n, block_size, beta1, weight_decay in cases:
        case = f"{dtype}, n {n}, block {block_size}, beta1 {beta1}, decay {weight_decay}"
        eager_p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, dtype)  # whatever ran before
        kernel_p, eager, fused = eager_p.clone(), state(n, block_size, device), state(n, block_size, device)
        for step, g in enumerate(gradients(n, dtype, 5, slice(block_size, 2 * block_size)), start=1):
            g = g.to(device)
            hyper = optim._step_scalars(1e-2, beta1, 0.999, 1e-8, weight_decay, step)
            if not exact:  # this step from the eager step's state (docstring)
                kernel_p.copy_(eager_p)
                for ours, theirs in zip(fused, eager):
                    [t.copy_(e) for t, e in zip(ours, theirs)]
            optim._adam8bit_(eager_p, g, *eager, tables, block_size, hyper)
            kernel.adam8bit_(kernel_p, g, *fused, tables, block_size, hyper)
            if dtype == torch.bfloat16 and exact:
                assert torch.equal(kernel_p, eager_p), f"{case}: step {step}"
            elif dtype == torch.bfloat16:
                assert (kernel_p != eager_p).sum() <= edges(n), f"{case}: step {step}"
                torch.testing.assert_close(kernel_p, eager_p, rtol=2 ** -7, atol=0, msg=said(case, step))
            else:
                torch.testing.assert_close(kernel_p, eager_p, rtol=3e-7, atol=1e-7, msg=said(case, step))
            for (codes, absmax), (eager_codes, eager_absmax) in zip(fused, eager):
                assert (codes != eager_codes).sum() <= edges(n), f"{case}: step {step}"
                assert ((codes.int() - eager_codes.int()).abs() <= 1).all(), f"{case}: step {step}"
                torch.testing.assert_close(absmax, eager_absmax, rtol=1e-6, atol=0, msg=said(case, step))
        if n > block_size:  # the block of zero gradients: its m and √v stay exactly 0
            for (codes, absmax), signed in zip(fused, (True, False)):
                values = optim.dequantize_blockwise(codes, absmax, signed, n)
                assert (values[block_size:2 * block_size] == 0).all() and (values[:block_size] != 0).any(), case
        assert torch.isfinite(kernel_p.float()).all(), case


def carried_updates_stay_close(kernel, device, cases, steps=5, lr=1e-2):
    """The kernel's run and the eager step's, each carrying its own state for `steps` steps (on a GPU, where they
    part at rounding edges): at most one entry in a thousand is further apart than the dtype's rounding of its value
    or of a step (a bf16 step; 1e-5 of a float32 one), none by more than 2·lr a step (an Adam step moves an entry by
    about lr, never much more), and the moments they carry agree to 1% in norm."""
    device = torch.device(device)
    tables = optim._lookup_tables(True, device), optim._lookup_tables(False, device)
    for dtype, n, block_size, beta1, weight_decay in cases:
        case = f"{dtype}, n {n}, block {block_size}, beta1 {beta1}, decay {weight_decay}"
        eager_p = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, dtype)  # whatever ran before
        kernel_p, eager, fused = eager_p.clone(), state(n, block_size, device), state(n, block_size, device)
        for step, g in enumerate(gradients(n, dtype, steps, slice(block_size, 2 * block_size)), start=1):
            hyper = optim._step_scalars(lr, beta1, 0.999, 1e-8, weight_decay, step)
            optim._adam8bit_(eager_p, g.to(device), *eager, tables, block_size, hyper)
            kernel.adam8bit_(kernel_p, g.to(device), *fused, tables, block_size, hyper)
        ours, theirs = kernel_p.float(), eager_p.float()
        rounding = (theirs.abs() + lr) * (2 ** -7 if dtype == torch.bfloat16 else 1e-5)  # of the value or the step
        assert ((ours - theirs).abs() > rounding).sum() <= max(1, n // 1000), case
        assert (ours - theirs).abs().max() <= 2 * lr * steps, case
        for (codes, absmax), (eager_codes, eager_absmax), signed in zip(fused, eager, (True, False)):
            a, b = (optim.dequantize_blockwise(c, scale, signed, n)
                    for c, scale in ((codes, absmax), (eager_codes, eager_absmax)))
            assert (a - b).norm() <= 0.01 * b.norm(), case


class RoundedOtherwise:
    """A stand-in for the kernel as a GPU runs it: the eager step on a gradient one float32 rounding away, entry by
    entry (as a multiply-add fused otherwise leaves its results)."""

    @staticmethod
    def adam8bit_(param, grad, *rest):
        ulps = torch.randint(-1, 2, grad.shape, generator=torch.Generator().manual_seed(grad.numel()))
        optim._adam8bit_(param, grad.float() * (1 + ulps * 2.0 ** -23), *rest)


class StepTooLong:
    """A wrong kernel: its steps 10% too long."""

    @staticmethod
    def adam8bit_(param, grad, m, v, tables, block_size, hyper):
        optim._adam8bit_(param, grad, m, v, tables, block_size, (1.1 * hyper[0], *hyper[1:]))


def test_the_gpu_checks_pass_a_step_rounded_otherwise_and_fail_a_wrong_one():
    """The checks the GPU test makes, tried on CPU: a step whose float32 roundings differ passes them, step by step
    and carried; one whose steps are 10% too long fails each."""
    same_updates_as_eager(RoundedOtherwise, cases=CASES, exact=False)
    carried_updates_stay_close(RoundedOtherwise, "cpu", CASES)
    with pytest.raises(AssertionError):
        same_updates_as_eager(StepTooLong, cases=CASES, exact=False)
    with pytest.raises(AssertionError):
        carried_updates_stay_close(StepTooLong, "cpu", CASES)


def optimizers_take_it_where_it_can_run(kernel):
    """Adam8bit (fused=None) and GaLore over it call the kernel for each 8-bit tensor where it can run (here: told
    it can, on CPU), and train as the eager step does; fused=False never calls it."""
    calls, launch = [], kernel.adam8bit_
    kernel.why_not = lambda device, dtype, block_size: None
    kernel.adam8bit_ = lambda *a: calls.append(a[0].numel()) or launch(*a)
    torch.manual_seed(0)
    x, y = torch.randn(8, 96), torch.randn(8, 64)
    start = [torch.randn(80, 96) * 0.1, torch.randn(80) * 0.1, torch.randn(64, 80) * 0.1]  # 7680, 5120: 8-bit
    results = {}
    for name, make in {"fused": lambda ps: optim.Adam8bit(ps, lr=1e-2, weight_decay=0.1),
                       "eager": lambda ps: optim.Adam8bit(ps, lr=1e-2, weight_decay=0.1, fused=False),
                       "galore fused": lambda ps: GaLore([dict(params=ps, rank=None)], lr=1e-2, inner="adam8bit"),
                       "galore eager": lambda ps: GaLore([dict(params=ps, rank=None)], lr=1e-2, inner="adam8bit",
                                                         fused=False)}.items():
        trained = [p.clone().requires_grad_() for p in start]
        opt, before = make(trained), len(calls)
        for _ in range(3):
            loss = ((F.linear(F.linear(x, trained[0], trained[1]), trained[2]) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        results[name] = (trained, calls[before:])
    assert results["fused"][1] == [7680, 5120] * 3 and results["galore fused"][1] == [7680, 5120] * 3
    assert results["eager"][1] == [] and results["galore eager"][1] == []
    for a, b in (("fused", "eager"), ("galore fused", "galore eager")):
        for p, q in zip(results[a][0], results[b][0]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def a_run_of_tensors_takes_one_launch(kernel):
    """Adam8bit laying consecutive tensors end to end (optim.KERNEL_RUN; off CPU, forced here) launches the kernel
    once for them, and updates each as its own launch would, to the bit (bf16) and in the state."""
    calls, launch = [], kernel.adam8bit_
    kernel.why_not = lambda device, dtype, block_size: None
    kernel.adam8bit_ = lambda *a: calls.append(a[0].numel()) or launch(*a)
    optim.CHUNKED_DEVICES.discard("cpu")
    torch.manual_seed(0)
    start = [torch.randn(shape).bfloat16() for shape in ((96, 80), (300,), (64, 96), (4096,))]
    results = {}
    for limit in (optim.KERNEL_RUN, 0):
        optim.KERNEL_RUN, before = limit, len(calls)
        params = [nn.Parameter(p.clone()) for p in start]
        opt = optim.Adam8bit(params, lr=1e-2, weight_decay=0.1, min_8bit_size=256)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step + p.numel())).bfloat16()
            opt.step()
        results[limit] = params, opt.state_dict(), calls[before:]
    (together, state, launches), (alone, state_alone, launches_alone) = results.values()
    assert launches_alone == [7680, 300, 6144, 4096] * 3
    assert launches == [7680 + 512 + 6144 + 4096] * 3  # each tensor padded to whole blocks of 256
    assert all(torch.equal(p, q) for p, q in zip(together, alone))
    for a, b in zip(state["state"].values(), state_alone["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k])), a.keys()


@needs_triton
def test_a_run_of_tensors_takes_one_launch():
    interpreted(a_run_of_tensors_takes_one_launch)


def the_suite_times_it_beside_the_steps_it_replaces(kernel):
    """Where the kernel can run (here: told it can, on CPU), the suite's optimizer section times it beside the eager
    and compiled steps, the model section adds 8-bit per-layer rows without it, and the host-time bench has a row."""
    import bench
    import suite
    kernel.why_not = lambda device, dtype, block_size: None
    suite.per_layer_host_time = lambda device, size, method: {}  # timed alone below, at a size of two blocks
    tiny, cpu = suite.SUITES["tiny"], torch.device("cpu")
    steps = suite.suite_optimizer(tiny, cpu, torch.float32)["variants"]
    assert list(steps) == ["torch.optim.AdamW", "optim.Adam8bit", "optim.Adam8bit(compile=True)",
                           "optim.Adam8bit(fused=True)"] + [f"optim.Adam8bit(fused=True), ROWS={rows}"
                                                            for rows in suite.KERNEL_ROWS]
    assert all(row["ms"] > 0 for row in steps.values())
    rows = suite.suite_model(tiny, cpu, torch.float32, False)["variants"]
    # the tiny suite's 12 (test_suite.py: test_tiny_suite_runs_every_section_and_reports) and three of the kernel's
    assert {"full/adam8bit/per_layer/unfused", "sltrain/adam8bit/per_layer/unfused",
            "sltrain/adam8bit/per_layer/launch_per_tensor"} < set(rows) and len(rows) == 15, list(rows)
    assert "Adam8bit(fused=True)" in bench.per_layer_host_time("cpu", "tiny", "sltrain", rounds=1)


@needs_triton
def test_the_suite_times_it_beside_the_steps_it_replaces():
    interpreted(the_suite_times_it_beside_the_steps_it_replaces)


needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and adam8bit_kernel.available()),
                               reason="needs a CUDA GPU with Triton (run it there: python -m pytest -q "
                                      "test_adam8bit_kernel.py)")


@needs_gpu
def test_on_a_gpu_the_kernel_makes_the_eager_steps_update():
    """The kernel as compiled for this GPU against the eager step on it, the interpreter's cases and a tensor of a
    million entries (thousands of programs; its last block padded)."""
    assert adam8bit_kernel.usable(torch.zeros(1, device="cuda"), 256), "a GPU older than compute capability 8.0"
    big = [(torch.bfloat16, 1_000_003, 256, 0.9, 0.1), (torch.float32, 1_000_003, 256, 0.9, 0.1)]
    same_updates_as_eager(adam8bit_kernel, "cuda", CASES + big)
    carried_updates_stay_close(adam8bit_kernel, "cuda", CASES + big)
    import suite
    default = adam8bit_kernel.ROWS
    try:  # each number of blocks per program the suite times
        for rows in suite.KERNEL_ROWS:
            adam8bit_kernel.ROWS = rows
            same_updates_as_eager(adam8bit_kernel, "cuda", [(torch.bfloat16, 1_000_003, 256, 0.9, 0.1)])
    finally:
        adam8bit_kernel.ROWS = default


@needs_gpu
def test_on_a_gpu_adam8bit_takes_the_kernel_by_default():
    calls, launch = [], adam8bit_kernel.adam8bit_
    p = nn.Parameter(torch.randn(96, 64, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    try:
        adam8bit_kernel.adam8bit_ = lambda *a: calls.append(a[0].numel()) or launch(*a)
        optim.Adam8bit([p]).step()
        optim.Adam8bit([p], fused=False).step()
    finally:
        adam8bit_kernel.adam8bit_ = launch
    assert calls == [6144]


@needs_triton
def test_the_kernel_makes_the_eager_steps_update():
    interpreted(same_updates_as_eager)


def same_updates_at_every_rows(kernel):
    """The same at each number of blocks per program that the suite times (suite.KERNEL_ROWS): a program's last rows
    past the state's end are masked, whatever their number."""
    import suite
    for rows in suite.KERNEL_ROWS:
        kernel.ROWS = rows
        same_updates_as_eager(kernel, cases=[case for case in CASES if case[1] == 3000])


@needs_triton
def test_the_kernel_makes_the_eager_steps_update_at_every_rows():
    interpreted(same_updates_at_every_rows)


def same_updates_with_scalars_on_device(kernel):
    """The step size, decay and bias correction given as 0-dim tensors (where a CUDA graph's replays read each
    update's) and as numbers: the same parameter and state, to the bit, with a changing lr and step."""
    tables = optim._lookup_tables(True, "cpu"), optim._lookup_tables(False, "cpu")
    for dtype, n, block_size, beta1, weight_decay in CASES:
        numbers_p = torch.randn(n).to(dtype)
        tensors_p, numbers, tensors = numbers_p.clone(), state(n, block_size), state(n, block_size)
        for step, g in enumerate(gradients(n, dtype, 3, slice(block_size, 2 * block_size)), start=1):
            hyper = optim._step_scalars(1e-2 / step, beta1, 0.999, 1e-8, weight_decay, step)
            on_device = tuple(torch.tensor(x) if i in (0, 5, 6) and x is not None else x for i, x in enumerate(hyper))
            kernel.adam8bit_(numbers_p, g, *numbers, tables, block_size, hyper)
            kernel.adam8bit_(tensors_p, g, *tensors, tables, block_size, on_device)
            assert torch.equal(tensors_p, numbers_p), (dtype, n, step)
            assert all(torch.equal(a, b) for x, y in zip(tensors, numbers) for a, b in zip(x, y)), (dtype, n, step)


@needs_triton
def test_the_kernel_reads_the_scalars_from_the_device_as_it_takes_numbers():
    interpreted(same_updates_with_scalars_on_device)


@needs_triton
def test_adam8bit_and_galore_take_the_kernel_where_it_can_run():
    interpreted(optimizers_take_it_where_it_can_run)


@needs_triton
@pytest.mark.parametrize("on_device", [False, True], ids=["numbers", "on_device"])
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("param", ["*bf16", "*fp32"])
def test_the_kernel_compiles_to_gpu_machine_code(arch, param, on_device):
    """The kernel built for a GPU as it would be at its first call there (Triton's compiler down to a cubin, with
    ptxas), and with the arithmetic it is meant to have: IEEE division and square root, not the approximate ones.
    on_device: the step size, decay and bias correction read through pointers, as under a CUDA graph."""
    import triton
    from triton.backends.compiler import GPUTarget
    pointers = dict(param_ptr=param, grad_ptr=param, m_codes_ptr="*u8", m_absmax_ptr="*fp32", v_codes_ptr="*u8",
                    v_absmax_ptr="*fp32", m_map_ptr="*fp32", m_first_ptr="*u8", m_threshold_ptr="*fp32",
                    v_map_ptr="*fp32", v_first_ptr="*u8", v_threshold_ptr="*fp32")
    varying = "*fp32" if on_device else "fp32"
    scalars = dict(n="i32", blocks="i32", step_size=varying, one_minus_beta1="fp32", beta2="fp32",
                   one_minus_beta2="fp32", eps="fp32", decay=varying, sqrt_bias_correction2=varying)
    constants = dict(HAS_DECAY=True, BF16=param == "*bf16", BLOCK=256, ROWS=adam8bit_kernel.ROWS,
                     ON_DEVICE=on_device)
    source = triton.compiler.ASTSource(fn=adam8bit_kernel._adam8bit_kernel, constexprs=constants,
                                       signature={**pointers, **scalars, **{k: "constexpr" for k in constants}})
    built = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    ptx = built.asm["ptx"]
    assert len(built.asm["cubin"]) > 0
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
    assert "div.full.f32" not in ptx and "sqrt.approx" not in ptx


def test_fused_true_is_refused_where_the_kernel_cannot_run():
    """On a CPU (or without Triton, or at a block size that is not a power of two) fused=True is one line that names
    the way out; fused=None there takes the eager step without a word."""
    p = nn.Parameter(torch.randn(64, 96))
    for make in (lambda: optim.Adam8bit([p], fused=True), lambda: optim.Adam8bit([p], fused=True, block_size=100),
                 lambda: GaLore([dict(params=[p], rank=None)], inner="adam8bit", fused=True)):
        with pytest.raises(ValueError, match="fused=True: the one-kernel 8-bit step cannot run here: "
                                             "it runs on a CUDA GPU, not on cpu; "
                                             "pass fused=None to use it only where it can run"):
            make()
    with pytest.raises(ValueError, match="fused must be None"):
        optim.Adam8bit([p], fused="yes")
    with pytest.raises(ValueError, match="inner='adamw' has none: pass inner='adam8bit'"):  # asked, not ignored
        GaLore([dict(params=[p], rank=None)], inner="adamw", fused=True)
    opt = optim.Adam8bit([p], fused=None)
    p.grad = torch.randn_like(p)
    opt.step()
    assert "exp_avg_codes" in opt.state[p]
    optim.Adam8bit([nn.Parameter(torch.randn(8))], fused=True)  # below min_8bit_size: nothing needs the kernel


def test_fused_true_is_refused_for_a_group_added_later():
    """A param group added after the constructor is held to fused=True as the constructor's are: refused, in the
    same line, where its 8-bit tensors cannot run the kernel (it took the eager step without a word), and not left
    half added; a group with nothing 8-bit is taken."""
    for make in (lambda ps: optim.Adam8bit(ps, fused=True),
                 lambda ps: GaLore([dict(params=ps, rank=None)], inner="adam8bit", fused=True)):
        opt = make([nn.Parameter(torch.randn(8))])  # below min_8bit_size: nothing needs the kernel
        with pytest.raises(ValueError, match="fused=True: the one-kernel 8-bit step cannot run here: "
                                             "it runs on a CUDA GPU, not on cpu"):
            opt.add_param_group(dict(params=[nn.Parameter(torch.randn(64, 96))]))
        assert len(opt.param_groups) == 1
        opt.add_param_group(dict(params=[nn.Parameter(torch.randn(8))]))
        assert len(opt.param_groups) == 2


def test_the_launch_is_made_on_the_parameters_gpu(monkeypatch):
    """Triton launches on the current GPU: a parameter on cuda:1 while cuda:0 is current is updated with cuda:1 made
    current for the launch (faked here: this test runs without a GPU); on the current GPU nothing is switched."""
    switched = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: switched.append(device) or contextlib.nullcontext())

    class OnGPU:
        def __init__(self, index):
            self.device = torch.device("cuda", index)
    with adam8bit_kernel.on_its_device(OnGPU(1)):
        pass
    with adam8bit_kernel.on_its_device(OnGPU(0)), adam8bit_kernel.on_its_device(torch.zeros(1)):
        pass
    assert switched == [torch.device("cuda", 1)]


def test_the_kernel_is_taken_on_the_gpus_it_is_built_for(monkeypatch):
    """On CUDA with Triton: Ampere (8.0) and later, float32 or bf16, a power-of-two block; an older GPU, float16 or
    a block of 100 take the eager step (faked GPUs: this test runs without one)."""
    monkeypatch.setattr(adam8bit_kernel, "available", lambda: True)
    monkeypatch.setattr(adam8bit_kernel, "_capability", lambda device: {0: (9, 0), 1: (7, 5)}[device.index])

    class OnGPU:
        def __init__(self, index, dtype=torch.bfloat16):
            self.device, self.dtype = torch.device("cuda", index), dtype
    assert adam8bit_kernel.usable(OnGPU(0), 256) and adam8bit_kernel.usable(OnGPU(0, torch.float32), 64)
    assert not adam8bit_kernel.usable(OnGPU(1), 256)  # a T4's sm_75
    assert not adam8bit_kernel.usable(OnGPU(0, torch.float16), 256) and not adam8bit_kernel.usable(OnGPU(0), 100)
    assert not adam8bit_kernel.usable(torch.zeros(1), 256)  # a CPU tensor
    # and what is missing, in words (train.py's --adam8bit_kernel on and fused=True say it)
    assert adam8bit_kernel.why_not("cuda:0", torch.bfloat16, 256) is None
    assert "8.0 or later; cuda:1 has 7.5" in adam8bit_kernel.why_not("cuda:1", torch.bfloat16, 256)
    assert "float32 or bfloat16 parameters, not torch.float16" in adam8bit_kernel.why_not("cuda:0", torch.float16, 256)
    for block in (100, 8, 16384):
        assert f"power of two from 16 to 8192, not {block}" in adam8bit_kernel.why_not("cuda:0", torch.float32, block)
    assert "not on cpu" in adam8bit_kernel.why_not("cpu", torch.float32, 256)
    monkeypatch.setattr(adam8bit_kernel, "available", lambda: False)
    assert "Triton is not installed" in adam8bit_kernel.why_not("cuda:0", torch.float32, 256)


@pytest.mark.parametrize("change", ["dtype", "block_size"])
def test_fused_true_is_held_at_the_step_too(monkeypatch, change):
    """fused=True is checked when the parameters are given; a parameter moved since (model.double(), .to(...)), or a
    state loaded with a block size the kernel does not take, took the eager step without a word. Refused at the
    step, before any tensor moves, in the same line. Here the kernel 'runs' on CPU for float32 (the eager
    arithmetic, counted)."""
    calls = []
    monkeypatch.setattr(adam8bit_kernel, "why_not", lambda device, dtype, block_size: None if dtype == torch.float32
                        and block_size == 256 else f"not {dtype} in blocks of {block_size}")
    monkeypatch.setattr(adam8bit_kernel, "adam8bit_", lambda *a: calls.append(a[0].numel()) or optim._adam8bit_(*a))
    for make in (lambda ps: optim.Adam8bit(ps, lr=1e-2, fused=True),
                 lambda ps: GaLore([dict(params=ps, rank=None)], lr=1e-2, inner="adam8bit", fused=True)):
        model, before = nn.Sequential(nn.LayerNorm(96), nn.Linear(96, 64)), len(calls)
        opt = make(model.parameters())
        model(torch.randn(4, 96)).sum().backward()
        opt.step()
        assert calls[before:] == [64 * 96], calls[before:]
        if change == "dtype":
            model.double()
            expected = r"for a \(64, 96\) float64 parameter on cpu, as it is now: not torch.float64 in blocks of 256"
        else:
            saved = opt.state_dict()
            for group in saved["param_groups"]:
                group["block_size"] = 128
            saved["state"] = {}  # a fresh state of block size 128: the eight-bit tensor will be taken at the step
            opt.load_state_dict(saved)
            expected = r"for a \(64, 96\) float32 parameter on cpu, as it is now: not torch.float32 in blocks of 128"
        model.zero_grad()
        model(torch.randn(4, 96, dtype=next(model.parameters()).dtype)).sum().backward()
        kept, steps = [p.detach().clone() for p in model.parameters()], [s["step"] for s in opt.state.values()]
        with pytest.raises(ValueError, match=rf"^fused=True: the one-kernel 8-bit step cannot run here {expected}; "
                                             "pass fused=None to use it only where it can run$"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept)), "a refused step moved a parameter"
        assert [s["step"] for s in opt.state.values()] == steps, "a refused step counted"
