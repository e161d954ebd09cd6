"""
The benchmark suite's code at toy sizes on CPU, so that a GPU session spends its minutes measuring, not debugging.

    python -m pytest -q test_bench.py
"""

import functools
import json
import math

import pytest
import torch

import bench
from test_train import corpus  # noqa: F401  (the tiny shards and tokenizer, made once per module)


def test_tiny_suite_runs_every_section_and_reports(tmp_path):
    out = str(tmp_path / "tiny.json")
    r = bench.run_suite("tiny", torch.device("cpu"), out=out)
    s = bench.SUITES["tiny"]
    sections = ["layer", "model", "model_compiled", "amp", "memory", "optimizer", "inference"]
    assert list(r["seconds"]) == sections and "errors" not in r
    assert [L["shape"] for L in r["layer"]] == ["64x64", "176x64", "64x176"]  # d×d, up/gate ffn×d, down d×ffn
    for L in r["layer"]:
        assert L["floor"] == 1 + 4 * L["rank"] / (3 * s["tokens"])
        v = L["variants"]
        assert set(v) == {"dense", "sltrain", "merge", "form", "scatter", "factor_grads", "gather"}
        assert all(row["ms"] > 0 for row in v.values()) and v["sltrain"]["ratio"] > 0
        parts = v["form"]["ms"] + v["scatter"]["ms"]
        assert L["accounted_ms"] == v["dense"]["ms"] + 2 * parts + v["factor_grads"]["ms"] + v["gather"]["ms"]
    for key, methods in (("model", bench.METHODS), ("model_compiled", ("full", "lowrank", "sltrain"))):
        v = r[key]["variants"]
        assert r[key]["compiled"] is (key == "model_compiled") and v["full/adamw"]["ratio"] == 1.0
        assert set(v) == {f"{m}/{o}" for m in methods for o in ("adamw", "adam8bit/per_layer")}
        assert all(x["tok_s"] > 0 for x in v.values())
    mem = r["memory"]["tiny"]
    assert set(mem["settings"]) == {"full/adamw", "full/adam8bit/per_layer", "lowrank/adam8bit/per_layer",
                                    "galore/adam8bit/per_layer", "sltrain/adam8bit/per_layer"}
    for name, row in mem["settings"].items():
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
    for host in r["optimizer"]["host_ms_per_update"].values():  # per-layer updates: the host's time, and its ops
        assert set(host) == {"AdamW", "Adam8bit", "Adam8bit(compile=True)"}
        # a difference of two timings: finite, but under load it may come out at or below zero at this size
        assert all(math.isfinite(ms) for ms, _ in host.values()), host
        assert host["Adam8bit"][1] > host["AdamW"][1] > 0 and host["Adam8bit(compile=True)"][1] is None
    assert set(r["inference"][0]["variants"]) == {"full", "sltrain", "sltrain_merged"}
    for name, v in r["amp"]["settings"].items():  # --amp beside pure bf16 (on CPU: float32), side by side
        assert v["bf16"]["ratio"] == 1.0 and v["amp"]["tok_s"] > 0 and v["amp"]["peak_gb"] is None, name
        # each beside the estimate of its own setting: float32 here, and under autocast a mixed one
        assert v["bf16"]["estimate_gb"] > 0 and v["amp"]["estimate_gb"] not in (0, v["bf16"]["estimate_gb"]), name
    on_disk = json.load(open(out))
    assert all(k in on_disk for k in sections) and list(on_disk["seconds"]) == sections
    bench.report_suite(on_disk)  # the tables print from the JSON alone


def test_a_failing_section_is_recorded_and_the_others_run(monkeypatch, tmp_path, capsys):
    def broken(*args):
        raise RuntimeError("CUDA out of memory (a test)")
    monkeypatch.setattr(bench, "suite_optimizer", broken)
    out = str(tmp_path / "suite.json")
    monkeypatch.setattr("sys.argv", ["bench.py", "--suite", "tiny", "--only", "layer", "optimizer", "inference",
                                     "--out", out])
    with pytest.raises(SystemExit) as stopped:  # after writing the JSON, the command fails, naming the section
        bench.main()
    assert "failed: optimizer" in str(stopped.value.code)
    r = json.load(open(out))
    assert r["errors"]["optimizer"]["error"] == "RuntimeError: CUDA out of memory (a test)", r["errors"]
    assert any("in broken" in line for line in r["errors"]["optimizer"]["traceback"])
    assert "optimizer" not in r and r["layer"] and r["inference"]  # the section after the failed one ran too
    assert list(r["seconds"]) == ["layer", "optimizer", "inference"] and r["command"].startswith("python bench.py")
    printed = capsys.readouterr().out
    assert "optimizer failed" in printed and printed.index("layer: SLTrain") < printed.index("optimizer failed")


