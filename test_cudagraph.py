"""
train.py --cuda_graph: each micro-batch's forward and backward replayed from one capture (cudagraph.MicroBatchGraph),
and with --per_layer the last micro-batch's per-layer updates too (cudagraph.PerLayerGraph). A CPU has no CUDA
graphs, so here the capture is recorded and replayed the way a real one behaves (recorded_capture): its warm-up
calls run the function; the capture runs its Python and none of its work; each replay runs the recorded work again
and none of the Python, so that a number the host passed at capture stays the capture's, as on a GPU. What is tested
is everything around the graph (the static buffers, the gradients kept and zeroed in place, the eager optimizer or
the step sizes on the device, the counts kept on the host), against train.py's plain update to the bit. The real
capture runs where CUDA is (skipped otherwise).

    python -m pytest -q test_cudagraph.py
"""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import cudagraph
import optim
import train
from cudagraph import MicroBatchGraph, PerLayerGraph
from hostsync import HostSyncs
from per_layer import attach_per_layer
from model import LLaMA, config_for
from test_optim import same_state
from test_train import base_args, final_state, metrics
from test_train import corpus  # noqa: F401  (the tiny shards and tokenizer, made once per module)


class Recording(TorchDispatchMode):
    """The tensor operations of a capture, recorded as a CUDA graph records its kernels (see recorded_capture)."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.equal.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.ops, self.made, self.saved = [], set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SYNCS:
            raise RuntimeError(f"{func} makes the host wait for the device: a CUDA graph capture fails on it")
        for t in written(func, args, kwargs):  # a tensor made before the capture: its bytes, to undo the write
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.made and storage.data_ptr() not in self.saved and storage.nbytes():
                self.saved[storage.data_ptr()] = (as_bytes(storage), as_bytes(storage).clone())
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        for t, returned in zip(tree_flatten(out)[0], fresh_returns(func, out)):
            if returned:
                self.made.add(t.untyped_storage().data_ptr())
        return out


def written(func, args, kwargs):
    """The tensors an operation writes into, by its schema (Tensor(a!), lists of them)."""
    tensors = []
    for i, argument in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write:
            tensors += [t for t in tree_flatten(value)[0] if torch.is_tensor(t)]
    return tensors


def fresh_returns(func, out):
    """For each tensor func returned: whether it is new memory (not an input, nor a view of one)."""
    flags = []
    for returned, value in zip(func._schema.returns, out if isinstance(out, tuple) else (out,)):
        flags += [returned.alias_info is None] * len([t for t in tree_flatten(value)[0] if torch.is_tensor(t)])
    return flags


def as_bytes(storage):
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def recorded_capture(captures=None):
    """A CUDA graph's capture and replay as the host sees them, on a CPU, for a function that does Python between
    its tensor operations (per-layer updates): the warm-up calls run it; the capture runs its Python with its tensor
    operations recorded and their writes into tensors made before undone (a capture runs no kernel: the values it
    leaves are garbage, and nothing outside changes); a host sync fails the capture, as it would fail a real one.
    Each replay runs the recorded operations again on the same tensors, new results copied into the ones the
    capture made, and none of the Python: a number the host passed an operation stays the capture's."""
    def capture(fn, device, warmup=2, pool=None):
        for _ in range(warmup):
            fn()
        recording = Recording()
        with recording:
            fn()
        for original, before in recording.saved.values():
            original.copy_(before)
        if captures is not None:
            captures.append(recording)

        def replay():
            with torch._C._AutoDispatchBelowAutograd():  # as recorded: the kernels, not autograd's bookkeeping
                run_again(recording.ops)
        return replay
    return capture


def run_again(ops):
    """The recorded operations run again on the same tensors (recorded_capture's replay)."""
    for func, args, kwargs, out in ops:
        if not any(fresh_returns(func, out)) and not written(func, args, kwargs):
            continue  # a view: the capture's still views the same memory
        result = func(*args, **kwargs)
        for t, new, returned in zip(tree_flatten(out)[0], tree_flatten(result)[0], fresh_returns(func, out)):
            if returned:
                t.copy_(new)


