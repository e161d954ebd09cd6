"""
hostsync.HostSyncs counts what makes the host wait for the device, and nothing else.

    python -m pytest -q test_hostsync.py
"""

import warnings

import pytest
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
        torch.allclose(t, t)  # a bool for the host
    assert syncs.counts["aten::_local_scalar_dense"] == 2 and syncs.counts["aten::index.Tensor"] == 1, syncs.counts
    assert syncs.counts["aten::nonzero"] == 1 and syncs.counts["aten::allclose"] == 1 and len(syncs.counts) == 4
    assert syncs.blocks == 1


def test_repeat_interleave_counts_only_when_its_size_is_not_given():
    """Its output's size is the sum of its counts, which the host must read, unless the caller gives it (as
    sllinear.support_positions does, unpacking a packed support)."""
    counts = torch.tensor([2, 0, 3])
    syncs = HostSyncs()
    with syncs.watch():
        torch.repeat_interleave(counts, output_size=5)
    assert syncs.summary() == "none"
    with syncs.watch():
        torch.repeat_interleave(counts)
    assert syncs.counts == {"aten::repeat_interleave.Tensor": 1}, syncs.counts


def test_bincount_is_counted_whatever_its_minlength():
    """bincount's output has its largest entry + 1 bins (minlength if more): on a GPU the host reads that entry
    first, with minlength given too. A CPU run standing in for a GPU one missed it."""
    syncs = HostSyncs()
    with syncs.watch():
        torch.bincount(torch.tensor([0, 3, 3]))
        torch.bincount(torch.tensor([0, 3, 3]), minlength=8)
    assert syncs.counts == {"aten::bincount": 2}, syncs.counts


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


def test_other_warnings_pass_through_when_the_block_raises():
    """A watched update that raises (out of memory) lost every other warning it had raised: caught for the count,
    they were passed on only after a block that ended normally, and one of them may say why it failed."""
    syncs = HostSyncs()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        with pytest.raises(RuntimeError, match="simulated"):
            with syncs.watch():
                warnings.warn("the hint before the failure", UserWarning)
                raise RuntimeError("out of memory (simulated)")
    assert [str(w.message) for w in seen] == ["the hint before the failure"]


def mark_pinning(monkeypatch):
    """Pinning needs a GPU: on a CPU, tensor.pin_memory() returns a copy marked as pinned instead."""
    pinned = set()

    def pin(t):
        t = t.clone()
        pinned.add(id(t))
        return t
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: id(t) in pinned)


def test_copies_from_pageable_host_memory_to_a_device_are_counted(monkeypatch):
    """CUDA may wait for the stream before it stages a copy from pageable memory (meta stands in for the device
    here). Pinned memory, device-side fills and host-side conversions are not counted."""
    mark_pinning(monkeypatch)
    host, device = torch.ones(4), torch.device("meta")
    syncs = HostSyncs()
    with syncs.watch():
        host.to(device, non_blocking=True)
        torch.empty(4, device=device).copy_(host)
        host.pin_memory().to(device, non_blocking=True)
        torch.full((), 3.0, device=device)
        host.to(torch.float64)  # on the host
        torch.empty(4, device=device).to(device, torch.float64)
    assert syncs.counts == {"aten::_to_copy from pageable memory": 1, "aten::copy_ from pageable memory": 1}, \
        syncs.counts


def test_on_a_device_a_value_the_host_holds_is_not_a_sync():
    """With the loop's device given (meta stands in for a GPU), .item() of a host tensor waits for nothing and is
    left out; of a device tensor it is counted. Without a device every read counts (a CPU run standing in)."""
    host, device = torch.tensor(3.0), torch.ones((), device="meta")
    syncs = HostSyncs(device="meta")
    with syncs.watch():
        host.item()
        torch.equal(host, host)
    read = torch.ops.aten._local_scalar_dense.default
    with pytest.raises(Exception):  # counted first; a meta tensor then has no value to give
        syncs.__torch_dispatch__(read, (torch.Tensor,), (device,))
    assert syncs.counts == {"aten::_local_scalar_dense": 1}, syncs.counts
    syncs = HostSyncs()
    with syncs.watch():
        host.item()
    assert syncs.counts == {"aten::_local_scalar_dense": 1}, syncs.counts


