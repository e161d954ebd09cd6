"""
Find where a training loop makes the host wait for the device (train.py --sync_debug).

A GPU runs ahead of Python only while nothing asks for a value it has not computed yet. Reading a tensor's value
(.item(), float(t), `if t:`), copying it to the host (but with non_blocking=True into pinned memory, which is
queued), or an op whose output size depends on values (nonzero, boolean-mask indexing, unique) stalls the queue until
every kernel before it has finished. So does a copy to the device without non_blocking=True (torch waits for
it), and so may one from pageable (not pinned) host memory: CUDA may wait for the stream before it stages such a
copy (the CUDA documentation, "API synchronization behavior"), and torch's own sync check does not see that.
HostSyncs counts those ops, by name, while a block runs:

    syncs = HostSyncs()
    with syncs.watch():
        loss = model(x, y)[1]; loss.backward(); optimizer.step()      # model.LLaMA: (logits, loss)
    print(syncs.summary())      # "none" or "aten::_local_scalar_dense x3, ..."

It sees every op dispatched from Python, backward and optimizer hooks included, on any device (so the CPU tests can
check a loop that is meant for the GPU), and there a host tensor's .tolist(), .cpu() and printing, which copy a GPU
tensor to the host but dispatch no op on a CPU. On CUDA it also turns on torch's own sync-debug mode, which warns
from inside the CUDA calls, and counts those warnings. A torch.compile'd model hides its ops from the first check,
not from the second; so does printing or formatting a GPU tensor (torch formats with dispatch modes off). Given the
loop's device (HostSyncs(device)), value reads of tensors already on the host (torch.optim's step counters) are
left out off the CPU: nothing waits for the GPU there.
"""

import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result the host must see: a value (item, bool, int) or a data-dependent size (bincount's is its largest
# entry + 1, which a GPU reads even where minlength is given)
VALUE_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                   aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                   aten.repeat_interleave.Tensor, aten.bincount.default, aten.equal.default, aten.allclose.default}


# what CUDA's sync-debug mode warns with at each sync; not its note, on being switched on, that it is a prototype
# that "does not yet detect all synchronizing operations", which is passed on like any other warning
CUDA_SYNC = "called a synchronizing CUDA operation"

# indexing ops, which need the host when an index is a boolean mask (the output size is its count of True); torch
# still takes a uint8 index as one too (deprecated)
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
MASKS = (torch.bool, torch.uint8)


def _is_host(device):
    return device is not None and torch.device(device).type == "cpu"


def to_host(func, args, kwargs):
    """Whether the op copies a device tensor to the host and waits for it. A non-blocking copy into pinned memory is
    queued and the host goes on (torch pins a non-blocking .to("cpu")'s strided output itself); into pageable
    memory, CUDA returns only once the copy is done."""
    if func is aten._to_copy.default:
        queued = kwargs.get("non_blocking", False) and kwargs.get("layout", torch.strided) == torch.strided
        return not _is_host(args[0].device) and _is_host(kwargs.get("device")) and not queued
    if func is aten.copy_.default:
        queued = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) and args[0].is_pinned()
        return _is_host(args[0].device) and not _is_host(args[1].device) and not queued
    return False


def to_device(func, args, kwargs):
    """(the host tensor copied, whether non_blocking) where the op copies host memory to a device, else None. From
    pageable (not pinned) memory CUDA may wait for the stream before it stages the copy (pin it first:
    tensor.pin_memory()); without non_blocking=True torch waits for the copy to land, from pinned memory too."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        if device is not None and not _is_host(device) and _is_host(args[0].device):
            return args[0], kwargs.get("non_blocking", False)
    elif func is aten.copy_.default and not _is_host(args[0].device) and _is_host(args[1].device):
        return args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return None


def value_dependent(func, args, kwargs):
    """Whether the op's result needs a value: repeat_interleave's size is the sum of its counts unless given;
    histc's range, where min = max (its default), is the tensor's own min and max."""
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten.histc.default:
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return low == high and args[0].numel() > 0
    return func in VALUE_DEPENDENT


def masked(func, args, kwargs, number=None):
    """Whether an indexing op reads a boolean mask's count of True (number: a value torch made from a Python one)."""
    if func not in INDEXING or not any(i is not None and i.dtype in MASKS for i in args[1]):
        return False
    return not fills(func, args, kwargs, number)


