"""
Tests of devices.py through the commands that take --device, on a machine with one GPU (faked: they run without one).

    python -m pytest -q test_devices.py
"""

import re
import sys

import pytest
import torch

import bench
import estimate_memory
import sample
import suite
import train
from devices import device_from_flag


def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("command", ["train", "sample", "estimate_memory", "bench", "suite"])
def test_a_gpu_this_machine_lacks_is_one_line_in_every_command(monkeypatch, capsys, tmp_path, command):
    """cuda:1 where there is only cuda:0 is refused in one line that names the GPUs there are, before anything is
    loaded (sample.py is given a checkpoint that does not exist: loading it first would say so instead)."""
    one_gpu(monkeypatch)
    run = {"train": lambda: train.get_args(["--size", "60m", "--device", "cuda:1"]),
           "sample": lambda: sample.main([str(tmp_path / "missing.pt"), "--device", "cuda:1"]),
           "estimate_memory": lambda: (monkeypatch.setattr(sys, "argv", ["estimate_memory.py", "--measure",
                                                                          "--device", "cuda:1"]),
                                       estimate_memory.main()),
           "bench": lambda: (monkeypatch.setattr(sys, "argv", ["bench.py", "--device", "cuda:1"]), bench.main()),
           "suite": lambda: (monkeypatch.setattr(sys, "argv", ["suite.py", "tiny", "--device", "cuda:1"]),
                             suite.main())}
    with pytest.raises(SystemExit):
        run[command]()
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after argparse's usage lines
    assert last.endswith("--device cuda:1: this machine has 1 CUDA GPU(s), cuda:0 to cuda:0; pass one of those"), err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("name,gpus,expected", [
    ("cpu", 0, "cpu"), ("cuda", 1, "cuda"), ("cuda:0", 1, "cuda:0"), ("cuda:1", 2, "cuda:1"),
    ("cuda", 0, "no usable CUDA GPU; pass --device cpu"), ("cuda:0", 0, "no usable CUDA GPU; pass --device cpu"),
    ("cuda:2", 2, "this machine has 2 CUDA GPU(s), cuda:0 to cuda:1"),
    ("tpu", 1, "expected cpu, cuda or cuda:N"), ("cuda:x", 1, "expected cpu, cuda or cuda:N"),
    ("mps", 1, "expected cpu, cuda or cuda:N"), ("", 1, "expected cpu, cuda or cuda:N"),
    ("cpu:1", 0, "the CPU has no index"), ("cpu:0", 1, "the CPU has no index (torch.set_num_threads picks"),
])
def test_device_from_flag(monkeypatch, name, gpus, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    def error(message):
        raise SystemExit(message)
    if expected in ("cpu", "cuda", "cuda:0", "cuda:1"):  # a device, not a message
        assert device_from_flag(error, name) == torch.device(expected)
        return
    with pytest.raises(SystemExit, match=f"^--device {re.escape(name)}: .*{re.escape(expected)}"):
        device_from_flag(error, name)
