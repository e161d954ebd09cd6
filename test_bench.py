"""
bench.py's sections and flags at toy sizes on CPU (the suite, which shares its timing, is test_suite.py's).

    python -m pytest -q test_bench.py
"""

import functools
import json
import statistics

import pytest
import torch

import bench
import model
import sample
from test_data import quiet, read_then_stop


@pytest.mark.parametrize("argv,message", [
    (["--suite", "tiny"], "unrecognized arguments: --suite tiny"),  # suite.py's now
    (["--only", "memory"], "invalid choice: 'memory'"),
    (["--size", "61m"], "invalid choice: '61m' (choose from"),
    (["--rounds", "0"], "must be >= 1"),
    (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["--only", "step", "layer", "--device", "cuda"], "--only step times the optimizers on CPU: drop --device cuda"),
    (["--only", "layer", "--size", "60m"], "--size is for the generate, host, inference, model, optimizer sections"),
    (["--only", "generate", "--max_length", "64"], "--max_length is for the inference, model sections"),
    (["--only", "heavy", "--rounds", "3"], "and --only has none of them: drop --rounds"),
    (["--only", "step", "--batch_size", "4"], "drop --batch_size"),
    (["--only", "host", "--quick"], "drop --quick"),
    (["--quick", "--size", "60m"], "--quick picks the tiny model and --size the sizes: pass one of them"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--only", "layer", "--out", "."], "--out . is a folder; pass a file in it"),
    (["--only", "layer", "--out", "README.md"], "--out README.md: the results are JSON, written over any file of that "
                                                "name; pass a name ending in .json"),
    (["--only", "layer", "--out", "README.md/x/y.json"], "README.md/x (Not a directory); pass a file in a folder you "
                                                         "can write"),
    # tried, not read off the permissions, which let root through where the filesystem refuses
    (["--only", "layer", "--out", "/proc/self/results/x.json"], "--out /proc/self/results/x.json: cannot write in "
                                                                "/proc/self/results"),
])
def test_every_flag_is_honored_or_refused(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["bench.py", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_optimizer_tools_run_and_report(monkeypatch, capsys, tmp_path):
    """--only step heavy host: the optimizers alone, outside the default sections; each reports its table, and the
    flags that they take (--size, --rounds) are honored."""
    monkeypatch.setattr(bench, "bench_step", functools.partial(bench.bench_step, size=64, steps=2, warmup=1))
    monkeypatch.setattr("sys.argv", ["bench.py", "--only", "step", "heavy", "host", "--size", "tiny", "--rounds", "2",
                                     "--device", "cpu", "--out", str(tmp_path / "tools.json")])
    bench.main()
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "tools.json").read_text())
    assert set(r) >= {"step", "heavy", "host"} and not set(r) & {"layer", "model", "optimizer", "inference"}
    step = r["step"]
    assert step["rounds"] == 2 and set(step["variants"]) == {"torch.optim.AdamW(foreach=True)", "AdamW", "Adam8bit",
                                                             "Adam8bit(compile=True)"}
    assert step["variants"]["torch.optim.AdamW(foreach=True)"]["ratio"] == 1.0
    assert all(len(v["rounds_ms"]) == 2 and v["ms"] > 0 and v["range"][0] <= v["range"][1]
               for v in step["variants"].values())
    reference = step["variants"]["torch.optim.AdamW(foreach=True)"]["rounds_ms"]
    for name, v in step["variants"].items():  # as every speed figure here: the median of the rounds' own ratios
        ratios = [a / b for a, b in zip(v["rounds_ms"], reference)]
        assert v["ratio"] == pytest.approx(statistics.median(ratios)), name
        assert v["ms"] == pytest.approx(statistics.median(v["rounds_ms"])), name
    heavy = r["heavy"]["cases"]
    assert set(heavy) == set(bench.HEAVY_CASES)
    assert all(v["adam8bit"] <= 10 and v["distance"] <= 0.5 for v in heavy.values()), heavy  # test_optim's bars
    host = r["host"]
    assert host["rounds"] == 2 and [(row["size"], row["method"]) for row in host["rows"]] == [("tiny", "full"),
                                                                                            ("tiny", "sltrain")]
    for row in host["rows"]:
        assert set(row["host"]) == {"AdamW", "Adam8bit", "Adam8bit(compile=True)"}
        assert row["host"]["Adam8bit"][1] > row["host"]["AdamW"][1] > 0  # 8-bit issues more operations per tensor
        assert row["host"]["Adam8bit(compile=True)"][1] is None
    assert "one optimizer step on a 64x64 tensor" in out and "the median of 2 rounds' ratios" in out
    assert "200 steps on heavy-tailed gradients" in out and out.count("max |update|/lr") == 3
    assert "tiny sltrain (" in out and "x: median" not in out


def test_a_bench_whose_reader_is_gone_runs_every_section_and_exits_0(tmp_path):
    """`python bench.py --out bench.json | tee log`, and tee ends: the header line raised a BrokenPipeError before
    any section ran (a line inside a section made it a failed one, and the tables at the end a traceback). The lines
    go nowhere now: every section runs, --out holds them, and the exit is 0."""
    status, err = read_then_stop(["bench.py", "--only", "heavy", "--device", "cpu", "--out", str(tmp_path / "b.json")])
    assert status == 0 and quiet(err), (status, err)
    r = json.loads((tmp_path / "b.json").read_text())
    assert "heavy" in r and "errors" not in r, r.get("errors")



def test_the_model_sections_memory_guard_counts_every_model_it_holds(monkeypatch):
    """The model section holds all its variants at once (six: sltrain/separate too, which the guard left out, about
    10% of the section at 1b): their weights, buffers and optimizer states, counted after a step of each, are within
    the guard's figure (which adds one step's gradients and activations)."""
    class Counted(Exception):
        pass

    def count(steps, *args, **kwargs):  # bench_model's interleave: every variant built and alive by then
        held = 0
        for step in steps.values():
            model, opt = step.__defaults__[:2]
            step()  # the optimizer's state is made at its first step
            held += sum(t.nbytes for t in model.state_dict().values())
            held += sum(t.nbytes for state in opt.state.values() for t in state.values() if torch.is_tensor(t))
        raise Counted(held, len(steps))
    monkeypatch.setattr(bench, "interleave", count)
    with pytest.raises(Counted) as got:
        bench.bench_model("tiny", 2, 32, torch.device("cpu"), torch.float32, 1)
    held, variants = got.value.args
    assert variants == len(bench.MODEL_VARIANTS) == 6
    assert held <= bench.memory_needed("model", "tiny", "float32", 0) < 1.1 * held


def test_the_generate_section_runs_and_reports(monkeypatch, capsys, tmp_path):
    """--only generate: sample.py's generation as trained and merged, each with and without the KV cache, at each
    --size, with --batch_size samples and --rounds rounds (8 new tokens here, where the command generates 128)."""
    original = bench.bench_generate
    monkeypatch.setattr(bench, "bench_generate", lambda size, samples, new, *a: original(size, samples, 8, *a))
    monkeypatch.setattr("sys.argv", ["bench.py", "--only", "generate", "--quick", "--batch_size", "2", "--rounds", "2",
                                     "--out", str(tmp_path / "g.json")])
    bench.main()
    (G,) = json.loads((tmp_path / "g.json").read_text())["generate"]
    assert (G["size"], G["samples"], G["new_tokens"]) == ("tiny", 2, 8)
    assert list(G["variants"]) == ["trained", "trained_cached", "merged", "merged_cached"]
    assert G["variants"]["trained"]["ratio"] == 1.0
    assert all(len(v["rounds_ms"]) == 2 and v["tok_s"] > 0 for v in G["variants"].values())
    assert "generate tiny sltrain, 2 samples, prompt 16 + 8 new tokens" in capsys.readouterr().out


def test_the_generate_sections_memory_guard_counts_what_it_holds(monkeypatch, capsys):
    """--only generate holds the model as trained, its merged copy, a batch's KV cache and the logits of its longest
    window: counted at tiny, they are within the guard's figure; and on a 16 GB machine (faked) 7b is refused in one
    line before anything is built, as the other sections are (it built the 7b model)."""
    class Counted(Exception):
        pass
    caches, logits = [], []
    monkeypatch.setattr(sample, "KVCache", lambda *a: caches.append(model.KVCache(*a)) or caches[-1])

    def count(variants, *args, **kwargs):  # bench_generate's interleave: both models built and alive by then
        runs = [dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__))) for fn in
                variants.values()]
        models = {id(r["model"]): r["model"] for r in runs}
        for m in models.values():
            m.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.nbytes))
        for fn in variants.values():
            fn()
        held = sum(t.nbytes for m in models.values() for t in [*m.parameters(), *m.buffers()])
        raise Counted(held + max(c.k.nbytes + c.v.nbytes for c in caches) + max(logits), len(models))
    monkeypatch.setattr(bench, "interleave", count)
    with pytest.raises(Counted) as got:
        bench.bench_generate("tiny", 2, bench.GENERATE_NEW_TOKENS, torch.device("cpu"), torch.float32, 1)
    held, models = got.value.args
    assert models == 2 and caches, "the model as trained and merged, and a cache"
    need = bench.memory_needed("generate", "tiny", "float32", 2)
    assert held <= need < 1.1 * held, f"held {held / 1e6:.1f} MB, the guard's {need / 1e6:.1f} MB"
    monkeypatch.setattr(bench, "memory_there", lambda device, world=1: (16e9, 0.8, "this machine's 16.0 GB"))
    monkeypatch.setattr(bench, "start", lambda device: pytest.fail("a section started"))
    monkeypatch.setattr(bench, "bench_generate", lambda *a: pytest.fail("the section ran"))
    monkeypatch.setattr("sys.argv", ["bench.py", "--device", "cpu", "--only", "generate", "--size", "7b"])
    with pytest.raises(SystemExit):
        bench.main()
    err = capsys.readouterr().err
    assert "--size 7b: the generate section needs at least" in err and "weights as trained and merged, and 4 " \
        "samples' KV cache and logits), more than 80% of this machine's 16.0 GB; pass a smaller --size or " \
        "--batch_size, or drop the section (--only)" in err, err


