"""
The benchmark suite's code at toy sizes on CPU, so that a GPU session spends its minutes measuring, not debugging.

    python -m pytest -q test_bench.py
"""

import pytest
import torch

import bench
from test_train import corpus  # noqa: F401  (the tiny shards and tokenizer, made once per module)


def test_tiny_suite_runs_every_section_and_reports():
    r = bench.run_suite("tiny", torch.device("cpu"))
    s = bench.SUITES["tiny"]
    assert [L["shape"] for L in r["layer"]] == ["64x64", "176x64", "64x176"]  # d×d, up/gate ffn×d, down d×ffn
    for L in r["layer"]:
        assert L["floor"] == 1 + 4 * L["rank"] / (3 * s["tokens"])
        assert set(L["variants"]) == {"dense", "sltrain", "merge"} and L["variants"]["sltrain"]["ratio"] > 0
    for group in ("eager", "compiled"):
        v = r["model"]["groups"][group]
        assert len(v) == 2 * len(bench.METHODS) and v["full/adamw"]["ratio"] == 1.0
        assert all(x["tok_s"] > 0 for x in v.values())
    mem = r["memory"]["tiny"]
    assert set(mem["settings"]) == {"full/adamw", "full/adam8bit/per_layer", "lowrank/adam8bit/per_layer",
                                    "galore/adam8bit/per_layer", "sltrain/adam8bit/per_layer"}
    for name, row in mem["settings"].items():  # on CPU the counted bytes: they must agree with the estimate
        assert abs(row["vs_estimate"]) < 0.05, (name, row)
    assert 0 < mem["reduction"] < 1
    assert set(r["optimizer"]["variants"]) == {"torch.optim.AdamW", "optim.Adam8bit"}
    assert set(r["inference"][0]["variants"]) == {"full", "sltrain", "sltrain_merged"}
    for name, v in r["amp"]["settings"].items():  # --amp beside pure bf16 (on CPU: float32), side by side
        assert v["bf16"]["ratio"] == 1.0 and v["amp"]["tok_s"] > 0 and v["amp"]["peak_gb"] is None, name
    bench.report_suite(r)  # the table prints from the JSON alone


def test_tiny_program_trains_resumes_and_has_no_host_sync(corpus, tmp_path, capsys):  # noqa: F811
    r = bench.run_suite("tiny", torch.device("cpu"), ["program"], *corpus, out_dir=str(tmp_path))["program"]
    assert r["straight"]["loss_falls"], r["straight"]
    steps = bench.SUITES["tiny"]["program"]["steps"]  # the signal goes at half way: the run must stop before the end
    assert r["sigterm_resume"]["exit_code"] == 0 and steps // 2 <= r["sigterm_resume"]["stopped_at"] < steps
    assert r["sigterm_resume"]["val_loss_diff"] == 0.0  # exact on CPU
    assert r["sync_debug"]["line"] == "sync_debug: 2 updates between log steps watched; host syncs: none"
    assert r["torchrun"]["ok"] and "compile" not in r  # the tiny suite does not compile (minutes on a CPU)
    bench.report_suite({"program": r})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_suite_refused_without_cuda(monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench.py", "--suite", "gpu"])
    try:
        bench.main()
    except ValueError as e:
        assert "--suite tiny" in str(e)
    else:
        raise AssertionError("--suite gpu ran on a machine without CUDA")


def test_suite_sections_without_a_suite_are_refused(monkeypatch):
    for section in ("amp", "program"):
        monkeypatch.setattr("sys.argv", ["bench.py", "--only", section])
        with pytest.raises(ValueError, match="add --suite gpu"):
            bench.main()