def runs(method, capture=None, grad_clipping=0.0, updates=3, accum=2):
    """(losses, parameters, run) of `updates` train.py updates of a tiny model, `accum` micro-batches each, plain
    or with a MicroBatchGraph of the given capture."""
    torch.manual_seed(0)
    model = LLaMA(config_for("tiny", method=method, vocab_size=96))
    optimizer = train.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))  # an lr that changes
    graph = MicroBatchGraph(model, model.parameters(), capture) if capture else None
    run = train.Run(model, model, optimizer, scheduler, None, model.config, torch.device("cpu"), 0, 1, graph)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(updates):
        micro_batches = []
        for i in range(accum):
            x, y = torch.randint(96, (2, 16), generator=generator), torch.randint(96, (2, 16), generator=generator)
            y[0, -2 - i:] = -1  # padding: targets not counted, so the micro-batches weigh differently
            micro_batches.append(train.on_host(x, y, torch.device("cpu")))
        loss, norm, n = train.train_step(SimpleNamespace(grad_clipping=grad_clipping), run, micro_batches)
        losses.append((loss.item(), norm.item(), n.item()))
    return losses, [p.detach().clone() for p in model.parameters()], run


@pytest.mark.parametrize("grad_clipping", [0.0, 0.5], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("method", ["full", "sltrain"])
def test_replayed_micro_batches_train_as_the_plain_update_to_the_bit(method, grad_clipping):
    """Updates of two micro-batches each, weighted by their counted targets, with a schedule's lr and clipping: the
    same losses, gradient norms and parameters as train.py's plain update, bit for bit. One capture for the run; the
    warm-up's gradients dropped; the gradients the same tensors at the end, zeroed, never set to None."""
    plain_losses, plain_params, _ = runs(method, grad_clipping=grad_clipping)
    captures = []
    losses, params, run = runs(method, recorded_capture(captures), grad_clipping=grad_clipping)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    assert len(captures) == 1
    grads = [p.grad for p in run.raw_model.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    train.train_step(SimpleNamespace(grad_clipping=grad_clipping), run, [(torch.randint(96, (2, 16)),
                                                                          torch.randint(96, (2, 16)), 32)])
    assert all(p.grad is g for p, g in zip(run.raw_model.parameters(), grads)) and len(captures) == 1


def test_a_stop_within_an_update_zeroes_the_graphs_gradients_in_place():
    """A signal before the last micro-batch drops the update: nothing changed, and the gradients the graph adds to
    are zeroed where they are (set to None, the graph would write where no optimizer reads)."""
    _, _, run = runs("sltrain", recorded_capture(), updates=1)
    grads = [p.grad for p in run.graph.params]
    before = [p.detach().clone() for p in run.raw_model.parameters()]
    micro_batches = [(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), 32) for _ in range(2)]
    stop = {"signal": "SIGTERM"}
    assert train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches, stop) is None
    assert all(p.grad is g and not g.any() for p, g in zip(run.graph.params, grads))
    assert all(torch.equal(p, b) for p, b in zip(run.raw_model.parameters(), before))


def test_a_micro_batch_of_another_shape_is_refused_in_one_line():
    model = LLaMA(config_for("tiny", vocab_size=96))
    graph = MicroBatchGraph(model, model.parameters(), recorded_capture())
    weight = torch.tensor(1.0)
    graph(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), weight)
    with pytest.raises(ValueError, match=r"replays its first micro-batch's shapes, \(2, 16\); this one is \(2, 12\): "
                                         "give every micro-batch one shape, or drop --cuda_graph"):
        graph(torch.randint(96, (2, 12)), torch.randint(96, (2, 12)), weight)


def test_a_backward_that_replaces_a_gradient_is_refused():
    """The graph's backward must add into the gradients allocated before capture; one that put a new tensor in .grad
    (as autograd does where it cannot add in place) would leave the replays writing where no optimizer reads."""
    model = LLaMA(config_for("tiny", vocab_size=96))

    def capture(fn, device):
        fn()
        model.norm.weight.grad = model.norm.weight.grad.clone()
        return fn
    graph = MicroBatchGraph(model, model.parameters(), capture)
    with pytest.raises(RuntimeError, match=r"^1 gradient\(s\) were replaced, not accumulated into, in the captured "
                                           "backward: this model cannot train under --cuda_graph; drop it"):
        graph(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), torch.tensor(1.0))


