"""
CUDA graphs: the GPU work of a call captured once and replayed, one launch from the host for all of its kernels.

A train step of SLTrain at 350m issues thousands of operations, and on an H100 the host takes longer to issue them
than the GPU takes to run them (BENCHMARKS.md): the GPU waits. A CUDA graph records the kernels of one call with
their memory addresses and replays them, without the host's Python or launches. What a replay cannot do is anything
the host decides: every tensor it reads or writes stays where it was at capture, and every number the host passed a
kernel stays the capture's. So the inputs are copied into the graph's own buffers, the gradients it accumulates
into are allocated before capture and never freed (zeroed in place), and what changes from update to update (the
learning rate, the optimizer's step count) is either kept out of the graph or read from the device.

    cuda_graphed(fn, device)         fn's GPU work as a replay function (bench.py and suite.py time steps with it)
    MicroBatchGraph(model, params)   train.py --cuda_graph: a micro-batch's forward and backward, replayed
    PerLayerGraph(model, per_layer)  train.py --cuda_graph --per_layer: the last micro-batch's forward, backward and
                                     per-layer updates, replayed, with each update's step sizes on the device
"""

from contextlib import nullcontext

import torch

from optim import _step_scalars


def cuda_graphed(fn, device, warmup=3, pool=None):
    """A call that replays fn's GPU work, captured once as a CUDA graph: one launch for all of fn's kernels, so that
    timing it gives the GPU's time for fn without the host's time to issue it (its Python, its launches). fn must
    work the same on every call, without a host sync, as a training step does between log steps; its outputs are
    overwritten by each replay. Warmed up first on a side stream, as CUDA graph capture needs (cuBLAS's workspace,
    the allocator's blocks, a compiled function's compiling): the warm-up calls run fn, the capture does not.
    warmup=0 where the caller has run fn already; pool: a memory pool shared with graphs replayed in turn with it
    (torch.cuda.graph_pool_handle())."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class MicroBatchGraph:
    """Forward and backward of one micro-batch, model(x, y)'s loss times weight backpropagated into the gradients
    of params (accumulated, as backward does), captured at the first call and replayed at each: call it as
    graph(x, y, weight) -> the loss (a tensor of the graph's, overwritten by the next call). x, y and weight are
    copied into the graph's own buffers first, so every micro-batch has the first one's shapes. The gradients are
    allocated at the first call and stay: zero_grads() zeroes them in place for the next update; a gradient set to
    None would leave the graph writing where nothing reads. capture: how fn becomes a replay (cuda_graphed; the
    tests pass fn itself, as a CPU has no CUDA graphs)."""

    def __init__(self, model, params, capture=cuda_graphed):
        self.model, self.capture, self.replay = model, capture, None
        self.params = [p for p in params if p.requires_grad]
        self.x = self.grads = None  # the input buffers and the gradients, made at the first call

    def _forward_backward(self):
        loss = self.model(self.x, self.y)[1]
        (loss * self.weight).backward()
        self.loss = loss.detach()  # at capture, the graph's tensor, which each replay writes

    def __call__(self, x, y, weight, last=True):
        """last: whether this is the update's last micro-batch (one graph serves all of them here)."""
        self._load(x, y, weight)
        if self.replay is None:
            self.replay = self._capture_accumulating()
        self.replay()
        return self.loss

    def _load(self, x, y, weight):
        """x, y and weight copied into the graph's buffers (made at the first call)."""
        if self.x is None:
            device = self.params[0].device
            self.x, self.y, self.weight = (torch.empty_like(t, device=device) for t in (x, y, weight))
        elif x.shape != self.x.shape or y.shape != self.y.shape:
            raise ValueError(f"a CUDA graph replays its first micro-batch's shapes, {tuple(self.x.shape)}; this one "
                             f"is {tuple(x.shape)}: give every micro-batch one shape, or drop --cuda_graph")
        for buffer, t in zip((self.x, self.y, self.weight), (x, y, weight)):
            buffer.copy_(t, non_blocking=True)

    def _capture_accumulating(self, **options):
        """The replay of a forward and backward that adds into gradients allocated here, before capture."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]
        replay = self.capture(self._forward_backward, self.x.device, **options)
        self.zero_grads()  # what the warm-up calls accumulated
        moved = [i for i, (p, g) in enumerate(zip(self.params, self.grads)) if p.grad is not g]
        if moved:  # backward put a new tensor in .grad: the replays would write one that no optimizer reads
            raise RuntimeError(f"{len(moved)} gradient(s) were replaced, not accumulated into, in the captured "
                               "backward: this model cannot train under --cuda_graph; drop it")
        return replay

    def zero_grads(self):
        """The gradients zeroed in place, where the graph accumulates into them: a new update."""
        torch._foreach_zero_(self.grads)


VARYING = (0, 5, 6)  # of optim._step_scalars's numbers, those an update's lr and step count change


def _varying(hyper):
    """The numbers of hyper that change from update to update, as the device keeps them (no decay: 1)."""
    return [1.0 if hyper[i] is None else hyper[i] for i in VARYING]


class DeviceScalars:
    """The numbers of an optimizer's update that change from update to update, the step size, the decay and the
    bias correction (optim._hyper), kept on the device for each param group and step count: a captured update reads
    each update's there. Given to optimizers as their device_scalars by PerLayerGraph.

    The first update, run eagerly, makes the rows and writes each as it is asked for; pack() then lays them in one
    buffer, which refresh(factor) fills before each capture and replay, from the host in one copy, with the values
    the update will use: lr = initial_lr · factor (as per_layer.PerLayer sets it), the step count one past the
    state's. While capturing, each row asked for is checked against what refresh wrote: the optimizer and refresh
    must agree on every number a replay will read."""

    def __init__(self, device):
        self.device, self.rows, self.groups, self.states, self.tensors = device, {}, [], [], []
        self.buffer = self.values = None

    def on_device(self, group, state, hyper):
        values = _varying(hyper)
        row = self.rows.get((id(group), id(state)))
        if row is None and self.buffer is not None:
            raise RuntimeError("the captured update steps a tensor that the first update did not: under --cuda_graph "
                               "every update must step the same tensors; drop --cuda_graph")
        if row is None:  # the first update: a row of its own, written now
            row = self.rows[(id(group), id(state))] = len(self.groups)
            self.groups.append(group)
            self.states.append(state)
            self.tensors.append(self._from_host(values).to(self.device, non_blocking=True))
        elif self.buffer is None:  # the first update, again: written again
            self.tensors[row].copy_(self._from_host(values), non_blocking=True)
        elif values != self.values[row]:
            raise RuntimeError(f"the optimizer's step size, decay and bias correction {values} are not the "
                               f"{self.values[row]} given to the device for this update: drop --cuda_graph")
        t = self.tensors[row]
        return tuple(t[VARYING.index(i)] if i in VARYING and x is not None else x for i, x in enumerate(hyper))

    def pack(self):
        """The rows into one buffer, which refresh() fills with one copy: after the first update."""
        self.buffer = torch.stack(self.tensors) if self.tensors else torch.empty(0, 3, device=self.device)
        self.tensors = list(self.buffer.unbind())

    def refresh(self, factor):
        """Each row's values for the next update: lr = initial_lr · factor, the step count one past the state's."""
        self.values = []
        for group, state in zip(self.groups, self.states):
            beta1, beta2 = group["betas"]
            self.values.append(_varying(_step_scalars(group["initial_lr"] * factor, beta1, beta2, group["eps"],
                                                      group["weight_decay"], state["step"] + 1)))
        self.buffer.copy_(self._from_host(self.values).view(-1, 3), non_blocking=True)

    def _from_host(self, values):
        """values as a float32 tensor to copy to the device without the host waiting: for a GPU, in pinned memory
        (a copy from pageable memory may wait for the GPU to drain, as train.on_host says)."""
        values = torch.tensor(values, dtype=torch.float32)
        return values.pin_memory() if self.device.type == "cuda" else values


class PerLayerGraph(MicroBatchGraph):
    """train.py --cuda_graph --per_layer: the last micro-batch of each update, its forward, its backward and the
    per-layer updates made inside it (per_layer.PerLayer), captured once and replayed; the micro-batches before it
    as MicroBatchGraph's graph, which accumulates into gradients kept between updates, sharing one memory pool.
    Call it as graph(x, y, weight, last) -> the loss (a tensor of the graph's).

    The first update runs eagerly: it compiles what compiles, makes and lays out the optimizers' states, and makes
    each param group's row of DeviceScalars, from which every update then reads its step sizes. The second update
    captures. Before each capture and replay the host writes the update's learning rate and step counts into the
    device's rows (one copy); after each replay it counts the update as the capture's Python counted it (each
    state's step, the PerLayer's steps and its groups' lr), so that a checkpoint holds what an eager run would.
    Every update must have as many micro-batches, of one shape, and step the same tensors."""

    def __init__(self, model, per_layer, capture=cuda_graphed):
        super().__init__(model, per_layer.names, capture)
        self.per_layer, self.scalars = per_layer, DeviceScalars(self.params[0].device)
        for opt in per_layer.optimizers.values():
            if not hasattr(opt, "device_scalars"):
                raise ValueError(f"{type(opt).__name__} cannot read its step sizes from the device, as a replayed "
                                 "update must: under --cuda_graph --per_layer use --optimizer adamw or adam8bit")
            opt.device_scalars = self.scalars
        self.pool = torch.cuda.graph_pool_handle() if self.params[0].device.type == "cuda" else None
        self.accumulate = self.update = None  # the replays of the micro-batches before the last, and of the last
        self.accumulated = 0  # micro-batches of this update so far
        self.accumulating_loss = self.update_loss = self.stepped = self.accumulates = None

    def __call__(self, x, y, weight, last=True):
        self._load(x, y, weight)
        if self.scalars.buffer is None:  # the first update, eagerly: packed once it has made its rows
            with nullcontext() if last else self.per_layer.accumulating():
                self._forward_backward()
            if last:
                self.scalars.pack()
            return self.loss
        if not last:
            if self.update is not None and not self.accumulates:
                raise ValueError("this update has more micro-batches than the captured one: under --cuda_graph "
                                 "every update needs as many")
            if self.accumulate is None:
                with self.per_layer.accumulating():
                    self.accumulate = self._capture_accumulating(pool=self.pool)
                self.accumulating_loss = self.loss
            self.accumulate()
            self.accumulated += 1
            return self.accumulating_loss
        if self.update is not None and self.accumulates != (self.accumulated > 0):
            raise ValueError("this update has fewer micro-batches than the captured one: under --cuda_graph every "
                             "update needs as many")
        factor = self.per_layer.lr_factor()
        self.scalars.refresh(factor)
        if self.update is None:
            self._capture_update()  # its Python counts the update, as an eager one does
        else:
            self._count(factor)
        self.update()
        if self.accumulated:
            self.zero_grads()  # for the next update's micro-batches
        self.accumulated = 0
        return self.update_loss

    def _capture_update(self):
        self.accumulates = self.accumulated > 0
        if self.accumulates:  # the micro-batches before it add into these; its backward too, then frees them
            for p, g in zip(self.params, self.grads):
                p.grad = g
        states = self._states()
        steps, where = [state.get("step") for state in states], self._addresses(states)
        self.update = self.capture(self._forward_backward, self.x.device, warmup=0, pool=self.pool)
        self.update_loss = self.loss
        self.stepped = [state for state, step in zip(states, steps) if state.get("step") != step]
        if len(self._states()) != len(states) or self._addresses(states) != where:
            # optimizer state made or moved during capture would live in the graph's pool, for other graphs to reuse
            raise RuntimeError("the captured update made or moved optimizer state that the first update had made: "
                               "under --cuda_graph every update must step the same tensors; drop --cuda_graph")

    def _states(self):
        return [state for opt in self.per_layer.optimizers.values() for state in opt.state.values()]

    @staticmethod
    def _addresses(states):
        return [[t.data_ptr() for t in state.values() if torch.is_tensor(t)] for state in states]

    def _count(self, factor):
        """What the capture's Python did for its update, done for a replay's."""
        for state in self.stepped:
            state["step"] += 1
        for opt in self.per_layer.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * factor
        self.per_layer.steps += 1

    def zero_grads(self):
        """The gradients the micro-batches before the last add into, zeroed in place (none with one micro-batch)."""
        if self.grads is not None:
            torch._foreach_zero_(self.grads)
        self.accumulated = 0