def test_on_a_device_a_boolean_mask_of_host_tensors_is_not_a_sync():
    """As for a value read: with the loop's device given, indexing host tensors by a host mask waits for nothing
    and is left out (it was counted, where their nonzero() was not); a device tensor's mask is counted."""
    host, device = torch.arange(4.0), torch.ones(4, device="meta")
    syncs = HostSyncs(device="meta")
    with syncs.watch():
        host[host > 1]
        host[host > 1] = 0.0
        (host > 1).nonzero()
        with pytest.raises(Exception):  # counted first; a meta tensor then has no values to count the mask's True of
            device[device > 0]
    assert syncs.counts == {"aten::index.Tensor": 1}, syncs.counts


def test_only_cudas_sync_warning_counts_not_its_note_on_being_switched_on():
    # seen on an H200: the note that torch's sync-debug mode gives when set to "warn" was counted as a sync
    syncs = HostSyncs()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        with syncs.watch():
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations", UserWarning)
            warnings.warn("called a synchronizing CUDA operation (function cudaStreamSynchronize)", UserWarning)
    assert syncs.summary() == "cuda: called a synchronizing CUDA operation (function cudaStreamSynchronize) x1"
    assert [str(w.message)[:40] for w in seen] == ["Synchronization debug mode is a prototyp"]


def test_a_non_blocking_copy_into_pinned_host_memory_is_not_counted(monkeypatch):
    """A non-blocking copy from the device into pinned memory is queued and the host goes on (torch pins the output
    of a non-blocking .to("cpu") itself; CUDA's sync-debug mode is silent on it): not a sync. Blocking, or into
    pageable memory (CUDA returns once that copy is done), the host waits: counted. meta stands in for the device;
    its tensors have no data, so each copy raises once the check has seen it."""
    mark_pinning(monkeypatch)
    device = torch.ones(4, device="meta")
    waits = [lambda: device.to("cpu"), lambda: torch.ones(4).copy_(device, non_blocking=True),
             lambda: torch.ones(4).pin_memory().copy_(device)]
    queued = [lambda: device.to("cpu", non_blocking=True),
              lambda: torch.ones(4).pin_memory().copy_(device, non_blocking=True)]
    syncs = HostSyncs()
    with syncs.watch():
        for copy in waits + queued:
            with pytest.raises(NotImplementedError, match="meta"):
                copy()
    assert syncs.counts == {"aten::_to_copy": 1, "aten::copy_": 2}, syncs.counts


def test_a_cpu_run_standing_in_counts_the_copies_to_the_host_that_dispatch_no_op():
    """.tolist() and .cpu() of a GPU tensor copy it to the host and wait; of a CPU tensor they dispatch no op, and a
    CPU run standing in for a GPU one missed them. Not .to(), whose device a loop takes from its tensors (the CPU, on
    a CPU: clip_grad_norm_'s), nor .numpy(); and not where the loop's device is given: a host tensor's are free."""
    t = torch.arange(4.0)
    syncs = HostSyncs()
    with syncs.watch():
        t.tolist()
        t.cpu()
        t.to(t.device)
        t.numpy()  # a host tensor's, on a GPU too
    assert syncs.counts == {"Tensor.tolist": 1, "Tensor.cpu": 1}, syncs.counts
    syncs = HostSyncs(device="meta")
    with syncs.watch():
        t.tolist()
        t.cpu()
    assert syncs.summary() == "none"