OPTIMIZERS = {"adamw": lambda ps: train.AdamW(ps, lr=1e-2, weight_decay=0.1),
              "adam8bit": lambda ps: train.Adam8bit(ps, lr=1e-2, weight_decay=0.1, min_8bit_size=256, block_size=64)}


def per_layer_runs(method, optimizer, capture=None, updates=4, accum=2, dtype=torch.float32, clip=None,
                   device="cpu", resume=None):
    """(losses, the model's state, the PerLayer's state_dict, run) of `updates` train.py updates with per-layer
    updates, plain or with a PerLayerGraph of the given capture; the lr changes at every update. resume: (updates
    done, model state, PerLayer state) to go on from, as train.py --resume does."""
    torch.manual_seed(0)
    device = torch.device(device)
    model = LLaMA(config_for("tiny", method=method, vocab_size=96), device=device).to(dtype)
    per_layer = attach_per_layer(model, OPTIMIZERS[optimizer], lr_lambda=lambda k: 1.0 / (k + 1),
                                 max_grad_norm_per_param=clip)
    done = 0
    if resume:
        done, model_state, per_layer_state = resume
        model.load_state_dict(model_state)
        per_layer.load_state_dict(per_layer_state)
    graph = PerLayerGraph(model, per_layer, capture) if capture else None
    run = train.Run(model, model, None, None, per_layer, model.config, device, 0, 1, graph)
    generator, losses = torch.Generator().manual_seed(1), []
    for update in range(done + updates):
        micro_batches = []
        for i in range(accum):
            x, y = torch.randint(96, (2, 16), generator=generator), torch.randint(96, (2, 16), generator=generator)
            y[0, -2 - i:] = -1
            micro_batches.append(train.on_host(x, y, device))
        if update < done:  # the batches of the updates made before the checkpoint
            continue
        loss, norm, n = train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches)
        losses.append((loss.item(), norm.item(), n.item(), per_layer.get_last_lr()[0]))
    return losses, copy.deepcopy(model.state_dict()), copy.deepcopy(per_layer.state_dict()), run


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("method,optimizer", [("sltrain", "adam8bit"), ("sltrain", "adamw"), ("full", "adam8bit")])
def test_replayed_per_layer_updates_train_as_the_plain_ones_to_the_bit(method, optimizer, accum):
    """--cuda_graph --per_layer, the capture recorded and replayed as a CUDA graph's (recorded_capture): four
    updates, one eager, one captured, two replayed, with an lr that changes at each and weight decay, give the
    same losses, gradient norms, parameters and optimizer state (step counts and lr included) as plain per-layer
    updates, to the bit. A replay reads its step sizes from the device: one that kept the capture's would not."""
    plain = per_layer_runs(method, optimizer, accum=accum)
    captures = []
    graphed = per_layer_runs(method, optimizer, recorded_capture(captures), accum=accum)
    assert graphed[0] == plain[0]
    assert same_state(graphed[1], plain[1]) and same_state(graphed[2], plain[2])
    assert len(captures) == (2 if accum > 1 else 1)  # the micro-batches before the last, and the last
    run = graphed[3]
    assert run.graph.scalars.buffer is not None and len(run.graph.scalars.groups) > 0


@pytest.mark.parametrize("optimizer", ["adamw", "adam8bit"])
def test_replayed_per_layer_updates_of_bf16_parameters_and_clipping(optimizer):
    """bf16 parameters and per-parameter clipping: still the plain updates to the bit."""
    plain = per_layer_runs("sltrain", optimizer, dtype=torch.bfloat16, clip=0.05)
    graphed = per_layer_runs("sltrain", optimizer, recorded_capture(), dtype=torch.bfloat16, clip=0.05)
    assert graphed[0] == plain[0]
    assert same_state(graphed[1], plain[1]) and same_state(graphed[2], plain[2])