def fills(func, args, kwargs, number):
    """Whether torch makes the op a masked_fill_, which reads no count: t[mask] = 0.0, one mask on t's device and
    one value on the host (where, from a Python number, a GPU's t puts it), nothing accumulated (ATen's
    index_put_). On a CPU standing in for a GPU, every value is on the host: there only one from a number."""
    if func is aten.index.Tensor or (args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
        return False
    self, value, masks = args[0], args[2], [i for i in args[1] if i is not None]
    on_host = _is_host(value.device) and (not _is_host(self.device) or value is number)
    return len(masks) == 1 and masks[0].dtype in MASKS and masks[0].device == self.device and \
        value.numel() == 1 and on_host


def host_copy(func, args):
    """Whether a method call on a host tensor would, on a GPU tensor, copy it to the host and wait: .tolist() and
    .cpu(), which on a CPU dispatch no op (the tensor is there already), and printing or formatting it, which torch
    does with dispatch modes off, so the op check cannot see them (a 0-dim tensor's format is its .item(), seen).
    Not .to(), whose device a loop takes from its tensors (the CPU, on a CPU), nor .numpy(), which takes host
    tensors alone."""
    if func is torch.Tensor.__format__ and args[0].dim() == 0:
        return False
    return func in (torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__repr__, torch.Tensor.__format__) and \
        _is_host(args[0].device)


class HostCopies(TorchFunctionMode):
    """HostSyncs' check, for a CPU run standing in for a GPU one, of the method calls that dispatch no op there
    (host_copy): counted by name, into counts."""

    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if host_copy(func, args):
            self.counts[f"Tensor.{func.__name__}"] += 1
        return func(*args, **kwargs)


class HostSyncs(TorchDispatchMode):
    """device: the device the loop runs on. Off the CPU, reading a value of a tensor that lives on the host (a
    counter kept there) waits for nothing and is not counted; by default (None) every value read is, so that a CPU
    run can stand in for a GPU one."""

    def __init__(self, device=None):
        super().__init__()
        self.on_host_is_free = device is not None and torch.device(device).type != "cpu"
        self.counts, self.blocks, self.number = Counter(), 0, None
        self.shown = set()  # other warnings raised while watching: said once per place, as by default

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = value_dependent(func, args, kwargs) or masked(func, args, kwargs, self.number)  # a value, or a count
        if reads and self.on_host_is_free and all(_is_host(a.device) for a in args if isinstance(a, torch.Tensor)):
            pass  # a value the host holds already (a mask of host tensors too: its count of True is on the host)
        elif reads or to_host(func, args, kwargs):
            self.counts[func.name()] += 1
        elif copy := to_device(func, args, kwargs):
            source, non_blocking = copy
            if not source.is_pinned():
                self.counts[func.name() + " from pageable memory"] += 1
            elif not non_blocking:
                self.counts[func.name() + " to the device, blocking"] += 1
        out = func(*args, **kwargs)
        self.number = out if func is aten.lift_fresh.default else self.number  # torch.tensor(x) or t[mask] = x's x
        return out

    @contextmanager
    def watch(self, ops=True):
        """Count the syncs of the block; ops=False leaves the op-by-op check off (a compiled model)."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        caught = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    stand_in = HostCopies(self.counts) if ops and not self.on_host_is_free else nullcontext()
                    with self if ops else nullcontext(), stand_in:
                        yield self
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
        finally:  # also when the block raised: a warning it gave before may say why
            for w in caught:
                text = str(w.message)
                if CUDA_SYNC in text:
                    self.counts["cuda: " + text.splitlines()[0][:80]] += 1
                elif (text, w.category, w.filename, w.lineno) not in self.shown:  # not ours: passed on, once
                    self.shown.add((text, w.category, w.filename, w.lineno))
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.blocks += 1

    def summary(self):
        if not self.counts:
            return "none"
        return ", ".join(f"{name} x{n}" for name, n in self.counts.most_common())
