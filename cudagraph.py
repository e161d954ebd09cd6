"""
CUDA graphs: the GPU work of a call captured once and replayed, one launch from the host for all of its kernels.

A train step of SLTrain at 350m issues thousands of operations, and on an H100 the host takes longer to issue them
than the GPU takes to run them (BENCHMARKS.md): the GPU waits. A CUDA graph records the kernels of one call with
their memory addresses and replays them, without the host's Python or launches. What a replay cannot do is anything
the host decides: every tensor it reads or writes stays where it was at capture. So the inputs are copied into the
graph's own buffers, the gradients it accumulates into are allocated before capture and never freed (zeroed in
place), and whatever the host changes from update to update (the learning rate, the optimizer's step count, the
per-layer updates inside backward) stays out of the graph.

    cuda_graphed(fn, device)         fn's GPU work as a replay function (bench.py and suite.py time steps with it)
    MicroBatchGraph(model, params)   train.py --cuda_graph: a micro-batch's forward and backward, replayed
"""

import torch


def cuda_graphed(fn, device, warmup=3):
    """A call that replays fn's GPU work, captured once as a CUDA graph: one launch for all of fn's kernels, so that
    timing it gives the GPU's time for fn without the host's time to issue it (its Python, its launches). fn must
    work the same on every call, without a host sync, as a training step does between log steps; its outputs are
    overwritten by each replay. Warmed up first on a side stream, as CUDA graph capture needs (cuBLAS's workspace,
    the allocator's blocks, a compiled function's compiling): the warm-up calls run fn, the capture does not."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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

    def _forward_backward(self):
        loss = self.model(self.x, self.y)[1]
        (loss * self.weight).backward()
        self.loss = loss.detach()  # at capture, the graph's tensor, which each replay writes

    def __call__(self, x, y, weight):
        if self.replay is None:
            device = self.params[0].device
            self.x, self.y, self.weight = (torch.empty_like(t, device=device) for t in (x, y, weight))
        elif x.shape != self.x.shape or y.shape != self.y.shape:
            raise ValueError(f"a CUDA graph replays its first micro-batch's shapes, {tuple(self.x.shape)}; this one "
                             f"is {tuple(x.shape)}: give every micro-batch one shape, or drop --cuda_graph")
        for buffer, t in zip((self.x, self.y, self.weight), (x, y, weight)):
            buffer.copy_(t, non_blocking=True)
        if self.replay is None:
            self._capture()
        self.replay()
        return self.loss

    def _capture(self):
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        self.replay = self.capture(self._forward_backward, self.x.device)
        self.zero_grads()  # what the warm-up calls accumulated
        moved = [i for i, (p, g) in enumerate(zip(self.params, grads)) if p.grad is not g]
        if moved:  # backward put a new tensor in .grad: the replays would write one that no optimizer reads
            raise RuntimeError(f"{len(moved)} gradient(s) were replaced, not accumulated into, in the captured "
                               "backward: this model cannot train under --cuda_graph; drop it")

    def zero_grads(self):
        """The gradients zeroed in place, where the graph accumulates into them: a new update."""
        torch._foreach_zero_([p.grad for p in self.params])