def test_a_replay_with_the_captures_numbers_would_train_otherwise(monkeypatch):
    """The check on the check: with the step sizes left as the capture's numbers (DeviceScalars handing them back
    unchanged), the replayed updates part from the plain ones at the first replay."""
    monkeypatch.setattr(cudagraph.DeviceScalars, "on_device", lambda self, group, state, hyper: hyper)
    plain = per_layer_runs("sltrain", "adam8bit", accum=1)
    graphed = per_layer_runs("sltrain", "adam8bit", recorded_capture(), accum=1)
    assert graphed[0][:3] == plain[0][:3] and graphed[0][3] != plain[0][3]


def test_the_capture_checks_the_numbers_given_to_the_device_against_the_optimizers(monkeypatch):
    """Each number a replay reads from the device is checked, at capture, against the one the optimizer computed
    for that update: a refresh that got the step count wrong fails the capture in one line, not the run later."""
    wrong = lambda lr, beta1, beta2, eps, decay, step: optim._step_scalars(lr, beta1, beta2, eps, decay, step + 1)
    monkeypatch.setattr(cudagraph, "_step_scalars", wrong)
    with pytest.raises(RuntimeError, match=r"^the optimizer's step size, decay and bias correction \[.*\] are not "
                                           r"the \[.*\] given to the device for this update: drop --cuda_graph$"):
        per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=2, accum=1)


def test_device_scalars_rewrite_a_row_the_first_update_asks_for_again():
    """A first update tried again (after a backward that raised, per_layer.reset()) asks for its rows again: they
    are written again, with the new numbers."""
    scalars, group, state = cudagraph.DeviceScalars(torch.device("cpu")), {}, {}
    first = scalars.on_device(group, state, optim._step_scalars(1e-2, 0.9, 0.999, 1e-8, 0.1, 1))
    again = scalars.on_device(group, state, optim._step_scalars(5e-3, 0.9, 0.999, 1e-8, 0.1, 1))
    assert again[0].item() == pytest.approx(-5e-3 / 0.1) and first[0].item() == again[0].item()
    assert again[5].item() == pytest.approx(1 - 5e-4) and len(scalars.groups) == 1


def test_a_replayed_run_saves_and_resumes_as_a_plain_one():
    """Three updates replayed (one eager, one captured, one replayed), their state saved and resumed in a new model,
    three more replayed: the same losses, parameters and optimizer state as six plain per-layer updates, to the bit.
    What the graph leaves in a checkpoint is what an eager run leaves, step counts and schedule included."""
    plain = per_layer_runs("sltrain", "adam8bit", updates=6)
    first = per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=3)
    rest = per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=3, resume=(3, first[1], first[2]))
    assert first[0] + rest[0] == plain[0]
    assert same_state(rest[1], plain[1]) and same_state(rest[2], plain[2])
    assert rest[3].per_layer.steps == 6


def test_a_replayed_update_makes_the_host_wait_for_nothing():
    """What the host does around a replay (the batch into the graph's buffers, this update's numbers to the
    device, the counts moved on, the gradients zeroed) reads no value of the device: hostsync.HostSyncs, which on a
    CPU counts every value read as a GPU run would wait on it, finds none in two replayed updates."""
    _, _, _, run = per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=2)
    syncs = HostSyncs()
    for _ in range(2):
        micro_batches = [(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), 32) for _ in range(2)]
        with syncs.watch():
            train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches)
    assert syncs.summary() == "none" and run.per_layer.steps == 4


def test_a_stop_within_a_replayed_update_drops_it():
    """A signal before the last micro-batch of a replayed update: nothing updated, no count moved on, the
    accumulated gradients zeroed in place, and the next update replays as the plain run's next."""
    _, _, _, run = per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=3)
    before = copy.deepcopy((run.raw_model.state_dict(), run.per_layer.state_dict()))
    micro_batches = [(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), 32) for _ in range(2)]
    assert train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches, {"signal": "SIGTERM"}) is None
    assert same_state((run.raw_model.state_dict(), run.per_layer.state_dict()), before)
    assert all(not g.any() for g in run.graph.grads) and run.graph.accumulated == 0


