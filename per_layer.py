"""
Per-layer updates: each layer's optimizer stepped inside backward, as soon as the layer's gradients are complete,
and the gradients freed at once (LOMO, GaLore): backward never holds every gradient, which is, with SLTrain's
W = s·BA + S and 8-bit Adam, the paper's memory headline. Any optimizer of optim.py (or galore.py) does the step.

    per_layer = attach_per_layer(model, lambda ps: Adam8bit(ps, lr=3e-3), lr_lambda=schedule)
    loss.backward()                                                 # ...now also updates every parameter

Run the tests:   python -m pytest -q test_per_layer.py
"""

import contextlib
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from optim import _check_8bit_format, _norms32


class _Alive:
    """A token held by the end-of-backward callback of the backward that began a per-layer update."""


def _hook_while_trainable(p, hook):
    # torch hooks only a tensor that requires grad; the hook stays on while requires_grad is off, and runs once it is
    # turned back on
    p.requires_grad_(True)
    try:
        return p.register_post_accumulate_grad_hook(hook)
    finally:
        p.requires_grad_(False)


def _at_end_of_backward(fn):
    # the autograd engine's hook for "once this backward is done", which DDP itself and torch's
    # optimizer-in-backward use; callbacks run in the order they were queued
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class PerLayer:
    """Per-layer updates, made by attach_per_layer(): one optimizer per layer, i.e. per module with trainable
    parameters of its own (an SLLinear's B, A and values; a norm's weight), stepped as soon as the last of them has
    its gradient, after which their gradients are freed. A layer's gradients come out of its backward together, so
    this holds no more gradient than one optimizer per tensor would, and the host issues one step per layer, not
    one per tensor (SLTrain has three tensors per projection). Layers that share one call (the model's
    shared_calls(): SLTrain's q, k, v and gate, up) get their gradients together too, and are one layer here. See
    attach_per_layer for how to drive it."""

    def __init__(self, model, make_optimizer, lr_lambda=None, max_grad_norm_per_param=None):
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        if self.ddp is not None and self.ddp.find_unused_parameters:
            # the communication hook sees a bucket of gradients, zeros where a parameter went unused, and cannot tell
            # those from real ones: it would step them (decay, momentum) where DDP with one optimizer would not
            raise ValueError("per-layer updates under DDP need every parameter used in every step: wrap the model "
                             "with find_unused_parameters=False, or freeze (requires_grad=False) what goes unused")
        module = model.module if self.ddp is not None else model
        module = getattr(module, "_orig_mod", module)  # names of the uncompiled model: checkpoints load either way
        self.names = {p: name for name, p in module.named_parameters() if p.requires_grad}
        if not self.names:
            raise ValueError("the model has no parameters that require grad")
        layer_of = {}  # module name -> the layer it is updated with, where it shares a call: the group's first
        modules = {m: name for name, m in module.named_modules()}
        for group in module.shared_calls() if hasattr(module, "shared_calls") else ():
            layer_of.update({modules[m]: modules[group[0]] for m in group})
        layers = defaultdict(list)
        for p, name in self.names.items():
            owner = name.rpartition(".")[0]
            layers[layer_of.get(owner, owner)].append(p)
        self.optimizers = {layer: make_optimizer(params) for layer, params in layers.items()}  # by module name
        self.optimizer_of = {p: self.optimizers[layer] for layer, params in layers.items() for p in params}
        self._size = {opt: sum(len(g["params"]) for g in opt.param_groups) for opt in self.optimizers.values()}
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group.setdefault("initial_lr", group["lr"])  # the base lr that lr_lambda scales, as in LambdaLR
        self.lr_lambda, self.max_grad_norm = lr_lambda, max_grad_norm_per_param
        self.steps = 0  # updates done so far; the lr of update k is initial_lr · lr_lambda(k)
        self._accumulating = self._removed = self._in_update = False
        self._arrived, self._norms, self._last_norm = {}, {}, None  # this update's: gradients per layer, norms
        self._strays = set()  # this update's parameters that were frozen at attach and have a gradient now
        self._module = weakref.ref(module)  # what is updated is checked against it once an update looks changed
        # The hooks reach this PerLayer through a weak reference, and the model holds it. A parameter's hooks are
        # held in C++, out of sight of Python's garbage collector: a cycle through them (parameter -> hook ->
        # PerLayer -> parameter) would never be freed, and every model given per-layer updates in one process
        # (a sweep, a benchmark, a notebook) would keep its parameters and optimizer state to the end.
        if getattr(module, "_per_layer", None) is not None and module._per_layer.ddp is None:
            module._per_layer.remove()  # replaced: its hooks go, even while the caller still holds it
        module._per_layer, me = self, weakref.ref(self)

        def on_grad(p):
            if me() is not None:  # (a PerLayer that is gone)
                me()._on_grad(p)

        def on_stray(p):
            if me() is not None:
                me()._on_stray(p)
        # the parameters frozen now have a hook too, which runs only if one is trained later: that update is refused
        frozen = [p for p in module.parameters() if not p.requires_grad and (p.is_floating_point() or p.is_complex())]
        self._handles = [_hook_while_trainable(p, on_stray) for p in frozen]
        if self.ddp is None:
            self._handles += [p.register_post_accumulate_grad_hook(on_grad) for p in self.names]
        else:
            # DDP checks the hook's parameter names; the module holds this PerLayer as long as DDP holds the module
            self.ddp.register_comm_hook(None, lambda state, bucket: me()._on_bucket(state, bucket))

    def _on_grad(self, p):
        if self._accumulating:  # .grad keeps accumulating; the backward of the last micro-batch updates
            self._refuse_after_a_backward_that_raised()  # ...but not into what a failed one left, to be refused later
            return
        self._arrive(p)

    def _on_stray(self, p):
        if not self._accumulating:
            self._begin()
            self._strays.add(p)

    def _on_bucket(self, _, bucket):
        # DDP communication hook: average the bucket over the ranks, then update its parameters with the average.
        # The all-reduce is waited for here, so communication does not overlap the rest of backward.
        buffer, group = bucket.buffer(), self.ddp.process_group
        buffer.div_(group.size())
        dist.all_reduce(buffer, group=group)
        if not (self._accumulating or self._removed):  # accumulating without no_sync(): averaged, still correct
            for p, grad in zip(bucket.parameters(), bucket.gradients()):
                p.grad = grad  # the averaged gradient, a view into the bucket
                self._arrive(p)
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    def _refuse_after_a_backward_that_raised(self):
        # another backward than the one that began this update: a reentrant one nested in it (a reentrant
        # checkpoint's, whose update goes on), or a later one after it raised before its end (its graph task is gone,
        # and with it the callback that holds _Alive)
        if self._in_update and torch._C._current_graph_task_id() != self._backward and self._alive() is None:
            raise RuntimeError(f"an earlier backward stopped part way through a per-layer update ({self._updated} of "
                               f"{len(self.optimizers)} layers updated): call reset() on the PerLayer that "
                               f"attach_per_layer returned, then run the update again, all of its micro-batches")

    def _arrive(self, p):
        """p's gradient is complete: once its layer's last one is, update the layer."""
        self._refuse_after_a_backward_that_raised()
        self._begin()
        opt = self.optimizer_of[p]
        arrived = self._arrived.setdefault(opt, [])
        arrived.append(p)
        if len(arrived) == self._size[opt]:
            self._update(opt, self._arrived.pop(opt))

    def _begin(self):
        if self._in_update:
            return
        # the first gradient of this update: fix its lr, finish it once backward ends
        self._in_update, self._backward, self._updated = True, torch._C._current_graph_task_id(), 0
        self._factor = self.lr_factor()
        self._norms = {}
        alive = _Alive()  # referenced only by the callback: dies with the graph task of this backward
        self._alive = weakref.ref(alive)
        if self.ddp is None:
            _at_end_of_backward(lambda: (alive, self._finish()))
        else:  # queued twice, to run after DDP's own end-of-backward callback writes the buckets into .grad
            _at_end_of_backward(lambda: (alive, _at_end_of_backward(self._finish)))

    @torch.no_grad()
    def _update(self, opt, params):
        grads = [p.grad for p in params]
        norms = _norms32(grads)
        self._norms.update(zip(params, norms))  # summed once the update is done
        if self.max_grad_norm is not None:  # torch.nn.utils.clip_grad_norm_ applied to each tensor on its own
            torch._foreach_mul_(grads, (self.max_grad_norm / (torch.stack(norms) + 1e-6)).clamp(max=1.0).unbind())
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * self._factor
        opt.step()
        self._updated += 1
        if self.ddp is None:
            for p in params:
                p.grad = None  # the memory saving: these gradients die before most others exist

    def _finish(self):
        short = self._updated < len(self.optimizers)  # a layer not whole in this backward: unused, or changed?
        if self.ddp is None:  # gradients of earlier micro-batches whose parameter got none in the last: update them too
            pending = {p for params in self._arrived.values() for p in params}
            for p, opt in self.optimizer_of.items():
                if p.grad is not None and p not in pending:
                    self._arrived.setdefault(opt, []).append(p)
        for opt, params in self._arrived.items():  # layers some of whose parameters got no gradient this time
            self._update(opt, params)
        self._arrived = {}
        if self.ddp is not None:
            for p in self.names:
                p.grad = None
        self.steps += 1
        # summed in the parameters' order, not the order they arrived in (under DDP, a rebuilt model's first buckets
        # come in another): the same gradients give the same norm, to the bit
        norms = [self._norms[p] for p in self.names if p in self._norms]
        if norms:
            self._last_norm = torch.linalg.vector_norm(torch.stack(norms))
        self._in_update = False
        strays, self._strays = self._strays, set()
        if (strays or short) and (changed := self._changed_since_attach()):
            raise RuntimeError(f"per-layer updates are made for the parameters that required grad when "
                               f"attach_per_layer ran; since then {changed}. Set requires_grad (and replace modules) "
                               "before attach_per_layer, or call it again after the change (its optimizers start "
                               "afresh); this update went on for the parameters it knows")

    def _changed_since_attach(self):
        """What the model changed since the attach, in words ("" for nothing): parameters trained that have no
        optimizer here (their gradients, never used, are dropped), frozen, or gone from it (a module replaced)."""
        module = self._module()
        now = dict(module.named_parameters()) if module is not None else {}
        held = set(now.values())

        def listed(names):
            return ", ".join(names[:3]) + (f" ({len(names)} in all)" if len(names) > 3 else "")
        new = [name for name, p in now.items() if p.requires_grad and p not in self.names]
        gone = [name for p, name in self.names.items() if p not in held]
        replaced = [name for name in gone if name in new]
        parts = [(replaced, "was replaced by a new parameter, which is not updated"),
                 ([n for n in new if n not in replaced], "requires grad, so far not updated"),
                 ([n for n in gone if n not in replaced], "left the model"),
                 ([name for p, name in self.names.items() if p in held and not p.requires_grad],
                  "no longer requires grad, so its layer's gradients were held to the end of backward")]
        for name in new:
            now[name].grad = None  # no optimizer here would use it: it would only pile up
        return "; ".join(f"{listed(names)} {what}" for names, what in parts if names)

    def reset(self):
        """After a backward that raised (out of memory, an interrupt): drop every gradient and the update it left
        unfinished, so that the next backward starts a new one. The layers it had already updated keep that update;
        the count of updates (the lr schedule's position) does not advance."""
        for p in self.names:
            p.grad = None
        self._arrived, self._norms, self._strays, self._in_update = {}, {}, set(), False

    @contextlib.contextmanager
    def accumulating(self):
        """Backward passes inside this block add into .grad and update nothing. Under DDP wrap them in
        ddp.no_sync() too; without it every micro-batch is all-reduced, which is correct but wasted traffic."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def grad_norm(self):
        """The global L2 norm of the gradients of the last update (averaged ones under DDP, before any per-parameter
        clipping), as a 0-dim tensor: reading it is the only host sync."""
        if self._last_norm is None:
            raise RuntimeError("no update yet: grad_norm() is known after a backward outside accumulating()")
        return self._last_norm

    def get_last_lr(self):
        """The learning rates of the next update, one per param group of an optimizer from make_optimizer: what
        LambdaLR.get_last_lr() returns after scheduler.step()."""
        factor = self.lr_factor()
        return [group["initial_lr"] * factor for group in next(iter(self.optimizers.values())).param_groups]

    def lr_factor(self):
        """lr_lambda's factor for the next update (1 without one): its lr is initial_lr times this."""
        return 1.0 if self.lr_lambda is None else self.lr_lambda(self.steps)

    def state_dict(self):
        """{"steps", "optimizers": {parameter name: the state_dict of an optimizer of that parameter alone}}: one
        entry per parameter, however the parameters are grouped into layers."""
        states = {}
        for opt in self.optimizers.values():
            packed = opt.state_dict()
            for group, saved in zip(opt.param_groups, packed["param_groups"]):
                for p, i in zip(group["params"], saved["params"]):
                    states[self.names[p]] = {"state": {0: packed["state"][i]} if i in packed["state"] else {},
                                             "param_groups": [dict(saved, params=[0])]}
        return {"steps": self.steps, "optimizers": states}

    def load_state_dict(self, state):
        names, saved = set(self.names.values()), set(state["optimizers"])
        if names != saved:
            raise ValueError(f"per-layer state does not match the model: missing {sorted(names - saved)[:3]}, "
                             f"unexpected {sorted(saved - names)[:3]}; was it saved for another config?")
        steps = state["steps"]
        for one in state["optimizers"].values():  # refused before any layer loads: none is left half resumed
            _check_8bit_format(one)
        # each layer's optimizer checks its part as it loads it (optim._check_state_fits): one that refuses puts back
        # the layers loaded before it, which would otherwise keep the saved state while the rest start afresh
        loaded = []
        try:
            for opt in self.optimizers.values():
                before = opt.state_dict()
                opt.load_state_dict(self._packed(opt, state["optimizers"]))
                loaded.append((opt, before))
        except ValueError as e:
            for done, before in loaded:
                done.load_state_dict(before)
            names = ", ".join(self.names[p] for group in opt.param_groups for p in group["params"])
            raise ValueError(f"{names}: {e}") from None
        self.steps = steps

    def _packed(self, opt, saved):
        """opt's layout (groups, parameter numbers) filled with the saved state of each of its parameters."""
        packed = opt.state_dict()
        packed["state"] = {}
        for group, layout in zip(opt.param_groups, packed["param_groups"]):
            for p, i in zip(group["params"], layout["params"]):
                one = saved[self.names[p]]
                layout.update({k: v for k, v in one["param_groups"][0].items() if k != "params"})
                if 0 in one["state"]:
                    packed["state"][i] = one["state"][0]
        return packed

    def __deepcopy__(self, memo):
        return None  # copy.deepcopy of the model: the copy's parameters have no hooks, so no per-layer updates

    def remove(self):
        """Detach the hooks: later backward passes leave .grad for an ordinary optimizer, and the model lets go of
        this PerLayer (with its optimizers' state). DDP cannot unregister a communication hook, so under DDP it stays
        and only averages, as DDP's default does, and the model holds this PerLayer for it."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._removed = [], True
        module = self._module()
        if self.ddp is None and module is not None and getattr(module, "_per_layer", None) is self:
            module._per_layer = None


def attach_per_layer(model, make_optimizer, lr_lambda=None, clip_grad_norm=None, max_grad_norm_per_param=None):
    """Update each layer (a module's own trainable parameters) inside backward with its own optimizer,
    make_optimizer(params), as soon as its gradients are complete, and free them at once: backward never holds all
    gradients, and there is no optimizer.step() to call. Returns a PerLayer.

    model may be a DistributedDataParallel (attach before its first backward): then a communication hook updates
    each bucket's parameters after its all-reduce, with the averaged gradient. DDP's buckets hold a full set of
    gradients anyway, so there the point is correctness, not memory; use gradient_as_bucket_view=True.

    lr_lambda is LambdaLR's: update k uses initial_lr · lr_lambda(k), and k advances once per update.
    A global clip_grad_norm is refused: it needs every gradient before the first update, and per-layer mode has
    freed them by then. max_grad_norm_per_param clips each parameter's gradient to that norm on its own instead.

    A training step with n micro-batches:

        lr = per_layer.get_last_lr()[0]               # this update's: read before the update moves it on
        for x, y in micro_batches[:-1]:
            with per_layer.accumulating():            # under DDP: with ddp.no_sync(), per_layer.accumulating():
                (model(x, y)[1] / n).backward()       # adds into .grad, updates nothing
        (model(x, y)[1] / n).backward()               # the last micro-batch: updates, frees every .grad
        norm = per_layer.grad_norm()

    A backward that raises (out of memory, an interrupt) leaves its update half made: the next backward is refused
    until per_layer.reset() drops what it left.

    The parameters it updates are those that require grad now. One trained, frozen or replaced (a module swapped for
    a new one) after it returns is refused at the end of the next backward, once the rest are updated, naming it: set
    requires_grad before attaching, or attach again after the change.

    Reentrant activation checkpointing (use_reentrant=True) runs each checkpoint's backward as a graph task of its
    own, nested in the outer one: an update that begins inside it would end with it, and the rest of the backward
    would make a second update. So the first layer that backward reaches (the head) must be outside every reentrant
    checkpoint; non-reentrant checkpointing (torch's default, and model.py's) has no such limit.
    """
    if clip_grad_norm:
        raise ValueError(f"clip_grad_norm={clip_grad_norm} needs the global norm of all gradients before any update, "
                         "but per-layer updates free each gradient as soon as it is used; pass "
                         "max_grad_norm_per_param to clip each parameter on its own, or turn clipping off")
    if max_grad_norm_per_param is not None and not max_grad_norm_per_param > 0:
        raise ValueError(f"max_grad_norm_per_param must be > 0 or None, got {max_grad_norm_per_param}")
    return PerLayer(model, make_optimizer, lr_lambda, max_grad_norm_per_param)