def failing_run(monkeypatch, tmp_path, argv, failed):
    """bench.py's command line with argv, which must exit naming what failed: what --out then holds."""
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["bench.py", *argv, "--out", str(out)])
    with pytest.raises(SystemExit, match=f"failed: {failed}"):
        bench.main()
    return json.loads(out.read_text())


def test_single_sections_record_a_failure_and_keep_the_rest(monkeypatch, capsys, tmp_path):
    """A section that raises (an OOM) is recorded, the others run, and --out holds what was done; every --size is run
    by the sections that take sizes (the optimizer's too)."""
    monkeypatch.setattr(bench, "bench_step", functools.partial(bench.bench_step, size=64, steps=2, warmup=1))
    sizes = []
    monkeypatch.setattr(bench, "bench_optimizer", lambda size, *a: sizes.append(size) or dict(
        size=size, params_m=1.0, dtype="float32", variants={}))
    monkeypatch.setattr(bench, "bench_inference", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    r = failing_run(monkeypatch, tmp_path, ["--only", "step", "optimizer", "inference", "--size", "tiny", "60m",
                                            "--rounds", "1"], "inference")
    assert "step" in r and r["errors"]["inference tiny"]["error"] == "RuntimeError: out of memory", r.get("errors")
    assert sizes == ["tiny", "60m"] and [O["size"] for O in r["optimizer"]] == ["tiny", "60m"]
    assert "one optimizer step on a 64x64 tensor" in capsys.readouterr().out


def test_a_section_that_cannot_fit_is_refused_before_any_runs(monkeypatch, capsys):
    """On a 16 GB machine (faked) 7b's model section, its five models with their AdamW states, is refused in one line
    before anything is built, and so is 1b's optimizer section in float32; 7b's host section, at toy width, runs."""
    monkeypatch.setattr(bench, "memory_there", lambda device, world=1: (16e9, 0.8, "this machine's 16.0 GB"))
    monkeypatch.setattr(bench, "start", lambda device: pytest.fail("a section started"))
    for argv, size, section, what in (
            (["--size", "7b", "--only", "model"], "7b", "model", ", and 4 x 256 tokens' activations), more than 80% "
                                                                 "of this machine's 16.0 GB; pass a smaller --size or "
                                                                 "--batch_size, or drop"),
            (["--size", "60m", "--only", "inference", "--batch_size", str(10 ** 9)], "60m", "inference",
             ", and 1000000000 x 256 tokens' activations), more than 80% of this machine's 16.0 GB; pass a smaller "
             "--size or --batch_size, or drop"),  # once it ran, to be killed: the activations were left out
            (["--size", "60m", "1b", "--only", "layer", "optimizer"], "1b", "optimizer",
             "optimizer states), more than 80% of this machine's 16.0 GB; pass a smaller --size, or drop the section "
             "(--only)")):
        monkeypatch.setattr("sys.argv", ["bench.py", "--device", "cpu", *argv])
        with pytest.raises(SystemExit):
            bench.main()
        err = capsys.readouterr().err
        assert f"--size {size}: the {section} section needs at least" in err and what in err, err
    assert bench.memory_needed("model", "60m", "float32", 4) < 12.8e9 < bench.memory_needed("model", "60m", "float32",
                                                                                             400)
    monkeypatch.setattr("sys.argv", ["bench.py", "--device", "cpu", "--only", "model", "--max_length",
                                     str(2 ** 24 + 1)])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--max_length must be at most 2^24 = 16,777,216" in capsys.readouterr().err
    assert bench.memory_needed("optimizer", "60m", "float32") < 12.8e9 < bench.memory_needed("optimizer", "1b",
                                                                                              "float32")
    monkeypatch.setattr(bench, "start", lambda device: (_ for _ in ()).throw(SystemExit("started")))
    monkeypatch.setattr("sys.argv", ["bench.py", "--device", "cpu", "--size", "7b", "--only", "host"])
    with pytest.raises(SystemExit, match="^started$"):
        bench.main()


def test_a_command_refused_by_the_memory_guard_leaves_no_folder_for_its_out(monkeypatch, capsys, tmp_path):
    """--out's folder is made (a file tried in it) by the last check, so that a command refused by an earlier one,
    the memory guard included, leaves no empty folder behind."""
    monkeypatch.setattr(bench, "memory_there", lambda device, world=1: (16e9, 0.8, "this machine's 16.0 GB"))
    out = tmp_path / "new" / "folders" / "results.json"
    monkeypatch.setattr("sys.argv", ["bench.py", "--device", "cpu", "--size", "7b", "--only", "model", "--out",
                                     str(out)])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--size 7b: the model section needs at least" in capsys.readouterr().err
    assert not (tmp_path / "new").exists(), list(tmp_path.rglob("*"))


def test_a_gpu_named_by_index_is_made_current(monkeypatch):
    """CUDA events record on the current device's stream: --device cuda:1 makes cuda:1 current, or every time would
    be of an idle cuda:0."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(str(d)))
    monkeypatch.setattr(bench, "machine", lambda device: (_ for _ in ()).throw(SystemExit("checked")))
    monkeypatch.setattr("sys.argv", ["bench.py", "--device", "cuda:1", "--only", "layer"])
    with pytest.raises(SystemExit, match="checked"):
        bench.main()
    assert chosen == ["cuda:1"]


def test_short_calls_run_back_to_back_in_their_block(monkeypatch):
    """A call shorter than min_block runs as many times in its block as make min_block, and the time is per call; a
    long one runs once. (On a GPU a short call timed alone counts the host's launch latency in front of it.)"""
    clock, calls = [0.0], {"short": 0, "long": 0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def costs(name, seconds):
        def call():
            calls[name] += 1
            clock[0] += seconds
        return call

    times = bench.interleave({"short": costs("short", 0.001), "long": costs("long", 0.05)}, rounds=3,
                             device=torch.device("cpu"), warmup=1, min_block=0.01)
    assert times["short"] == pytest.approx([0.001] * 3) and times["long"] == pytest.approx([0.05] * 3), times
    assert calls == {"short": 1 + 1 + 3 * 10, "long": 1 + 1 + 3}  # warm-up, the timed call that sizes the block, rounds


def test_on_a_gpu_the_hosts_time_to_issue_shows_a_launch_bound_call(monkeypatch):
    """A simulated CUDA stream: the host takes `host` seconds to issue a call, the device `work` to run it, after
    it is issued. CUDA events time the device; issued gets the host's part. A call whose kernels are shorter than
    their launch is timed at the host's pace, and its issued time is then nearly all of it."""
    clock, busy = [0.0], [0.0]  # the host's time; when the device's queue runs empty

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = max(clock[0], busy[0])  # an event completes once the work before it has run

        def elapsed_time(self, end):
            return 1e3 * (end.at - self.at)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: clock.__setitem__(0, max(clock[0], busy[0])))

    def call(host, work):
        def run():
            clock[0] += host
            busy[0] = max(busy[0], clock[0]) + work
        return run
    issued = {}
    times = bench.interleave({"launch_bound": call(1e-4, 1e-5), "compute_bound": call(1e-5, 1e-3)}, rounds=3,
                             device=torch.device("cuda"), warmup=1, min_block=0.01, issued=issued)
    for name, (host, work) in {"launch_bound": (1e-4, 1e-5), "compute_bound": (1e-5, 1e-3)}.items():
        assert times[name] == pytest.approx([max(host, work)] * 3, rel=0.02), (name, times)
        assert issued[name] == pytest.approx([host] * 3), (name, issued)
    assert bench.interleave({"cpu": call(1e-3, 0)}, 1, torch.device("cpu"), issued=issued) and "cpu" not in issued


def test_a_call_timed_at_zero_runs_a_bounded_block(monkeypatch):
    """A timer can read 0 s for one short call (CUDA events resolve ~0.5 µs, perf_counter a clock tick): the block is
    then sized at bench.MAX_CALLS (10,000), not at min_block ÷ 1 ns (ten million calls per round)."""
    calls = [0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: 0.0)  # every call reads as taking no time

    def call():
        calls[0] += 1
    times = bench.interleave({"instant": call}, rounds=1, device=torch.device("cpu"), warmup=1, min_block=0.01)
    assert calls[0] <= 2 + 10_000, f"{calls[0]} calls: warm-up, sizing and one round"
    assert times["instant"] == [0.0]


def test_the_model_section_times_sltrain_with_separate_projections_and_counts_each_steps_operations():
    """bench.py's model section: each method's step, sltrain also with each projection its own call; with the aten
    operations of each step, of which the shared calls issue fewer."""
    r = bench.bench_model("tiny", 1, 8, torch.device("cpu"), torch.float32, rounds=1)
    v = r["variants"]
    assert list(v) == ["full", "lowrank", "relora", "sltrain", "sltrain/separate", "galore"]
    assert all(row["tok_s"] > 0 and row["ops"] > 0 for row in v.values())
    assert v["sltrain/separate"]["ops"] > v["sltrain"]["ops"] > v["full"]["ops"], v


def test_the_host_section_interleaves_its_variants_and_reports_their_spread(monkeypatch, capsys):
    """--only host: each round times one step of every variant (none, AdamW, Adam8bit, compiled), their order
    alternating, and a variant's host time is the median over rounds of its step less the same round's step without
    per-layer updates, with the lowest and highest round beside it. It timed all the rounds of one variant, then all
    of the next, and took each one's best less the plain step's best, which a machine slowing midway shifts."""
    forwards = []
    original = model.LLaMA.forward
    monkeypatch.setattr(model.LLaMA, "forward", lambda self, *a, **k: forwards.append(id(self)) or original(
        self, *a, **k))
    spread = {}
    host = bench.per_layer_host_time("cpu", "tiny", "sltrain", rounds=3, spread=spread)
    switches = sum(a != b for a, b in zip(forwards, forwards[1:]))
    # each round passes through the four models (three switches), timed one after another: 3 until now, in all
    assert switches >= 3 * 3, f"{switches} switches between models: the rounds do not interleave"
    assert set(spread) == set(host) == {"AdamW", "Adam8bit", "Adam8bit(compile=True)"}
    assert all(lo <= host[name][0] <= hi for name, (lo, hi) in spread.items()), (host, spread)
    monkeypatch.setattr(bench, "per_layer_host_time", lambda device, size, method, rounds, spread: spread.update(
        AdamW=(0.5, 1.5)) or {"AdamW": (1.0, 7)})
    bench.report_host(dict(host=bench.bench_host(torch.device("cpu"), ["tiny"], rounds=3)))
    out = capsys.readouterr().out
    assert "the median of 3 rounds [lowest-highest]" in out and "AdamW 1.0 ms [0.5-1.5], 7 ops" in out, out


def test_every_timed_table_says_how_many_rounds_its_ratios_are_of(capsys):
    """The rule of every figure here: ratios side by side, with the number of rounds and their spread. The layer,
    model, optimizer, inference and generate tables printed the spread but not the rounds (7 by default, 3 for
    generate, or --rounds), which only the JSON's rounds_ms held."""
    def variants(*names):
        return {name: dict(ms=2.0, ratio=1.0, range=(0.9, 1.1), rounds_ms=[2.0] * 5, tok_s=1.0, ops=9, weights_gb=0.1,
                           peak_gb=None) for name in names}
    r = dict(layer=dict(shape="8x8", rank=2, delta=0.1, tokens=16, dtype="float32", floor=1.1,
                        variants=variants("dense", "sltrain")),
             model=[dict(size="tiny", batch_size=1, max_length=8, dtype="float32", variants=variants("full"))],
             optimizer=[dict(size="tiny", params_m=1.0, dtype="float32", variants=variants("optim.AdamW"))],
             inference=[dict(size="tiny", batch_size=1, max_length=8, dtype="float32", variants=variants("full"))],
             generate=[dict(size="tiny", samples=1, prompt=16, new_tokens=8, dtype="float32",
                            variants=variants("trained"))])
    bench.report(r)
    headings = [line for line in capsys.readouterr().out.splitlines() if line.split(" ")[0] in r]
    assert len(headings) == 5 and all("5 rounds" in line for line in headings), "\n".join(headings)


def test_the_header_names_the_gpu_it_timed_on(monkeypatch, capsys):
    """The printed header is what a log keeps of the machine: on CUDA it said `cuda` only, so that an H100's figures
    and an H200's read alike; it names the GPU now, as the JSON's machine does."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    result = bench.start(torch.device("cuda"))
    header = capsys.readouterr().out
    assert result["machine"]["gpu"] in header and f"torch {torch.__version__}" in header, header
    bench.start(torch.device("cpu"))
    assert "H100" not in capsys.readouterr().out


def test_a_size_that_fails_costs_its_section_only_that_size(monkeypatch, capsys, tmp_path):
    """--size 350m 1b (CUDA's default) with 1b out of memory: the section's 350m figures, minutes of timing, were
    dropped with it. Each size is recorded as it ends, on --out too, and the failure is the size's."""
    def inference(size, *args):
        if size == "60m":
            raise RuntimeError("out of memory")
        return dict(size=size, batch_size=1, max_length=8, dtype="float32", variants={})
    monkeypatch.setattr(bench, "bench_inference", inference)
    r = failing_run(monkeypatch, tmp_path, ["--only", "inference", "--size", "tiny", "60m", "--rounds", "1", "--device",
                                            "cpu"], "inference 60m")
    assert [I["size"] for I in r["inference"]] == ["tiny"] and list(r["errors"]) == ["inference 60m"], r
    assert "inference tiny, batch 1 x 8" in capsys.readouterr().out