def test_per_layer_graph_refusals():
    """What a replayed update cannot do is refused in one line: another number of micro-batches than the
    captured update's, or an optimizer that computes its step sizes only on the host."""
    _, _, _, run = per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=2, accum=2)
    args = SimpleNamespace(grad_clipping=0.0)
    one = [(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), 32)]
    with pytest.raises(ValueError, match="^this update has fewer micro-batches than the captured one: under "
                                         "--cuda_graph every update needs as many$"):
        train.train_step(args, run, one)
    _, _, _, run = per_layer_runs("sltrain", "adam8bit", recorded_capture(), updates=2, accum=1)
    with pytest.raises(ValueError, match="^this update has more micro-batches than the captured one"):
        train.train_step(args, run, one * 2)
    model = LLaMA(config_for("tiny", vocab_size=96))
    per_layer = attach_per_layer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    with pytest.raises(ValueError, match="^AdamW cannot read its step sizes from the device, as a replayed update "
                                         "must: under --cuda_graph --per_layer use --optimizer adamw or adam8bit$"):
        PerLayerGraph(model, per_layer, recorded_capture())


def test_the_recorded_capture_fails_on_a_host_sync_as_a_real_one():
    """The fake capture is held to a real one's rules: .item() inside it fails."""
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="makes the host wait for the device"):
        recorded_capture()(lambda: x.sum().item(), "cpu", warmup=0)


def test_the_recorded_capture_undoes_its_writes_and_replays_them():
    """Capture changes nothing outside; each replay does the recorded work again, with the capture's numbers."""
    x, factor = torch.ones(3), [2.0]
    replay = recorded_capture()(lambda: x.mul_(factor[0]).add_(x.sum()), "cpu", warmup=0)
    assert torch.equal(x, torch.ones(3))
    factor[0] = 5.0  # a number on the host: the replay keeps the capture's
    replay()
    assert torch.equal(x, torch.full((3,), 8.0))
    replay()
    assert torch.equal(x, torch.full((3,), 64.0))


def as_if_on_a_gpu(monkeypatch):
    """train.main with --cuda_graph on this CPU: the flag set after the checks that refuse it off CUDA, and the
    per-layer graph's capture recorded and replayed as a CUDA graph's (recorded_capture). Returns the captures."""
    get_args, captures = train.get_args, []

    def with_graph(argv=None):
        args = get_args([arg for arg in argv if arg != "--cuda_graph"])
        args.cuda_graph = "--cuda_graph" in argv
        return args
    monkeypatch.setattr(train, "get_args", with_graph)
    for graph in (MicroBatchGraph, PerLayerGraph):
        monkeypatch.setattr(train, graph.__name__, functools.partial(graph, capture=recorded_capture(captures)))
    return captures


@pytest.mark.parametrize("optimizer,captured", [
    (("adam8bit", "--per_layer"), 4), (("adam8bit", "--per_layer", "--activation_checkpointing", "--amp"), 4),
    (("adamw",), 2)], ids=["adam8bit_per_layer", "checkpointed_amp", "adamw"])
def test_train_py_with_cuda_graph_stops_resumes_and_ends_as_without(corpus, tmp_path, monkeypatch, optimizer,
                                                                      captured):
    """train.py --cuda_graph, two micro-batches an update, a warm-up then a cosine lr: stopped after three updates
    (--stop_after) and resumed to six, it logs the same losses, learning rates and gradient norms, evaluates the
    same, and ends with the same checkpoint (model and optimizer) as the same run without --cuda_graph, to the bit.
    8-bit per-layer (each run: its first update eager, its second captured as two graphs, the rest replayed), also
    with activation checkpointing (backward recomputes each block's forward inside the graph) and --amp, and AdamW
    (each run: one graph of a micro-batch, captured at the first)."""
    common = ("--optimizer", *optimizer, "--lr", "1e-2", "--warmup_steps", "2")
    train.main(base_args(corpus, tmp_path / "plain", 6, *common))
    captures = as_if_on_a_gpu(monkeypatch)
    graphed = base_args(corpus, tmp_path / "graph", 6, *common, "--cuda_graph")
    train.main([*graphed, "--stop_after", "3"])
    train.main([*graphed, "--resume"])
    keep = lambda rows: [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows]  # noqa: E731
    plain, graph = metrics(tmp_path / "plain"), metrics(tmp_path / "graph")
    assert keep(graph[0]) == keep(plain[0]) and len(graph[0]) == 6
    assert [r["val_loss"] for r in graph[1]] == [r["val_loss"] for r in plain[1]]
    ours, theirs = final_state(tmp_path / "graph"), final_state(tmp_path / "plain")
    assert ours["args"]["cuda_graph"] and not theirs["args"]["cuda_graph"]
    assert same_state(ours["model"], theirs["model"]) and same_state(ours["optimizer"], theirs["optimizer"])
    assert len(captures) == captured


