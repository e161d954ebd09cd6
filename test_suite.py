"""
The GPU suite's code at toy sizes on CPU, so that a GPU session spends its minutes measuring, not debugging.

    python -m pytest -q test_suite.py
"""

import glob
import json
import math
import os
import re
import shutil
import sys
import time

import pytest
import torch

import cudagraph
import optim
import suite
from model import LLaMA, config_for
from test_cudagraph import recorded_capture
from test_data import quiet, read_then_stop
from test_train import corpus  # noqa: F401  (the tiny shards and tokenizer, made once per module)


def test_tiny_suite_runs_every_section_and_reports(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "tiny.json")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the deterministic variants set it: unset after
    r = suite.run_suite("tiny", torch.device("cpu"), out=out)
    assert not torch.are_deterministic_algorithms_enabled()  # the variants' mode was theirs alone
    s = suite.SUITES["tiny"]
    sections = ["memory", "layer", "model", "optimizer", "amp", "model_compiled", "profile", "inference", "width",
                "memory_galore"]
    assert list(r["seconds"]) == sections and "errors" not in r
    assert "program: skipped, it trains on C4 shards: pass --data_dir" in capsys.readouterr().out  # said, not silent
    assert [L["shape"] for L in r["layer"]] == ["64x64", "176x64", "64x176"]  # d×d, up/gate ffn×d, down d×ffn
    for L in r["layer"]:
        assert L["floor"] == 1 + 4 * L["rank"] / (3 * s["tokens"])
        v = L["variants"]
        assert set(v) == {"dense", "sltrain", "merge", "form", "scatter", "factor_grads", "gather", "sltrain_packed",
                          "unpack"}
        assert all(row["ms"] > 0 for row in v.values()) and v["sltrain"]["ratio"] > 0
        parts = v["form"]["ms"] + v["scatter"]["ms"]
        assert L["accounted_ms"] == v["dense"]["ms"] + 2 * parts + v["factor_grads"]["ms"] + v["gather"]["ms"]
    for key, methods in (("model", suite.PRETRAINING), ("model_compiled", ("full", "lowrank", "sltrain"))):
        v = r[key]["variants"]
        assert r[key]["compiled"] is (key == "model_compiled") and v["full/adamw"]["ratio"] == 1.0
        assert set(v) == {f"{m}/{o}" for m in methods for o in ("adamw", "adam8bit/per_layer")} | {
            "sltrain/adamw/separate"} | ({"sltrain/adam8bit/per_layer/packed", "full/adamw/deterministic",
                                          "sltrain/adam8bit/per_layer/deterministic"} if key == "model" else set())
        assert all(x["tok_s"] > 0 for x in v.values())
        # eager, the host's time for each step, timed on a few tokens; compiled, not (another shape, another graph)
        assert all(x["host_ms"] > 0 and x["host_share"] == x["host_ms"] / x["ms"] if key == "model" else
                   "host_ms" not in x for x in v.values()), v
    assert list(r["profile"]) == ["full/adamw", "sltrain/adamw", "full/adamw/compiled", "sltrain/adamw/compiled"]
    for row in r["profile"].values():  # each step's heaviest operators (kernels on a GPU), by name
        times = [ms for _, ms, _ in row["top"]]
        assert row["ms"] > 0 and 0 < sum(times) <= row["device_ms"] * (1 + 1e-9) and times == sorted(times)[::-1]
    mem = r["memory"]["tiny"]
    assert set(mem["settings"]) == {"full/adamw", "full/adam8bit/per_layer", "lowrank/adam8bit/per_layer",
                                    "sltrain/adam8bit/per_layer", "sltrain/adam8bit/per_layer/packed",
                                    "sltrain/adam8bit/per_layer/accumulation=2"}
    # packed supports: the parameters and buffers counted, a byte a value and a block where int32 takes 4
    flat, packed = (mem["settings"][k]["counted_gb"]["param"] for k in ("sltrain/adam8bit/per_layer",
                                                                        "sltrain/adam8bit/per_layer/packed"))
    nnz = LLaMA(config_for("tiny", method="sltrain"), device="meta").num_params()["sparse"]
    assert flat - packed == pytest.approx((3 * nnz - 2 * (4 * -(-64 * 64 // 255) + 3 * -(-64 * 176 // 255))) / 1e9)
    # accumulating two micro-batches an update keeps every gradient between backwards, per-layer updates or not
    accumulating, sltrain = (mem["settings"][k]["counted_gb"] for k in ("sltrain/adam8bit/per_layer/accumulation=2",
                                                                        "sltrain/adam8bit/per_layer"))
    assert accumulating["grad"] > 2 * sltrain["grad"] and accumulating["train"] > sltrain["train"]
    galore = r["memory_galore"]["tiny"]  # GaLore's row in a section of its own, run last, against the same full AdamW
    assert list(galore["settings"]) == ["galore/adam8bit/per_layer"] and galore["paper_reduction"] is None
    assert galore["reduction"] == 1 - galore["settings"]["galore/adam8bit/per_layer"]["gb"] / \
        mem["settings"]["full/adamw"]["gb"]
    for name, row in [*mem["settings"].items(), *galore["settings"].items()]:
        parts = row["counted_gb"]  # the counted parts of the same run agree with the estimate to the byte's rounding
        assert parts["train"] == pytest.approx(row["estimate_gb"], rel=1e-3), (name, row)
        # the real peak (here the CPU profiler's): at the end of forward the activations are all alive, and without
        # per-layer updates the gradients at the end of backward, each beside the parameters and optimizer state
        alive = parts["param"] + parts["optim"] + max(parts["act"], parts["grad"])
        assert alive <= parts["train"] and alive <= row["gb"], (name, row)
        assert row["base_gb"] == 0  # on CPU the profiler counts from its start; on CUDA the BLAS workspaces
        assert row["vs_estimate"] == pytest.approx((row["gb"] - row["base_gb"]) / row["estimate_gb"] - 1)
    assert 0 < mem["reduction"] < 1
    assert set(r["optimizer"]["variants"]) == {"torch.optim.AdamW", "optim.Adam8bit", "optim.Adam8bit(compile=True)"}
    small = optim.Adam8bit([torch.nn.Parameter(torch.zeros(1))]).defaults["min_8bit_size"]
    assert any(math.prod(shape) >= small for shape in s["optimizer_shapes"]), "one tensor has 8-bit state, as at 7b"
    for host in r["optimizer"]["host_ms_per_update"].values():  # per-layer updates: the host's time, and its ops
        assert set(host) == {"AdamW", "Adam8bit", "Adam8bit(compile=True)"}
        # a difference of two timings: finite, but under load it may come out at or below zero at this size
        assert all(math.isfinite(ms) for ms, _ in host.values()), host
        assert host["Adam8bit"][1] > host["AdamW"][1] > 0 and host["Adam8bit(compile=True)"][1] is None
    assert set(r["inference"][0]["variants"]) == {"full", "sltrain", "sltrain_merged"}
    for method, v in r["width"]["methods"].items():  # each method at each MLP width, ÷ its first (1b's own, on a GPU)
        assert list(v) == ["170", "176"] and v["170"]["ratio"] == 1.0 and v["176"]["ms"] > 0, (method, v)
    for name, v in r["amp"]["settings"].items():  # --amp beside pure bf16 (on CPU: float32), side by side
        assert v["bf16"]["ratio"] == 1.0 and v["amp"]["tok_s"] > 0 and v["amp"]["peak_gb"] is None, name
        # each beside the estimate of its own setting: float32 here, and under autocast a mixed one
        assert v["bf16"]["estimate_gb"] > 0 and v["amp"]["estimate_gb"] not in (0, v["bf16"]["estimate_gb"]), name
    on_disk = json.load(open(out))
    assert all(k in on_disk for k in sections) and list(on_disk["seconds"]) == sections
    suite.report_suite(on_disk)  # the tables print from the JSON alone
    assert "memory_galore tiny, batch 1: galore 8-bit per-layer vs full AdamW -" in capsys.readouterr().out


def test_a_profile_names_the_heaviest_operators_of_a_step_with_their_calls_per_step(capsys):
    a = torch.randn(768, 768)

    def step():  # three products, whose time is aten::mm's (ms each), and additions of a row (µs, even on a busy
        for _ in range(3):  # machine: on 384² matrices a preempted addition outweighed the products)
            (a @ a)[0].add_(1)
    row = suite.profile_step(step, torch.device("cpu"), steps=2, top=4)
    (name, ms, calls), *rest = row["top"]
    assert name == "aten::mm" and calls == 3 and ms > 0 and len(rest) == 3 and row["kernels"] > 4
    assert ms <= row["device_ms"] <= 2 * row["ms"]  # per step; the profiler's own time is not an operator's
    suite.report_profile({"profile": {"step": row}})
    assert "aten::mm" in capsys.readouterr().out


def test_a_failing_section_is_recorded_and_the_others_run(monkeypatch, tmp_path, capsys):
    def broken(*args):
        raise RuntimeError("CUDA out of memory (a test)")
    monkeypatch.setattr(suite, "suite_optimizer", broken)
    out = str(tmp_path / "suite.json")
    monkeypatch.setattr("sys.argv", ["suite.py", "tiny", "--only", "layer", "optimizer", "inference", "--out", out])
    with pytest.raises(SystemExit) as stopped:  # after writing the JSON, the command fails, naming the section
        suite.main()
    assert "failed: optimizer" in str(stopped.value.code)
    r = json.load(open(out))
    assert r["errors"]["optimizer"]["error"] == "RuntimeError: CUDA out of memory (a test)", r["errors"]
    assert any("in broken" in line for line in r["errors"]["optimizer"]["traceback"])
    assert "optimizer" not in r and r["layer"] and r["inference"]  # the section after the failed one ran too
    assert list(r["seconds"]) == ["layer", "optimizer", "inference"] and r["command"].startswith("python suite.py tiny")
    printed = capsys.readouterr().out
    assert "optimizer failed" in printed and printed.index("layer: SLTrain") < printed.index("optimizer failed")


def test_a_suite_whose_reader_is_gone_runs_every_section_and_exits_0(tmp_path):
    """`python suite.py tiny --out gpu.json | tee log`, and tee ends: the header line raised a BrokenPipeError before
    any section ran (a reader that stopped later made a section's table a failed section, "width (table)", and the
    line after it a traceback). The lines go nowhere now: every section runs, and the exit is 0."""
    status, err = read_then_stop(["suite.py", "tiny", "--only", "width", "--out", str(tmp_path / "s.json")])
    assert status == 0 and quiet(err), (status, err)
    r = json.loads((tmp_path / "s.json").read_text())
    assert "width" in r and "errors" not in r, r.get("errors")


def test_each_section_is_on_disk_before_the_next_runs(monkeypatch, tmp_path):
    out, seen = str(tmp_path / "suite.json"), {}

    def interrupted(*args):  # what a kill mid-section leaves: the file as it is now
        seen.update(json.load(open(out)))
        raise KeyboardInterrupt
    monkeypatch.setattr(suite, "suite_optimizer", interrupted)
    with pytest.raises(KeyboardInterrupt):  # not recorded as a section's error: it stops the run
        suite.run_suite("tiny", torch.device("cpu"), ["layer", "optimizer", "inference"], out=out)
    assert seen["layer"] and list(seen["seconds"]) == ["layer"], seen
    assert json.load(open(out)) == seen  # nothing after the interrupt, the earlier section kept


def killed_on_the_second(monkeypatch, tmp_path, section, function):
    """Run the tiny suite's section with its second call of suite.function stopped as a kill would; -> what --out
    holds of it."""
    out, real, calls = str(tmp_path / "suite.json"), getattr(suite, function), []

    def killed(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(suite, function, killed)
    with pytest.raises(KeyboardInterrupt):
        suite.run_suite("tiny", torch.device("cpu"), [section], out=out)
    return json.load(open(out))[section]


def test_a_long_section_keeps_its_finished_part_on_disk(monkeypatch, tmp_path):
    """The memory section saves after each setting: a kill during the second leaves the first on disk."""
    saved = killed_on_the_second(monkeypatch, tmp_path, "memory", "measure")["tiny"]
    assert list(saved["settings"]) == ["full/adamw"] and saved["settings"]["full/adamw"]["gb"] > 0, saved
    assert saved["reduction"] is None  # the SLTrain row was not measured yet
    suite.report_memory({"memory": {"tiny": saved}})  # a partial section still prints


@pytest.mark.parametrize("key", ["memory", "memory_galore"])
def test_the_memory_table_names_its_section_at_every_size(capsys, key):
    """Each size's heading names the section it is of, the second size's too (a loop over the reductions once
    took over the name: '\'reduction_at_paper_delta_packed 1b, batch 1: ...')."""
    row = dict(gb=1.5, base_gb=0.1, estimate_gb=1.4, vs_estimate=0.0, counted_gb={})
    sizes = {size: dict(settings={"full/adamw": row}, reduction=0.5, paper_reduction=None, reduction_packed=0.6)
             for size in ("350m", "1b", "7b")}
    suite.report_memory({key: sizes}, key)
    heads = [line.split(",")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert heads == [f"{key} {size}" for size in sizes], heads


@pytest.mark.parametrize("section", ["model", "amp", "optimizer"])
def test_the_timed_sections_keep_their_finished_part_on_disk(monkeypatch, tmp_path, section):
    """A kill after model's first round keeps that round's figures; after amp's first setting, that setting's; in
    optimizer's host times (a model built per method), the step times."""
    out, interleave, calls = str(tmp_path / "suite.json"), suite.interleave, []

    def killed(*args, after_round=lambda times: None, **kwargs):
        calls.append(args)
        if section == "amp" and len(calls) == 2:
            raise KeyboardInterrupt

        def then(times):
            after_round(times)
            if section == "model":
                raise KeyboardInterrupt
        return interleave(*args, after_round=then, **kwargs)
    monkeypatch.setattr(suite, "interleave", killed)
    monkeypatch.setattr(suite, "per_layer_host_time", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        suite.run_suite("tiny", torch.device("cpu"), [section], out=out)
    saved = json.load(open(out))[section]
    if section == "model":
        assert saved["rounds"] == 1 and saved["variants"]["sltrain/adamw"]["ratio"] > 0, saved
    elif section == "amp":
        assert list(saved["settings"]) == ["full/adamw"] and saved["settings"]["full/adamw"]["amp"]["tok_s"] > 0
    else:
        assert saved["variants"]["optim.Adam8bit"]["ratio"] > 0 and saved["host_ms_per_update"] == {}, saved


def test_the_width_section_keeps_each_finished_method_on_disk(monkeypatch, tmp_path):
    """A kill (the plan's timeout -s KILL) or a failure while SLTrain's models are timed keeps full rank's figures,
    timed before them, on disk: the section saves after each method."""
    saved = killed_on_the_second(monkeypatch, tmp_path, "width", "interleave")
    assert list(saved["methods"]) == ["full"] and saved["methods"]["full"]["176"]["ms"] > 0, saved
    suite.report_width({"width": saved})  # a partial section still prints


def test_memory_adds_an_sltrain_row_at_the_appendix_delta_where_a_size_trains_at_another(monkeypatch, capsys):
    """7b trains at delta 0.05 but the appendix counts its memory at 0.03: the section measures that too, after the
    paper's settings, with its own estimate and reduction; then SLTrain with packed supports (train.py
    --packed_support) at each delta, which the paper's 7b figure needs. Here tiny (0.03) stands in, at 0.05;
    measure stands in for the real one (test_tiny_suite_runs_every_section_and_reports runs that), the peak its
    estimate plus a tenth."""
    calls = []

    def measured(size, method, rank, delta, optimizer, per_layer, batch_size, max_length, steps, device,
                 accumulation=1, packed=False):
        calls.append((method, delta))
        train = suite.estimate(size, method, rank, delta, "packed" if packed else "int32", optimizer, per_layer,
                               batch_size, max_length, accumulation=accumulation)
        parts = dict.fromkeys(("param", "optim", "grad", "act"), 0)
        return dict(peak=1.1e9 * train["train_gb"], base=0, train=1e9 * train["train_gb"], **parts), None
    monkeypatch.setattr(suite, "measure", measured)
    monkeypatch.setattr(suite, "PAPER_MEMORY_DELTA", 0.05)
    mem = suite.run_suite("tiny", torch.device("cpu"), ["memory"])["memory"]["tiny"]
    rows = mem["settings"]
    assert list(rows) == ["full/adamw", "sltrain/adam8bit/per_layer", "full/adam8bit/per_layer",
                          "lowrank/adam8bit/per_layer", "sltrain/adam8bit/per_layer/delta=0.05",
                          "sltrain/adam8bit/per_layer/packed", "sltrain/adam8bit/per_layer/delta=0.05/packed",
                          "sltrain/adam8bit/per_layer/accumulation=2"]
    assert calls[4] == calls[6] == ("sltrain", 0.05) and [d for _, d in calls].count(None) == 6
    for at_delta in ("", "/delta=0.05"):  # packed supports: less than int32 indices, at either delta
        flat, packed = (rows[f"sltrain/adam8bit/per_layer{at_delta}{form}"] for form in ("", "/packed"))
        assert packed["estimate_gb"] < flat["estimate_gb"] and packed["vs_estimate"] == pytest.approx(0.1)
    assert mem["reduction_packed"] > mem["reduction"] and \
        mem["reduction_at_paper_delta_packed"] > mem["reduction_at_paper_delta"]
    at, default, full = (rows[k] for k in ("sltrain/adam8bit/per_layer/delta=0.05", "sltrain/adam8bit/per_layer",
                                           "full/adamw"))
    assert at["estimate_gb"] > default["estimate_gb"] and at["vs_estimate"] == pytest.approx(0.1)
    assert mem["reduction_at_paper_delta"] == pytest.approx(1 - at["estimate_gb"] / full["estimate_gb"])
    assert mem["reduction"] == pytest.approx(1 - default["estimate_gb"] / full["estimate_gb"])
    suite.report_memory({"memory": {"tiny": mem}})
    out = capsys.readouterr().out
    assert f"sltrain at delta 0.05, the commented-out 7b count: -{100 * mem['reduction_at_paper_delta']:.1f}%" in out
    assert f"sltrain with packed supports (--packed_support): -{100 * mem['reduction_packed']:.1f}%" in out
    assert f"sltrain at delta 0.05, packed supports: -{100 * mem['reduction_at_paper_delta_packed']:.1f}%" in out
    monkeypatch.setattr(suite, "PAPER_MEMORY_DELTA", 0.03)  # tiny's own: no extra rows
    mem = suite.run_suite("tiny", torch.device("cpu"), ["memory"])["memory"]["tiny"]
    assert len(mem["settings"]) == 6 and "reduction_at_paper_delta" not in mem and "reduction_packed" in mem
    alone = suite.run_suite("tiny", torch.device("cpu"), ["memory_galore"])["memory_galore"]["tiny"]
    assert list(alone["settings"]) == ["galore/adam8bit/per_layer"] and alone["reduction"] is None  # no full row
    assert calls[-1] == ("galore", None)


def test_each_figure_has_the_issues_target_beside_it_in_the_json_and_its_table(monkeypatch, capsys):
    """Issue 13 gives each figure a target: the layer within 1.5% of its floor at 1b and 7b (5% at 350m), SLTrain's
    train-step throughput 0.98 of full rank's, each memory figure within 5% of its estimate and the reduction at
    least the paper's, the 8-bit step 1.5 times fused AdamW's at most. Each is in the JSON beside its figure, with
    whether it is met, and in the table (they were in BENCHMARKS.md's prose alone). Tiny stands in for the paper's
    sizes; measure (the peak its estimate plus a fiftieth for SLTrain's rows, a tenth for the others) and the host
    times stand in. Every variant runs, and its times are then set to fall on both sides of each target, so that
    a verdict fixed at met, or at missed, fails here whatever this machine's timings (the CPU's own fell on one
    side of the 8-bit step's target: a verdict always "missed" passed)."""
    def measured(size, method, rank, delta, optimizer, per_layer, batch_size, max_length, steps, device,
                 accumulation=1, packed=False):
        train = suite.estimate(size, method, rank, delta, "packed" if packed else "int32", optimizer, per_layer,
                               batch_size, max_length, accumulation=accumulation)["train_gb"]
        over = 1.02 if method == "sltrain" else 1.1
        return dict(peak=over * 1e9 * train, base=0, **dict.fromkeys(("param", "optim", "grad", "act", "train"), 0)), \
            None
    layers, interleave = [], suite.interleave

    def straddling(variants, *args, **kwargs):  # the real calls; then the same times, or 10x, as the reference's
        times = interleave(variants, *args, **kwargs)
        if "dense" in times and "sltrain" in times:  # every other projection shape misses the layer's target
            layers.append(None)
            times["sltrain"] = [t * (10 if len(layers) % 2 == 0 else 1) for t in times["dense"]]
        if "full/adamw" in times:  # sltrain/adamw meets the model's target, sltrain/adam8bit/per_layer misses it
            times["sltrain/adamw"] = list(times["full/adamw"])
            times["sltrain/adam8bit/per_layer"] = [10 * t for t in times["full/adam8bit/per_layer"]]
        if "torch.optim.AdamW" in times:  # the first 8-bit step meets the optimizer's target, the others miss it
            for i, name in enumerate(k for k in times if "Adam8bit" in k):
                times[name] = [t * (1 if i == 0 else 10) for t in times["torch.optim.AdamW"]]
        return times
    monkeypatch.setattr(suite, "measure", measured)
    monkeypatch.setattr(suite, "interleave", straddling)
    monkeypatch.setattr(suite, "per_layer_host_time", lambda *args: {})
    monkeypatch.setitem(suite.LAYER_TARGET, "tiny", 0.05)
    monkeypatch.setitem(suite.PAPER_REDUCTION, "tiny", 0.5)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the deterministic variants set it
    r = suite.run_suite("tiny", torch.device("cpu"), ["memory", "layer", "model", "optimizer"])
    assert "errors" not in r, r.get("errors")
    out = capsys.readouterr().out
    for L in r["layer"]:  # each of the size's projection shapes
        assert L["target"] == 0.05 and L["meets_target"] == (L["variants"]["sltrain"]["ratio"] <= L["floor"] * 1.05)
    assert [L["meets_target"] for L in r["layer"]][:2] == [True, False], [L["meets_target"] for L in r["layer"]]
    assert "of floor, target +5.0% met" in out and "of floor, target +5.0% MISSED" in out
    M = r["model"]
    assert M["target"] == 0.98 and M["paper"] == 0.945 and list(M["vs_full"]) == ["sltrain/adamw",
                                                                                    "sltrain/adam8bit/per_layer"]
    assert all(t["meets_target"] == (t["ratio"] >= 0.98) for t in M["vs_full"].values()), M["vs_full"]
    assert [t["meets_target"] for t in M["vs_full"].values()] == [True, False], M["vs_full"]
    assert "target: sltrain ÷ full with the same optimizer x0.98 or more (paper x0.945): sltrain/adamw x" in out
    mem = r["memory"]["tiny"]
    assert mem["estimate_target"] == 0.05 and mem["meets_paper"] == (mem["reduction"] >= 0.5)
    for name, row in mem["settings"].items():  # SLTrain's 2% over, the others 10%
        assert row["within_estimate_target"] is name.startswith("sltrain"), (name, row)
    assert "(+10.0% vs estimate, target ±5% MISSED)" in out and "(+2.0% vs estimate, target ±5% met)" in out
    assert "(target: at least the paper's," in out
    for paper, met in ((mem["reduction"] - 0.01, True), (mem["reduction"] + 0.01, False)):  # on either side of it
        monkeypatch.setitem(suite.PAPER_REDUCTION, "tiny", paper)
        suite.report_memory({"memory": {"tiny": suite.run_suite("tiny", torch.device("cpu"), ["memory"])["memory"]
                                        ["tiny"]}})
        assert f"(target: at least the paper's, {'met' if met else 'MISSED'})" in capsys.readouterr().out, paper
    O = r["optimizer"]
    assert O["target"] == 1.5 and set(O["meets_target"]) == {k for k in O["variants"] if "Adam8bit" in k}
    assert all(met == (O["variants"][k]["ratio"] <= 1.5) for k, met in O["meets_target"].items())
    assert list(O["meets_target"].values())[0] and not all(O["meets_target"].values()), O["meets_target"]
    assert "(target for the 8-bit step x1.5 or less)" in out


def test_the_model_section_times_the_issues_pairs_at_the_papers_micro_batch(monkeypatch, capsys):
    """The issue's throughput target is at the paper's per-GPU micro-batch (350m: 128, its appendix's table and the
    authors' script), twice the section's 64 (which every GPU session has measured at): full and SLTrain, AdamW and
    8-bit per-layer, are timed there too, alone, after the other variants are freed. Tiny: 2 beside 1."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the deterministic variants set it
    tiny = suite.SUITES["tiny"]
    assert suite.SUITES["gpu"]["paper_batch"] == 128 and tiny["paper_batch"] == 2
    batches = []
    train_step = suite.train_step
    monkeypatch.setattr(suite, "train_step", lambda *args, **kw: batches.append(args[4]) or train_step(*args, **kw))
    r = suite.suite_model(tiny, torch.device("cpu"), torch.float32, False)
    paper = r["paper_batch"]
    assert list(paper["variants"]) == ["full/adamw", "sltrain/adamw", "full/adam8bit/per_layer",
                                       "sltrain/adam8bit/per_layer"] and paper["batch_size"] == 2, paper
    assert batches[-4:] == [2] * 4 and set(batches[:-4]) == {1}
    for row in paper["variants"].values():  # tokens/s at the group's own batch
        assert row["tok_s"] == pytest.approx(2 * tiny["max_length"] / (row["ms"] / 1e3))
    assert paper["variants"]["full/adamw"]["ratio"] == 1.0 and paper["target"] == 0.98
    suite.report_model({"model": r})
    tail = capsys.readouterr().out.split("at the paper's per-GPU micro-batch, 2 sequences, alone")[1].splitlines()
    assert [line.split()[0] for line in tail[1:5]] == list(paper["variants"])


def test_the_separate_variant_calls_each_projection_on_its_own():
    """model's sltrain/adamw/separate differs from sltrain/adamw in that alone: the same GEMMs, and more operations
    for the host, each projection in an autograd call of its own."""
    from bench import ops_by_name
    from test_sllinear import gemm_count
    ops = [ops_by_name(suite.train_step("tiny", "sltrain", "adamw", False, 1, 8, torch.device("cpu"), torch.float32,
                                        fuse=fuse)) for fuse in (True, False)]
    assert gemm_count(ops[0]) == gemm_count(ops[1]) and sum(ops[0].values()) < sum(ops[1].values()), ops


def test_the_kernel_is_also_timed_at_other_blocks_per_program(monkeypatch, capsys):
    """Where the one-kernel 8-bit step runs (here: told it can, its launch the eager update), the optimizer section
    times it at its default blocks per program and at each of KERNEL_ROWS, each step launched at its own, and leaves
    the default as it was."""
    import adam8bit_kernel
    default, seen = adam8bit_kernel.ROWS, []
    monkeypatch.setattr(adam8bit_kernel, "why_not", lambda device, dtype, block_size: None)
    monkeypatch.setattr(adam8bit_kernel, "adam8bit_",
                        lambda *a: seen.append(adam8bit_kernel.ROWS) or optim._adam8bit_(*a))
    monkeypatch.setattr(suite, "per_layer_host_time", lambda device, size, method: {})
    result = suite.suite_optimizer(suite.SUITES["tiny"], torch.device("cpu"), torch.float32)
    steps = result["variants"]
    timed = [f"optim.Adam8bit(fused=True), ROWS={rows}" for rows in suite.KERNEL_ROWS]
    assert list(steps)[3:] == ["optim.Adam8bit(fused=True)", *timed] and all(steps[k]["ms"] > 0 for k in timed)
    assert set(seen) == {default, *suite.KERNEL_ROWS} and default not in suite.KERNEL_ROWS
    assert adam8bit_kernel.ROWS == default
    # and the host's time to issue one launch, beside an aten operation's and a one-tensor step's
    calls = result["host_us_per_call"]
    assert list(calls) == ["aten op (add_)", "kernel launch", "Adam8bit.step, one tensor"] and min(calls.values()) > 0
    launches = len(seen)
    suite.host_us_per_call(torch.device("cpu"), torch.float32, calls=7)
    assert len(seen) - launches == 2 * (3 * (1 + 7)) + 1  # the launches timed, the step's included, and the first
    suite.report_suite_optimizer(dict(optimizer=result))
    assert "host time per call (4096 entries): aten op (add_) " in capsys.readouterr().out


def test_the_model_section_also_times_the_kernel_with_a_launch_per_tensor(monkeypatch):
    """Where the one-kernel step runs (here: told it can, its launch the eager update), sltrain's 8-bit per-layer
    step is also timed with a launch per tensor (optim.KERNEL_RUN = 0) beside its runs, side by side, and the
    setting is back to its default after each call."""
    import adam8bit_kernel
    default, seen = optim.KERNEL_RUN, set()
    monkeypatch.setattr(adam8bit_kernel, "why_not", lambda device, dtype, block_size: None)
    monkeypatch.setattr(adam8bit_kernel, "adam8bit_", lambda *a: seen.add(optim.KERNEL_RUN) or optim._adam8bit_(*a))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the deterministic variants set it: unset after
    rows = suite.suite_model(suite.SUITES["tiny"], torch.device("cpu"), torch.float32, False)["variants"]
    # the tiny suite's 12 (test_tiny_suite_runs_every_section_and_reports), the two unfused and this one
    assert rows["sltrain/adam8bit/per_layer/launch_per_tensor"]["ms"] > 0 and len(rows) == 15, list(rows)
    assert seen == {0, default} and optim.KERNEL_RUN == default and default > 0


def test_only_runs_its_sections_in_the_suites_order(monkeypatch):
    """--only memory_galore memory runs memory first, as the whole suite does: GaLore's reduction is against the
    memory section's full AdamW, which must be measured by then."""
    def measured(size, method, rank, delta, optimizer, per_layer, batch_size, max_length, steps, device,
                 accumulation=1, packed=False):
        train = suite.estimate(size, method, rank, delta, "packed" if packed else "int32", optimizer, per_layer,
                               batch_size, max_length, accumulation=accumulation)
        parts = dict.fromkeys(("param", "optim", "grad", "act"), 0)
        return dict(peak=1e9 * train["train_gb"], base=0, train=1e9 * train["train_gb"], **parts), None
    monkeypatch.setattr(suite, "measure", measured)
    r = suite.run_suite("tiny", torch.device("cpu"), ["memory_galore", "memory"])
    assert list(r["seconds"]) == ["memory", "memory_galore"], list(r["seconds"])
    assert r["memory_galore"]["tiny"]["reduction"] is not None, r["memory_galore"]


def test_a_section_named_twice_runs_once(monkeypatch):
    """--only inference inference (or a section repeated in a longer list) measures it once: on a GPU a second run
    of memory or model is minutes of the session's device time for figures the first already wrote."""
    runs = []
    monkeypatch.setattr(suite, "bench_inference", lambda *args: runs.append(args) or {})
    r = suite.run_suite("tiny", torch.device("cpu"), ["inference", "width", "inference"])
    assert len(runs) == len(suite.SUITES["tiny"]["inference_sizes"]) and list(r["seconds"]) == ["inference", "width"]


def test_tiny_program_trains_resumes_and_has_no_host_sync(corpus, tmp_path, capsys):  # noqa: F811
    r = suite.run_suite("tiny", torch.device("cpu"), ["program"], *corpus, out_dir=str(tmp_path))["program"]
    assert r["straight"]["loss_falls"], r["straight"]
    steps = suite.SUITES["tiny"]["program"]["steps"]  # the signal goes at half way: the run must stop before the end
    assert r["sigterm_resume"]["exit_code"] == 0 and steps // 2 <= r["sigterm_resume"]["stopped_at"] < steps
    assert r["sigterm_resume"]["val_loss_diff"] == 0.0  # exact on CPU
    assert r["sigterm_resume"]["stop"].startswith("stopped by SIGTERM"), r["sigterm_resume"]
    assert r["sync_debug"]["line"] == "sync_debug: 2 updates between log steps watched; host syncs: none"
    assert r["torchrun"]["ok"] and r["torchrun"]["backend"] == "gloo", r["torchrun"]  # on a GPU: cpu:gloo,cuda:nccl
    assert r["compile"]["ok"] and r["compile"]["last_loss"] < r["straight"]["first_loss"]
    # CUDA's own check (on CPU: none), of update 3 alone: the first compiles, and on a GPU autotunes, which syncs
    line = "sync_debug: 1 update between log steps watched; host syncs: none"
    assert r["compile"]["sync_debug"] == line, r["compile"]
    # on this CPU the default 8-bit step is the eager one, which off asks for: the two runs are the same run
    assert r["kernel"]["step"].startswith("8-bit step: eager (no kernel: ") and \
        r["kernel"]["step_off"] == "8-bit step: eager (no kernel: --adam8bit_kernel off)", r["kernel"]
    assert r["kernel"]["max_loss_diff"] == 0.0 and r["kernel"]["val_loss_diff"] == 0.0, r["kernel"]
    short = suite.SUITES["tiny"]["program"]["short"]  # every update of the two runs, compared
    assert r["kernel"]["loss_diffs"] == [[step, 0.0] for step in range(1, short + 1)], r["kernel"]
    for name in ("cuda_graph", "cuda_graph_per_layer"):  # said in their rows
        assert r[name] == {"skipped": "train.py --cuda_graph needs a CUDA GPU"}
    exact = r["deterministic"]  # the run and the same run resumed half way: the same losses, update by update
    assert exact["stopped_at"] == short // 2 and exact["tail"].startswith("done: ")
    assert exact["loss_diffs"] == [[step, 0.0] for step in range(1, short + 1)] and exact["val_loss_diff"] == 0.0
    print(r["compile"])
    suite.report_suite({"program": r})


def test_a_deterministic_variant_steps_under_the_mode_and_leaves_it_off(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []
    step = suite.deterministic_step(lambda *a: seen.append((torch.are_deterministic_algorithms_enabled(),
                                                           os.environ.get("CUBLAS_WORKSPACE_CONFIG"), a)))
    step(1, 2)
    assert seen == [(True, ":4096:8", (1, 2))] and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ZeroDivisionError):  # off again however the step ends
        suite.deterministic_step(lambda: 1 / 0)()
    assert not torch.are_deterministic_algorithms_enabled()


def test_two_runs_losses_are_compared_update_by_update():
    """Where two runs part says more than their largest difference: a difference from the first update on is the
    steps', one that starts many updates on is rounding amplified. Rows without a loss (evaluations) are not compared;
    runs that logged other updates are refused, not compared in part."""
    run = [dict(step=1, loss=10.0), dict(step=2, loss=8.0), dict(step=2, val_loss=7.9), dict(step=3, loss=7.0)]
    other = [dict(step=1, loss=10.0), dict(step=2, loss=8.0), dict(step=3, loss=7.25), dict(step=3, val_loss=7.1)]
    assert suite.losses_apart(run, other) == dict(max_loss_diff=0.25, loss_diffs=[[1, 0.0], [2, 0.0], [3, 0.25]])
    for cut in (run[:-1], run[1:], []):
        with pytest.raises(RuntimeError, match="did not log the losses of the same updates"):
            suite.losses_apart(cut, other)
    with pytest.raises(RuntimeError, match="did not log the losses of the same updates"):
        suite.losses_apart(run, other[:2])


def test_a_failed_program_run_costs_itself_only(corpus, tmp_path):  # noqa: F811
    """Each train.py run of the program section is tried on its own and saved as it ends: here every run is refused
    at once (an unknown size), and each keeps its own error beside the others, then the section raises naming them."""
    s = dict(suite.SUITES["tiny"], program=dict(suite.SUITES["tiny"]["program"], size="nosuch"))
    saved = []
    failing = ["straight", "sigterm_resume", "compile", "sync_debug", "kernel", "torchrun", "deterministic"]
    with pytest.raises(RuntimeError, match=f"train.py runs failed: {', '.join(failing)} \\(their"):
        suite.suite_program(s, *corpus, str(tmp_path), progress=saved.append)
    runs = [*failing[:-1], "cuda_graph", "cuda_graph_per_layer", "deterministic"]  # on CPU the graphs' rows say
    # they were skipped, not failed
    assert [list(r) for r in saved] == [runs[:n] for n in range(1, len(runs) + 1)]
    assert "invalid choice: 'nosuch'" in saved[-1]["torchrun"]["error"]


def test_the_program_runs_the_suites_own_train_py_from_any_folder(corpus, tmp_path, monkeypatch):  # noqa: F811
    import subprocess
    started = []

    def popen(cmd, **kwargs):  # each run's command, then a failure to start: the section goes on to the next
        started.append(cmd)
        raise OSError("not started")
    monkeypatch.chdir(tmp_path)  # no train.py here
    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="train.py runs failed"):
        suite.suite_program(suite.SUITES["tiny"], *corpus, str(tmp_path / "out"))
    scripts = {arg for cmd in started for arg in cmd if arg.endswith("train.py")}
    assert scripts == {os.path.join(os.path.dirname(os.path.abspath(suite.__file__)), "train.py")}, scripts


def train_py_that_exits_at_once(monkeypatch):
    """The program section's processes, not started: each train.py exits at once, having written nothing, on a
    machine that pretends to have a GPU. Returns the list their commands go into."""
    import subprocess
    started = []

    class Done:
        returncode, pid, stdout = 0, os.getpid(), iter(())

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def communicate(self):
            return "", ""
    monkeypatch.setattr(subprocess, "Popen", Done)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return started


def test_on_cuda_the_program_runs_cuda_graph_beside_the_same_run_plain(corpus, tmp_path, monkeypatch):  # noqa: F811
    """On CUDA (here pretended: the processes are not started) the program section runs train.py --cuda_graph beside
    the same run without it, AdamW and 8-bit per-layer, two micro-batches an update, logged every quarter of the
    run so that --sync_debug watches the replays between log steps."""
    started = train_py_that_exits_at_once(monkeypatch)
    s = dict(suite.SUITES["tiny"], program=dict(suite.SUITES["tiny"]["program"], short=8))
    saved = []
    with pytest.raises(RuntimeError, match="train.py runs failed"):  # no metrics.jsonl to read
        suite.suite_program(s, *corpus, str(tmp_path), progress=saved.append)
    graph = {os.path.basename(cmd[cmd.index("--out_dir") + 1]): cmd for cmd in started
             if "graph" in cmd[cmd.index("--out_dir") + 1]}
    assert sorted(graph) == ["graph_off", "graph_on", "per_layer_graph_off", "per_layer_graph_on"]
    for name, cmd in graph.items():
        flags = " ".join(cmd[2:])
        assert ("--cuda_graph --sync_debug" in flags) == name.endswith("_on"), flags
        assert ("--per_layer" in flags and "--optimizer adam8bit" in flags) == name.startswith("per_layer"), flags
        assert "--log_every 2" in flags and "--batch_size 1" in flags and "--total_batch_size 2" in flags, flags
        assert flags.index("--log_every 2") > flags.index("--log_every 1"), flags  # the later one holds


def test_the_program_trains_on_the_suites_device(corpus, tmp_path, monkeypatch):  # noqa: F811
    """--device is the program section's too: every train.py run is given it (left to train.py's auto, tiny --device
    cpu on a machine with a GPU trained there, and gpu --device cuda:1 on cuda:0), and off CUDA the --cuda_graph runs
    are said to be skipped, not started to be refused."""
    started = train_py_that_exits_at_once(monkeypatch)  # on a machine with a GPU, the suite told the CPU
    r = suite.run_suite("tiny", torch.device("cpu"), ["program"], *corpus, out_dir=str(tmp_path))
    devices = [cmd[cmd.index("--device") + 1] if "--device" in cmd else None for cmd in started]
    assert started and devices == ["cpu"] * len(started), devices
    for name in ("cuda_graph", "cuda_graph_per_layer"):
        assert r["program"][name] == {"skipped": "train.py --cuda_graph needs a CUDA GPU"}, r["program"][name]


def test_a_hung_program_run_is_killed_at_its_timeout(corpus, tmp_path):  # noqa: F811
    """A run that outlives the section's timeout (here 0.3 s: not even torch's import fits) is killed with its
    process group, and its error says so; the others still run."""
    s = dict(suite.SUITES["tiny"], program=dict(suite.SUITES["tiny"]["program"], timeout=0.3))
    saved, t0 = [], time.perf_counter()
    with pytest.raises(RuntimeError, match="train.py runs failed: straight, sigterm_resume, compile, sync_debug, "
                                           "kernel, torchrun"):
        suite.suite_program(s, *corpus, str(tmp_path), progress=saved.append)
    assert all("killed after 0.3 s" in row["error"] for name, row in saved[-1].items() if "cuda_graph" not in name)
    assert time.perf_counter() - t0 < 60


def test_the_layer_table_names_the_variants_the_host_held_back(capsys):
    """On CUDA each layer variant has the host's time to issue a call beside its time: those the host took 90% or
    more of are named launch-bound under their shape (a 60m shape's kernels run in microseconds)."""
    ms = dict(dense=0.05, sltrain=0.09, merge=0.03, form=0.01, scatter=0.01, factor_grads=0.02, gather=0.01,
              sltrain_packed=0.1, unpack=0.005)
    issued = dict(dense=0.02, sltrain=0.085, merge=0.01, form=0.0095, scatter=0.002, factor_grads=0.01, gather=0.0095,
                  sltrain_packed=0.05, unpack=0.0048)
    variants = {k: dict(ms=v, ratio=v / ms["dense"], range=(v / ms["dense"],) * 2, issued_ms=issued[k])
                for k, v in ms.items()}
    row = dict(size="60m", shape="512x512", rank=128, floor=1.005, accounted_ms=0.16, variants=variants)
    suite.report_layer({"layer": [row]})
    out = capsys.readouterr().out
    assert "launch-bound (the host took 90% or more of the time to issue the work): sltrain, form, gather, unpack" \
        in out
    assert "packed support: sltrain x2.000 [2.00-2.00] | unpack 0.005 ms, twice a call" in out
    for v in variants.values():  # on CPU there is no such figure, and no such line
        del v["issued_ms"]
    suite.report_layer({"layer": [row]})
    assert "launch-bound" not in capsys.readouterr().out


def test_the_layer_is_also_timed_from_cuda_graphs_and_a_failed_capture_costs_only_itself(monkeypatch, capsys):
    """On CUDA every layer variant is also replayed from a CUDA graph, the GPU's time without the host's: the ratio
    to the floor and the parts' sum follow from those. Here (CPU) the capture is faked as the call itself; a capture
    that fails leaves the eager figures and says why."""
    tiny, cpu = suite.SUITES["tiny"], torch.device("cpu")
    captured = []
    monkeypatch.setattr(suite, "cuda_graphed", lambda fn, device: captured.append(fn) or fn)
    rows = suite.suite_layer(tiny, cpu, torch.float32, graphs=True)
    names = ["dense", "sltrain", "merge", "form", "scatter", "factor_grads", "gather", "sltrain_packed", "unpack"]
    for L in rows:
        v = L["variants"]
        assert list(v) == names + [f"{name}/graphed" for name in names] and "graph_error" not in L
        assert L["graphed_accounted_ms"] == suite.accounted_ms(v, "/graphed") and L["graphed_ratio"] > 0
        assert L["packed_graphed_ratio"] > 0
        low, high = L["graphed_range"]
        assert low <= L["graphed_ratio"] <= high
    assert len(captured) == len(names) * len(rows)
    suite.report_layer({"layer": rows})
    out = capsys.readouterr().out
    assert out.count("CUDA graphs (the GPU's time alone): dense") == len(rows) and "(graphed x" in out

    def fails(fn, device):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(suite, "cuda_graphed", fails)
    rows = suite.suite_layer(tiny, cpu, torch.float32, graphs=True)
    assert all(list(L["variants"]) == names and "graphed_ratio" not in L for L in rows)
    assert rows[0]["graph_error"] == "RuntimeError: operation not permitted when stream is capturing"
    suite.report_layer({"layer": rows})
    assert "CUDA graph capture failed: RuntimeError: operation not permitted" in capsys.readouterr().out
    assert all("graph_error" not in L for L in suite.suite_layer(tiny, cpu, torch.float32))  # on CPU: not tried


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_each_step_is_also_timed_from_a_cuda_graph_one_at_a_time(monkeypatch, capsys, compiled):
    """On CUDA the model sections also capture each train step, eager and compiled, as a CUDA graph and time its
    replays, one variant at a time, each freed before the next: the GPU's time for the step alone, and its ratio to
    full AdamW's (compiled: whether a compiled step is bound by the host). Here (CPU) the capture is faked as the step
    itself, and fails for one variant, which says so; the rest stand. Compiled, the steps are then also timed with the
    blocks compiled in mode reduce-overhead (torch's CUDA graph trees; on CPU the mode reaches torch.compile and does
    nothing), ÷ full AdamW so compiled. Eager and compiled, full and SLTrain AdamW then run plain and as train.py
    --cuda_graph, the four alone (each graph holds its activations): each graph variant captures its forward and
    backward once (cudagraph.MicroBatchGraph), and is not captured as a whole step. And SLTrain 8-bit per-layer
    plain and as --cuda_graph --per_layer (cudagraph.PerLayerGraph: its last micro-batch's forward, backward and
    updates captured once, here recorded and replayed as test_cudagraph does) beside full AdamW, alone."""
    tiny, cpu = suite.SUITES["tiny"], torch.device("cpu")
    captured, micro_batches, per_layer_graphs = [], [], []

    def capture(fn, device, **options):
        if isinstance(getattr(fn, "__self__", None), cudagraph.PerLayerGraph):
            per_layer_graphs.append(fn)
            return recorded_capture()(fn, device, **options)
        if isinstance(getattr(fn, "__self__", None), cudagraph.MicroBatchGraph):
            micro_batches.append(fn)
            return fn
        captured.append(fn)
        if len(captured) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return fn
    monkeypatch.setattr(suite, "cuda_graphed", capture)
    modes = []
    compile_blocks = suite.LLaMA.compile_blocks
    monkeypatch.setattr(suite.LLaMA, "compile_blocks",
                        lambda self, **options: modes.append(options.get("mode")) or compile_blocks(self, **options))
    r = suite.suite_model(tiny, cpu, torch.float32, compiled, graphs=True)
    v = r["variants"]
    assert not any(name.endswith("/cuda_graph") for name in v)
    replayed = r["cuda_graph"]["variants"]
    assert list(replayed) == ["full/adamw", "full/adamw/cuda_graph", "sltrain/adamw", "sltrain/adamw/cuda_graph"]
    assert len(micro_batches) == 2 and replayed["full/adamw"]["ratio"] == 1.0
    assert all(row["tok_s"] > 0 for row in replayed.values()) and r["cuda_graph"]["rounds"] == tiny["rounds"]
    per_layer = r["cuda_graph_per_layer"]["variants"]
    assert list(per_layer) == ["full/adamw", "sltrain/adam8bit/per_layer", "sltrain/adam8bit/per_layer/cuda_graph"]
    assert len(per_layer_graphs) == 1 and per_layer["full/adamw"]["ratio"] == 1.0
    assert all(row["tok_s"] > 0 for row in per_layer.values())
    failed = list(v)[2]
    assert v[failed]["graph_error"] == "RuntimeError: operation not permitted when stream is capturing"
    assert "graphed_ms" not in v[failed] and len(captured) == len(v)
    assert v["full/adamw"]["graphed_ratio"] == 1.0
    for name, row in v.items():
        if name != failed:
            assert row["graphed_ms"] > 0 and row["graphed_ratio"] == v["full/adamw"]["graphed_ms"] / row["graphed_ms"]
    suite.report_model({"model": r})
    out = capsys.readouterr().out
    assert len(re.findall(r"\| CUDA graph \d", out)) == len(v) - 1
    assert "CUDA graph capture failed: RuntimeError" in out
    tail = out.split("as train.py --cuda_graph (forward and backward replayed)")[1].splitlines()[1:5]
    assert [line.split()[0] for line in tail] == list(replayed) and all(" tok/s x" in line for line in tail)
    tail = out.split("as train.py --cuda_graph --per_layer (the per-layer updates replayed")[1].splitlines()[1:4]
    assert [line.split()[0] for line in tail] == list(per_layer) and all(" tok/s x" in line for line in tail)
    if compiled:  # then the blocks compiled as CUDA graph trees, side by side, each ÷ full AdamW so compiled
        trees = r["graph_trees"]["variants"]
        assert list(trees) == ["full/adamw", "sltrain/adamw", "full/adam8bit/per_layer", "sltrain/adam8bit/per_layer"]
        assert modes == [None] * (len(v) + len(r["paper_batch"]["variants"]) + len(replayed) + len(per_layer)) + \
            ["reduce-overhead"] * len(trees)
        assert trees["full/adamw"]["ratio"] == 1.0
        assert all(row["tok_s"] > 0 for row in trees.values()) and r["graph_trees"]["rounds"] == tiny["rounds"]
        tail = out.split("mode reduce-overhead (CUDA graph trees)")[1].splitlines()[1:]
        assert [line.split()[0] for line in tail] == list(trees) and all(" tok/s x" in line for line in tail)
    else:
        assert "graph_trees" not in r and not modes
        plain = suite.suite_model(tiny, cpu, torch.float32, False)  # on CPU: neither tried
        assert "cuda_graph" not in plain and not any("graphed_ms" in row for row in plain["variants"].values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_cuda_graph_replays_the_calls_work():
    device = torch.device("cuda")
    x = torch.zeros(1, device=device)
    replay = cudagraph.cuda_graphed(lambda: x.add_(1), device, warmup=2)  # warm-up runs it, capture does not
    torch.cuda.synchronize()
    assert x.item() == 2
    replay()
    replay()
    torch.cuda.synchronize()
    assert x.item() == 4
    rows = suite.suite_layer(suite.SUITES["tiny"], device, torch.bfloat16)
    assert all("graphed_ratio" in L and "graph_error" not in L for L in rows), rows
    steps = suite.suite_model(suite.SUITES["tiny"], device, torch.bfloat16, False)["variants"]
    assert all(row["graphed_ms"] > 0 for row in steps.values()), steps


def test_a_hung_worker_in_a_session_of_its_own_is_killed_too(tmp_path):
    """As torchrun starts its workers: a child in a session of its own, out of the run's process group, that
    ignores SIGTERM and holds the run's output pipe. The deadline kills it with the run, so reading the output ends
    at the deadline, not when the worker would have."""
    import subprocess
    import sys
    worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('worker', flush=True); " \
             "time.sleep(90)"
    run = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], " \
          "start_new_session=True); time.sleep(90)"
    proc = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, text=True, start_new_session=True)
    t0 = time.perf_counter()
    with suite.deadline(proc, 3) as fired:
        out = proc.communicate()[0]
    assert fired.is_set() and out == "worker\n" and time.perf_counter() - t0 < 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_run_ends_with_the_suite_that_started_it(tmp_path):
    """The plan runs the suite under timeout -s KILL: a kill in the program section left the train.py run it was
    waiting for running on (in a session of its own, with the deadline's timer gone with the suite), training on
    the GPU beside the next command's measurements. Here a suite starts a run that sleeps, and is killed."""
    import subprocess
    said = tmp_path / "run.pid"
    run = f"import os, time; open({str(said)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    starter = f"import sys, time, suite; suite.start_run([sys.executable, '-c', {run!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", starter], cwd=os.path.dirname(os.path.abspath(suite.__file__)))
    try:
        for _ in range(300):  # the run has started (the suite's imports take seconds)
            if said.exists() and said.read_text():
                break
            time.sleep(0.1)
        pid = int(said.read_text())
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the run outlived the suite that started it")


def test_the_programs_shards_and_tokenizer_are_checked_first(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """When the program section will run, its shards and tokenizer are checked as train.py checks them, before any
    section (each train.py run started, to fail with "no train shards", after the others); --data_dir or --tokenizer
    with an --only that leaves it out is refused, not ignored."""
    shards, tokenizer = corpus
    (tmp_path / "empty").mkdir()
    (tmp_path / "train").mkdir()
    for shard in glob.glob(os.path.join(shards, "c4-train.*")):
        shutil.copy(shard, tmp_path / "train")
    (tmp_path / "bad.model").write_bytes(b"not a tokenizer")
    monkeypatch.setattr(suite, "start", lambda device: (_ for _ in ()).throw(SystemExit("started")))
    for argv, message in (
            (["--data_dir", str(tmp_path / "empty"), "--tokenizer", tokenizer], f"no train shards in {tmp_path}"),
            (["--only", "program", "--data_dir", str(tmp_path / "train"), "--tokenizer", tokenizer],
             "no validation shards in"),
            (["--data_dir", shards, "--tokenizer", str(tmp_path / "no.model")], "no.model not found; fetch T5's"),
            (["--data_dir", shards, "--tokenizer", str(tmp_path / "bad.model")], "is not a readable sentencepiece"),
            (["--only", "layer", "--data_dir", shards], "--data_dir is for the program section, and --only has not "
                                                        "got it: drop --data_dir, or add program to --only"),
            (["--only", "memory", "inference", "--tokenizer", tokenizer], "--tokenizer is for the program section")):
        monkeypatch.setattr("sys.argv", ["suite.py", "tiny", "--device", "cpu", *argv])
        with pytest.raises(SystemExit) as exit:
            suite.main()
        err = capsys.readouterr().err
        assert exit.value.code == 2 and message in err and "Traceback" not in err, err
    monkeypatch.setattr("sys.argv", ["suite.py", "tiny", "--device", "cpu", "--data_dir", shards, "--tokenizer",
                                     tokenizer])
    with pytest.raises(SystemExit, match="^started$"):  # what train.py needs is there: the sections start
        suite.main()


@pytest.mark.parametrize("argv,message", [
    (["gpu"], "run tiny on CPU"),
    ([], "the following arguments are required: suite"),
    (["tiny", "--only", "host"], "invalid choice: 'host'"),  # bench.py's
    (["tiny", "--size", "60m"], "unrecognized arguments: --size 60m"),  # a suite has its own sizes and rounds
    (["tiny", "--only", "program"], "pass --data_dir"),
    (["tiny", "--tokenizer", "data/t5_spiece.model"], "pass --data_dir"),
    (["tiny", "--data_dir", "/nonexistent/c4"], "--data_dir /nonexistent/c4: no such folder"),
    (["tiny", "--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["tiny", "--only", "layer", "--out", "."], "--out . is a folder"),
])
def test_every_flag_is_honored_or_refused(monkeypatch, capsys, argv, message):
    if argv == ["gpu"] and torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    monkeypatch.setattr("sys.argv", ["suite.py", *argv])
    with pytest.raises(SystemExit):
        suite.main()
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