def test_each_section_is_on_disk_before_the_next_runs(monkeypatch, tmp_path):
    out, seen = str(tmp_path / "suite.json"), {}

    def interrupted(*args):  # what a kill mid-section leaves: the file as it is now
        seen.update(json.load(open(out)))
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "suite_optimizer", interrupted)
    with pytest.raises(KeyboardInterrupt):  # not recorded as a section's error: it stops the run
        bench.run_suite("tiny", torch.device("cpu"), ["layer", "optimizer", "inference"], out=out)
    assert seen["layer"] and list(seen["seconds"]) == ["layer"], seen
    assert json.load(open(out)) == seen  # nothing after the interrupt, the earlier section kept


def test_a_long_section_keeps_its_finished_part_on_disk(monkeypatch, tmp_path):
    """The memory section saves after each setting: a kill during the second leaves the first on disk."""
    out, measure, calls = str(tmp_path / "suite.json"), bench.measure, []

    def killed_on_the_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args)
    monkeypatch.setattr(bench, "measure", killed_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        bench.run_suite("tiny", torch.device("cpu"), ["memory"], out=out)
    saved = json.load(open(out))["memory"]["tiny"]
    assert list(saved["settings"]) == ["full/adamw"] and saved["settings"]["full/adamw"]["gb"] > 0, saved
    assert saved["reduction"] is None  # the SLTrain row was not measured yet
    bench.report_memory({"memory": {"tiny": saved}})  # a partial section still prints


def test_memory_adds_an_sltrain_row_at_the_appendix_delta_where_a_size_trains_at_another(monkeypatch, capsys):
    """7b trains at delta 0.05 but the appendix counts its memory at 0.03: the section measures that too, after the
    paper's settings and before GaLore's, with its own estimate and reduction. Here tiny (0.03) stands in, at 0.05;
    measure stands in for the real one (test_tiny_suite_runs_every_section_and_reports runs that), the peak its
    estimate plus a tenth."""
    calls = []

    def measured(size, method, rank, delta, optimizer, per_layer, batch_size, max_length, steps, device):
        calls.append((method, delta))
        train = bench.estimate(size, method, rank, delta, "int32", optimizer, per_layer, batch_size, max_length)
        parts = dict.fromkeys(("param", "optim", "grad", "act"), 0)
        return dict(peak=1.1e9 * train["train_gb"], base=0, train=1e9 * train["train_gb"], **parts), None
    monkeypatch.setattr(bench, "measure", measured)
    monkeypatch.setattr(bench, "PAPER_MEMORY_DELTA", 0.05)
    mem = bench.run_suite("tiny", torch.device("cpu"), ["memory"])["memory"]["tiny"]
    rows = mem["settings"]
    assert list(rows) == ["full/adamw", "sltrain/adam8bit/per_layer", "full/adam8bit/per_layer",
                          "lowrank/adam8bit/per_layer", "sltrain/adam8bit/per_layer/delta=0.05",
                          "galore/adam8bit/per_layer"]
    assert calls[4] == ("sltrain", 0.05) and [d for _, d in calls].count(None) == 5
    at, default, full = (rows[k] for k in ("sltrain/adam8bit/per_layer/delta=0.05", "sltrain/adam8bit/per_layer",
                                           "full/adamw"))
    assert at["estimate_gb"] > default["estimate_gb"] and at["vs_estimate"] == pytest.approx(0.1)
    assert mem["reduction_at_paper_delta"] == pytest.approx(1 - at["estimate_gb"] / full["estimate_gb"])
    assert mem["reduction"] == pytest.approx(1 - default["estimate_gb"] / full["estimate_gb"])
    bench.report_memory({"memory": {"tiny": mem}})
    assert f"sltrain at delta 0.05, the appendix's count: -{100 * mem['reduction_at_paper_delta']:.1f}%" in \
        capsys.readouterr().out
    monkeypatch.setattr(bench, "PAPER_MEMORY_DELTA", 0.03)  # tiny's own: no extra row
    mem = bench.run_suite("tiny", torch.device("cpu"), ["memory"])["memory"]["tiny"]
    assert len(mem["settings"]) == 5 and "reduction_at_paper_delta" not in mem


def test_tiny_program_trains_resumes_and_has_no_host_sync(corpus, tmp_path, capsys):  # noqa: F811
    r = bench.run_suite("tiny", torch.device("cpu"), ["program"], *corpus, out_dir=str(tmp_path))["program"]
    assert r["straight"]["loss_falls"], r["straight"]
    steps = bench.SUITES["tiny"]["program"]["steps"]  # the signal goes at half way: the run must stop before the end
    assert r["sigterm_resume"]["exit_code"] == 0 and steps // 2 <= r["sigterm_resume"]["stopped_at"] < steps
    assert r["sigterm_resume"]["val_loss_diff"] == 0.0  # exact on CPU
    assert r["sigterm_resume"]["stop"].startswith("stopped by SIGTERM"), r["sigterm_resume"]
    assert r["sync_debug"]["line"] == "sync_debug: 2 updates between log steps watched; host syncs: none"
    assert r["torchrun"]["ok"] and r["compile"]["ok"] and r["compile"]["last_loss"] < r["straight"]["first_loss"]
    assert r["compile"]["sync_debug"].endswith("host syncs: none"), r["compile"]  # CUDA's own check; on CPU: none
    print(r["compile"])
    bench.report_suite({"program": r})


def test_a_failed_program_run_costs_itself_only(corpus, tmp_path):  # noqa: F811
    """Each train.py run of the program section is tried on its own and saved as it ends: here every run is refused
    at once (an unknown size), and each keeps its own error beside the others, then the section raises naming them."""
    s = dict(bench.SUITES["tiny"], program=dict(bench.SUITES["tiny"]["program"], size="nosuch"))
    saved = []
    with pytest.raises(RuntimeError, match="train.py runs failed: straight, sigterm_resume, compile, sync_debug, "
                                           "torchrun"):
        bench.suite_program(s, *corpus, str(tmp_path), progress=saved.append)
    assert [list(r) for r in saved] == [["straight"], ["straight", "sigterm_resume"],
                                        ["straight", "sigterm_resume", "compile"],
                                        ["straight", "sigterm_resume", "compile", "sync_debug"],
                                        ["straight", "sigterm_resume", "compile", "sync_debug", "torchrun"]]
    assert "invalid choice: 'nosuch'" in saved[-1]["torchrun"]["error"]


@pytest.mark.parametrize("argv,message", [
    (["--suite", "gpu"], "use --suite tiny on CPU"),
    (["--only", "amp"], "add --suite gpu"), (["--only", "program"], "add --suite gpu"),
    (["--only", "model_compiled"], "add --suite gpu"),
    (["--only", "memory"], "run on a GPU or drop it from --only"),
    (["--suite", "tiny", "--size", "60m"], "--size: a suite has its own sizes and rounds"),
    (["--suite", "tiny", "--rounds", "3", "--quick"], "--rounds, --quick: a suite has its own"),
    (["--suite", "tiny", "--batch_size", "0"], "--batch_size: a suite has its own"),
    (["--suite", "tiny", "--only", "program"], "pass --data_dir"),
    (["--data_dir", "data/c4"], "add --suite or drop them"),
    (["--size", "61m"], "invalid choice: '61m' (choose from"),
    (["--rounds", "0"], "must be >= 1"),
    (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["--suite", "tiny", "--only", "host"], "--only host: not sections of a suite; drop --suite"),
    (["--only", "step", "layer", "--device", "cuda"], "--only step times the optimizers on CPU: drop --device cuda"),
    (["--only", "layer", "--size", "60m"], "--size is for the host, inference, model, optimizer sections"),
    (["--only", "heavy", "--rounds", "3"], "and --only has none of them: drop --rounds"),
    (["--only", "step", "--batch_size", "4"], "drop --batch_size"),
    (["--only", "host", "--quick"], "drop --quick"),
    (["--quick", "--size", "60m"], "--quick picks the tiny model and --size the sizes: pass one of them"),
    (["--suite", "tiny", "--data_dir", "/nonexistent/c4"], "--data_dir /nonexistent/c4: no such folder"),
    (["--suite", "tiny", "--data_dir", ".", "--tokenizer", "/nonexistent.model"], "/nonexistent.model: no such file"),
])
def test_every_flag_is_honored_or_refused(monkeypatch, capsys, argv, message):
    if argv[:2] == ["--suite", "gpu"] and torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    if argv[:2] == ["--only", "memory"] and torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
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
    assert "one optimizer step on a 64x64 tensor" in out and "best of 2 rounds" in out
    assert "200 steps on heavy-tailed gradients" in out and out.count("max |update|/lr") == 3
    assert "tiny sltrain (" in out and "x: median" not in out



def test_single_sections_record_a_failure_and_keep_the_rest(monkeypatch, capsys, tmp_path):
    """Without --suite too: a section that raises (an OOM) is recorded, the others run, and --out holds what was
    done; every --size is run by the sections that take sizes (the optimizer's too)."""
    monkeypatch.setattr(bench, "bench_step", functools.partial(bench.bench_step, size=64, steps=2, warmup=1))
    sizes = []
    monkeypatch.setattr(bench, "bench_optimizer", lambda size, *a: sizes.append(size) or dict(
        size=size, params_m=1.0, dtype="float32", variants={}))
    monkeypatch.setattr(bench, "bench_inference", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    out = tmp_path / "r.json"
    monkeypatch.setattr("sys.argv", ["bench.py", "--only", "step", "optimizer", "inference", "--size", "tiny", "60m",
                                     "--rounds", "1", "--out", str(out)])
    with pytest.raises(SystemExit, match="failed: inference"):
        bench.main()
    r = json.loads(out.read_text())
    assert "step" in r and r["errors"]["inference"]["error"] == "RuntimeError: out of memory", r.get("errors")
    assert sizes == ["tiny", "60m"] and [O["size"] for O in r["optimizer"]] == ["tiny", "60m"]
    assert "one optimizer step on a 64x64 tensor" in capsys.readouterr().out


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