def test_a_boolean_mask_filled_with_a_number_is_not_a_sync():
    """t[mask] = 0.0 is a masked_fill_ to torch (one mask on t's device, one value on the host, nothing accumulated):
    no count of True, no sync on a GPU, where it was counted. A value that is a tensor of the loop's, or an update
    that accumulates, still reads the mask's count of True. meta stands in for the device with its device given."""
    t = torch.arange(4.0)
    syncs = HostSyncs()
    with syncs.watch():
        t[t > 1] = 0.0
        t[t > 0] = torch.ones(())  # a tensor of the loop's, made on its device
        t.index_put_((t > 0,), torch.tensor(2.0), accumulate=True)
    assert syncs.counts == {"aten::index_put_": 2}, syncs.counts
    device = torch.ones(4, device="meta")
    syncs = HostSyncs(device="meta")
    with syncs.watch():
        device.index_put_((device > 0,), torch.tensor(0.0))  # as t[mask] = 0.0 makes it on a GPU
        device.index_put_((device > 0,), torch.ones((), device="meta"))
    assert syncs.counts == {"aten::index_put_": 1}, syncs.counts


def test_a_uint8_mask_is_counted_as_a_boolean_one():
    """torch still takes a uint8 tensor as an indexing mask (deprecated, with a warning): its count of True is read
    as a bool mask's is, and on a GPU waited for. It was not counted."""
    t, mask = torch.arange(4.0), torch.tensor([0, 1, 1, 0], dtype=torch.uint8)
    syncs = HostSyncs()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="indexing with dtype torch.uint8 is now deprecated")
        with syncs.watch():
            t[mask]
            t.index_put_((mask,), torch.ones(2))
    assert syncs.counts == {"aten::index.Tensor": 1, "aten::index_put_": 1}, syncs.counts


def test_a_cpu_run_standing_in_counts_printing_a_tensor():
    """Printing or formatting a GPU tensor copies it to the host and waits; torch formats with dispatch modes off,
    so a CPU run standing in for a GPU one missed it. A 0-dim tensor's format is its .item(), counted as that."""
    t = torch.arange(4.0)
    syncs = HostSyncs()
    with syncs.watch():
        str(t)
        repr(t)
        f"{t}"
        f"{t.sum():.2f}"
    assert syncs.counts == {"Tensor.__repr__": 2, "Tensor.__format__": 1, "aten::_local_scalar_dense": 1}, \
        syncs.counts
    syncs = HostSyncs(device="meta")
    with syncs.watch():
        str(t)
    assert syncs.summary() == "none"


def test_a_blocking_copy_from_pinned_memory_to_a_device_is_counted(monkeypatch):
    """Without non_blocking=True, torch waits for the stream after queueing a copy to the device, whatever the host
    memory (a cudaStreamSynchronize): pinned memory alone queues nothing. It was not counted; non-blocking it is
    not a sync. meta stands in for the device."""
    mark_pinning(monkeypatch)
    pinned, device = torch.ones(4).pin_memory(), torch.device("meta")
    syncs = HostSyncs()
    with syncs.watch():
        pinned.to(device)
        torch.empty(4, device=device).copy_(pinned)
        pinned.to(device, non_blocking=True)
        torch.empty(4, device=device).copy_(pinned, non_blocking=True)
    assert syncs.counts == {"aten::_to_copy to the device, blocking": 1, "aten::copy_ to the device, blocking": 1}, \
        syncs.counts


def test_histc_is_counted_when_it_takes_its_range_from_the_values():
    """torch.histc's default range, min = max (0 and 0), is the tensor's own min and max, which a GPU reads on the
    host first; it was not counted. With a range given, nothing is read."""
    t = torch.randn(16)
    syncs = HostSyncs()
    with syncs.watch():
        torch.histc(t, bins=4)
        torch.histc(t, 4, 1.0, 1.0)
        torch.histc(t, bins=4, min=-1.0, max=1.0)
    assert syncs.counts == {"aten::histc": 2}, syncs.counts
