"""
The device a command runs on, from its --device flag (train.py, sample.py, estimate_memory.py --measure, bench.py,
suite.py): a name this machine can use, or one line that names the fix before anything is loaded or built. And
how it computes: train.py --deterministic.

    device = device_from_flag(parser.error, args.device)     # torch.device("cpu"), ("cuda"), ("cuda", 1), ...
    set_deterministic(args.deterministic)                     # before the first GEMM
"""

import os

import torch

# cuBLAS's workspace settings under which torch takes its GEMMs as deterministic (one workspace per handle and
# stream, of a fixed size); 4096 KiB x 8 is Hopper's default size, so the memory a run needs stays the same
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def device_from_flag(error, name, expected="cpu, cuda or cuda:N"):
    """torch.device(name) if it is the CPU or a CUDA GPU this machine has; else error(one line), which exits.
    Plain "cuda" keeps no index (the caller picks one: the current GPU, or under torchrun the local rank's)."""
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device name
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        error(f"--device {name}: expected {expected}")
    if device.type == "cpu" and device.index is not None:  # torch takes cpu:1 and runs on the one CPU device
        error(f"--device {name}: the CPU has no index (torch.set_num_threads picks its cores); pass --device cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            error(f"--device {name}: this machine has no usable CUDA GPU; pass --device cpu")
        if device.index is not None and device.index >= count:
            error(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}; pass one of "
                  "those")
    return device


def cublas_refusal():
    """Why --deterministic cannot run in this environment (CUBLAS_WORKSPACE_CONFIG set to another value), or None."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None or config in CUBLAS_DETERMINISTIC:
        return None
    return (f"--deterministic: CUBLAS_WORKSPACE_CONFIG={config} leaves cuBLAS's GEMMs nondeterministic; unset it or "
            f"set it to {CUBLAS_DETERMINISTIC[0]}")


def set_deterministic(on):
    """--deterministic, for the whole process: torch's deterministic algorithms (a scatter or index_add on a GPU sorts
    its indices first; an operation that has no deterministic form refuses to run; torch.empty fills its memory, NaN
    for floats, so that a read of memory never written shows) and cuBLAS's fixed workspace, set in the environment
    before the first GEMM reads it. Off: torch's default, nondeterministic where that is faster."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC[0])
    torch.use_deterministic_algorithms(on)
