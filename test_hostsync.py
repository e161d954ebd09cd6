"""
hostsync.HostSyncs counts what makes the host wait for the device, and nothing else.

    python -m pytest -q test_hostsync.py
"""

import warnings

import torch

from hostsync import HostSyncs


def test_value_reads_and_data_dependent_sizes_are_counted():
    t = torch.randn(100)
    syncs = HostSyncs()
    with syncs.watch():
        t.sum().item()
        if t.max() > 0:  # bool(tensor)
            pass
        t[t > 0]  # a boolean mask: the output size depends on the values
        t[torch.tensor([1, 2])]  # integer indices: no sync
        t.nonzero()
    assert syncs.counts["aten::_local_scalar_dense"] == 2 and syncs.counts["aten::index.Tensor"] == 1, syncs.counts
    assert syncs.counts["aten::nonzero"] == 1 and len(syncs.counts) == 3
    assert syncs.blocks == 1


def test_device_work_alone_is_none():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    syncs = HostSyncs()
    with syncs.watch():
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
    assert syncs.summary() == "none"
    with syncs.watch(ops=False):  # a compiled model: only CUDA's own check, which a CPU run does not have
        x.sum().item()
    assert syncs.summary() == "none" and syncs.blocks == 2


def test_other_warnings_pass_through_once_per_place():
    syncs = HostSyncs()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):  # one place, three updates: said once, as without the watch
            with syncs.watch():
                warnings.warn("not a sync", UserWarning)
    assert [str(w.message) for w in seen] == ["not a sync"] and syncs.summary() == "none"