@pytest.mark.parametrize("extra,env,message", [
    (["--cuda_graph", "--optimizer", "galore_adamw", "--per_layer"], {}, "--cuda_graph --per_layer replays each "
     "update, and GaLore's projector is remade on the host every --galore_update_gap updates: drop --cuda_graph, or "
     "use --optimizer adamw or adam8bit"),
    (["--cuda_graph", "--device", "cpu"], {}, "--cuda_graph needs a CUDA GPU; --device is cpu: drop --cuda_graph"),
    (["--cuda_graph"], dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
     "--cuda_graph is for one process: DDP's all-reduce inside a captured backward is not supported here; drop "
     "--cuda_graph under torchrun"),
])
def test_what_cuda_graph_cannot_do_is_refused_before_any_work(corpus, tmp_path, capsys, monkeypatch, extra, env,
                                                              message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path, 4, *extra))
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("method,packed", [("full", False), ("sltrain", False), ("sltrain", True)],
                         ids=["full", "sltrain", "sltrain-packed"])
def test_on_a_gpu_replays_train_as_the_plain_update(method, packed):
    """On CUDA, the real capture: three updates of two micro-batches, float32, close to the plain update's (the same
    kernels; a capture may pick other cuBLAS algorithms). Packed supports are unpacked inside the graph: a capture
    fails on any host sync."""
    results = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = LLaMA(config_for("tiny", method=method, vocab_size=96, packed_support=packed), device="cuda")
        optimizer = train.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
        graph = MicroBatchGraph(model, model.parameters()) if graphed else None
        run = train.Run(model, model, optimizer, scheduler, None, model.config, torch.device("cuda"), 0, 1, graph)
        generator, losses = torch.Generator().manual_seed(1), []
        for _ in range(3):
            micro_batches = [(torch.randint(96, (2, 16), generator=generator),
                              torch.randint(96, (2, 16), generator=generator), 32) for _ in range(2)]
            losses.append(train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches)[0].item())
        results[graphed] = losses, [p.detach().cpu() for p in model.parameters()]
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(results[True][1], results[False][1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("optimizer", ["adamw", "adam8bit"])
def test_on_a_gpu_replayed_per_layer_updates_train_as_the_plain_ones(optimizer, accum):
    """On CUDA, the real capture of per-layer updates (8-bit: the one-kernel step reading its step sizes from the
    device, where Triton runs): four updates, float32, close to the plain per-layer updates'."""
    plain = per_layer_runs("sltrain", optimizer, accum=accum, device="cuda")
    graphed = per_layer_runs("sltrain", optimizer, cudagraph.cuda_graphed, accum=accum, device="cuda")
    assert [row[3] for row in graphed[0]] == [row[3] for row in plain[0]]  # the lr of each update
    for ours, theirs in zip(graphed[0], plain[0]):
        assert ours[:3] == pytest.approx(theirs[:3], rel=1e-4)
    # two micro-batches an update are more GEMMs captured, where a capture may pick other cuBLAS algorithms: on an
    # H200 one B of each run ended 1.7e-5 and 1.4e-5 apart (2026-11-27), where a wrong sum would be an update's size
    atol = 1e-5 if accum == 1 else 1e-4
    apart = {k: (graphed[1][k].double() - plain[1][k].double()).abs().max().item() for k in plain[1]
             if not torch.allclose(graphed[1][k], plain[1][k], atol=atol)}  # the parameters (and supports)
    assert not apart, f"apart by more than {atol}: {apart}"
    assert graphed[3].per_layer.steps == 4
