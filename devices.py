"""
The device a command runs on, from its --device flag (train.py, sample.py, estimate_memory.py --measure, bench.py,
suite.py): a name this machine can use, or one line that names the fix before anything is loaded or built.

    device = device_from_flag(parser.error, args.device)     # torch.device("cpu"), ("cuda"), ("cuda", 1), ...
"""

import torch


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
