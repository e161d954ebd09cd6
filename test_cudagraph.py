"""
train.py --cuda_graph (cudagraph.MicroBatchGraph): each micro-batch's forward and backward replayed from one capture.
A CPU has no CUDA graphs, so here the capture is faked the way a real one behaves: its warm-up calls run the
function, its capture does not, and each replay runs it; what is tested is everything around the graph (the static
buffers, the gradients kept and zeroed in place, the eager optimizer), against train.py's plain update to the bit.
The real capture runs where CUDA is (skipped otherwise).

    python -m pytest -q test_cudagraph.py
"""

from types import SimpleNamespace

import pytest
import torch

import train
from cudagraph import MicroBatchGraph
from model import LLaMA, config_for
from test_train import base_args, corpus  # noqa: F401  (the tiny shards and tokenizer, made once per module)


def fake_capture(warmup=2):
    """A capture as CUDA's behaves on the host: warm-up calls that run fn (their gradients are the caller's to drop),
    a capture that runs nothing, and fn itself as the replay."""
    captures = []

    def capture(fn, device):
        captures.append(fn)
        for _ in range(warmup):
            fn()
        return fn
    return capture, captures


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
    capture, captures = fake_capture()
    losses, params, run = runs(method, capture, grad_clipping=grad_clipping)
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
    capture, _ = fake_capture()
    _, _, run = runs("sltrain", capture, updates=1)
    grads = [p.grad for p in run.graph.params]
    before = [p.detach().clone() for p in run.raw_model.parameters()]
    micro_batches = [(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), 32) for _ in range(2)]
    stop = {"signal": "SIGTERM"}
    assert train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches, stop) is None
    assert all(p.grad is g and not g.any() for p, g in zip(run.graph.params, grads))
    assert all(torch.equal(p, b) for p, b in zip(run.raw_model.parameters(), before))


def test_a_micro_batch_of_another_shape_is_refused_in_one_line():
    capture, _ = fake_capture()
    model = LLaMA(config_for("tiny", vocab_size=96))
    graph = MicroBatchGraph(model, model.parameters(), capture)
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


@pytest.mark.parametrize("extra,env,message", [
    (["--cuda_graph", "--optimizer", "adam8bit", "--per_layer"], {}, "--cuda_graph replays a captured backward, and "
     "--per_layer updates inside backward at each update's learning rate, which a replay cannot change: drop one"),
    (["--cuda_graph", "--device", "cpu"], {}, "--cuda_graph needs a CUDA GPU; --device is cpu: drop --cuda_graph"),
    (["--cuda_graph"], {"WORLD_SIZE": "2"}, "--cuda_graph is for one process: DDP's all-reduce inside a captured "
     "backward is not supported here; drop --cuda_graph under torchrun"),
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
@pytest.mark.parametrize("method", ["full", "sltrain"])
def test_on_a_gpu_replays_train_as_the_plain_update(method):
    """On CUDA, the real capture: three updates of two micro-batches, float32, close to the plain update's (the same
    kernels; a capture may pick other cuBLAS algorithms)."""
    results = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = LLaMA(config_for("tiny", method=method, vocab_size=96), device="cuda")
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
