"""
train.py when the world faults: a scheduler's signal to the whole process group, a killed rank, torchrun or data
worker, out of memory, a run that diverges, a full disk or a write the filesystem refuses, a bad or unreadable
shard line, a damaged checkpoint, another run writing the same folder. Each ends in one line naming the fix, with
the last whole update saved, and a resume that goes on as the straight run does.

    python -m pytest -q test_faults.py
"""

import argparse
import errno
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import checkpoint
import data
import flags
import keeper
import train
from model import LLaMA, config_for
from test_data import quiet, read_then_stop
from test_hostsync import mark_pinning
from test_train import (HERE, base_args, corpus, eval_args, file_size_limit, final_state, metrics,  # noqa: F401
                        one_gpu, run_torchrun)  # corpus: the tiny shards and tokenizer, a fixture


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(corpus, tmp_path):
    cmd = [sys.executable, str(HERE / "train.py"), *base_args(corpus, tmp_path, 100_000)]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "stopped by SIGTERM" in output
    step = final_state(tmp_path)["step"]
    assert 3 <= step < 100_000 and metrics(tmp_path)[0][-1]["step"] <= step


def signal_in_update(monkeypatch, k):
    """SIGTERM to this process as update k's last micro-batch ends, as a scheduler's would arrive: the update is made,
    then the run stops (signal_in_micro_batch: within an update)."""
    step, calls = train.train_step, []

    def step_and_signal(*args, **kwargs):
        calls.append(1)
        result = step(*args, **kwargs)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(train, "train_step", step_and_signal)


def signal_in_micro_batch(monkeypatch, n):
    """SIGTERM to this process during the forward of the n-th micro-batch of training (in train_step)."""
    step, forward, calls, stepping = train.train_step, LLaMA.forward, [], []

    def step_watched(*args, **kwargs):
        stepping.append(1)
        try:
            return step(*args, **kwargs)
        finally:
            stepping.pop()

    def forward_and_signal(self, *args, **kwargs):
        if stepping:
            calls.append(1)
            if len(calls) == n:
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(train, "train_step", step_watched)
    monkeypatch.setattr(LLaMA, "forward", forward_and_signal)


@pytest.mark.parametrize("extra", [[], ["--optimizer", "adam8bit_per_layer"]], ids=["adamw", "adam8bit-per-layer"])
def test_a_signal_within_an_update_drops_it_and_the_resume_is_bit_exact(corpus, tmp_path, monkeypatch, capsys, extra):
    # an update of many micro-batches can outlast a scheduler's grace period: a signal stops before the next one.
    # total 8 = batch 4 x 2 micro-batches: forward 5 is the first micro-batch of update 3, forward 6 its last;
    # forward 1 is the first of the run: its checkpoint holds the initial model
    every = ["--eval_every", "2", "--log_every", "1"]
    train.main(base_args(corpus, tmp_path / "straight", 6, *every, *extra))
    for n, saved in ((1, 0), (5, 2), (6, 3)):
        out = tmp_path / f"forward{n}"
        with monkeypatch.context() as m:
            signal_in_micro_batch(m, n)
            train.main(base_args(corpus, out, 6, *every, *extra))
        said = capsys.readouterr().out
        assert final_state(out)["step"] == saved and not final_state(out)["eval_pending"], said[-1500:]
        assert (f"stopped by SIGTERM within update {saved + 1}, which the resumed run makes again: saved" in said) == \
            (n != 6)
        assert [r["step"] for r in metrics(out)[0]] == list(range(1, saved + 1)), "no row of the dropped update"
        train.main(base_args(corpus, out, 6, "--resume", *every, *extra))
        a, b = metrics(tmp_path / "straight"), metrics(out)
        assert [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in a[0]] == \
            [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in b[0]], n
        assert a[1] == b[1], n
        sa, sb = final_state(tmp_path / "straight")["model"], final_state(out)["model"]
        for name, t in sa.items():
            assert torch.equal(t, sb[name]), f"forward {n}: {name} differs by {(t - sb[name]).abs().max()}"


@pytest.mark.parametrize("micro_batches", [2, 1])
def test_a_signal_during_a_save_stops_there_without_a_second_save(corpus, tmp_path, monkeypatch, capsys,
                                                                   micro_batches):
    """The signal comes while the checkpoint of update 2 is written: the run stops on it, with no update more and
    no second write (at 7b, tens of GB, into the grace before SIGKILL). It went on into update 3: with two
    micro-batches it stopped at the second, with one it made the update and wrote a checkpoint again."""
    save, saves, signalled = checkpoint.save, [], []

    def save_and_signal(path, state):
        saves.append(state["step"])
        save(path, state)
        if not signalled:
            signalled.append(os.kill(os.getpid(), signal.SIGTERM))
    monkeypatch.setattr(checkpoint, "save", save_and_signal)
    batch = ["--batch_size", str(8 // micro_batches)]
    train.main(base_args(corpus, tmp_path, 6, "--save_every", "2", *batch))
    assert saves == [2] and final_state(tmp_path)["step"] == 2
    out = capsys.readouterr().out
    assert f"stopped by SIGTERM: saved {tmp_path}/ckpt.pt at step 2; rerun with --resume" in out, out
    assert "step 3/6" not in out, out
    saves.clear()
    with monkeypatch.context() as m:  # the resumed run is signalled in its first update's first micro-batch: with
        signal_in_micro_batch(m, 1)  # two, it stops before the second, nothing new to save; with one, the update is
        train.main(base_args(corpus, tmp_path, 6, "--save_every", "2", "--resume", *batch))  # whole, and saved
    assert saves == ([] if micro_batches == 2 else [3]), saves
    assert final_state(tmp_path)["step"] == (2 if micro_batches == 2 else 3)
    saves.clear()
    train.main(base_args(corpus, tmp_path, 6, "--save_every", "2", "--resume", *batch))
    assert saves == [4, 6] and final_state(tmp_path)["step"] == 6


def test_a_slow_checkpoint_write_is_said_once_with_the_grace_it_needs(corpus, tmp_path, monkeypatch, capsys):
    """A write longer than SLOW_SAVE_S: a stop on a signal writes one too, and a scheduler's SIGKILL 30 s after its
    SIGTERM would cut it short. Said after the first such write, not after every one; a fast write says nothing."""
    train.main(base_args(corpus, tmp_path / "fast", 4, "--save_every", "2"))
    assert "note: writing" not in capsys.readouterr().out
    save = checkpoint.save

    def slow_save(path, state):
        save(path, state)
        time.sleep(0.2)
    monkeypatch.setattr(checkpoint, "save", slow_save)
    monkeypatch.setattr(train, "SLOW_SAVE_S", 0.1)
    train.main(base_args(corpus, tmp_path / "slow", 6, "--save_every", "2"))
    out = capsys.readouterr().out
    assert out.count("note: writing") == 1
    assert re.search(rf"note: writing {tmp_path}/slow/ckpt.pt took \d+\.\d s\. ", out)
    assert "between SIGTERM and SIGKILL" in out and "--shutdown_timeout" in out
    assert out.index("note: writing") < out.index("step 3/6")  # said at the first slow write, update 2's
    assert final_state(tmp_path / "slow")["step"] == 6


@pytest.mark.parametrize("per_layer", [False, True], ids=["adamw", "adam8bit-per-layer"])
def test_a_signal_on_another_rank_within_an_update_drops_it_here_too(monkeypatch, per_layer):
    """Under torchrun the ranks agree on a signal at each micro-batch after the first. Faked here: a second rank, which
    was signalled; this one was not, and drops the update with it: no parameter changed, no gradient kept."""
    model = LLaMA(config_for("tiny", vocab_size=96))
    model.no_sync = suppress  # DDP's: no all-reduce in the backward of a micro-batch but the last
    if per_layer:
        per, opt, scheduler = train.attach_per_layer(model, lambda ps: train.Adam8bit(ps, lr=1e-3)), None, None
    else:
        per, opt = None, train.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    run = train.Run(model, model, opt, scheduler, per, model.config, torch.device("cpu"), rank=0, world=2)
    flags = []

    def all_reduce(t, op=None, group=None):
        if t.dtype == torch.int64:  # the stop flag: the other rank's is set
            flags.append(int(t))
            t += 1
        else:  # the update's target count: the other rank's equals this one's
            t *= 2
    monkeypatch.setattr(train.dist, "all_reduce", all_reduce)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    micro_batches = [(torch.randint(96, (2, 16)), torch.randint(96, (2, 16)), 32) for _ in range(3)]
    stop = {"signal": None}
    assert train.train_step(SimpleNamespace(grad_clipping=0.0), run, micro_batches, stop) is None
    assert flags == [0] and stop["signal"] == "a signal on another rank", "agreed before the second micro-batch"
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert (per.steps if per_layer else scheduler.last_epoch) == 0


def test_an_evaluation_a_stop_skipped_is_made_on_resume(corpus, tmp_path, monkeypatch):
    # --stop_after is planned: its evaluation is made. A signal asks for a quick exit: the resumed run evaluates
    # first, at the last update too, where the checkpoint already has every update
    every = ["--eval_every", "3"]
    train.main(base_args(corpus, tmp_path / "straight", 6, *every))
    expected = metrics(tmp_path / "straight")[1]
    assert [r["step"] for r in expected] == [3, 6]
    train.main(base_args(corpus, tmp_path / "planned", 6, "--stop_after", "3", *every))
    assert [r["step"] for r in metrics(tmp_path / "planned")[1]] == [3]
    for k in (3, 6):
        out = tmp_path / f"signal{k}"
        with monkeypatch.context() as m:
            signal_in_update(m, k)
            train.main(base_args(corpus, out, 6, *every))
        assert final_state(out)["step"] == k and final_state(out)["eval_pending"]
        assert [r["step"] for r in metrics(out)[1]] == [3] * (k == 6)
    for out in ("planned", "signal3", "signal6"):
        train.main(base_args(corpus, tmp_path / out, 6, "--resume", *every))
        assert metrics(tmp_path / out)[1] == expected, out
        assert not final_state(tmp_path / out)["eval_pending"]


def test_a_signal_during_the_save_of_a_pending_evaluation_stops_there(corpus, tmp_path, monkeypatch, capsys):
    """The resumed run makes the evaluation the signal skipped, then saves; a signal in that save stops on it, as in
    a scheduled one: no update more and no second write. With one micro-batch an update it went on into was made and
    written again, into the grace before SIGKILL."""
    every = ["--eval_every", "3", "--batch_size", "8"]
    with monkeypatch.context() as m:
        signal_in_update(m, 3)
        train.main(base_args(corpus, tmp_path, 6, *every))
    assert final_state(tmp_path)["eval_pending"]
    save, saves = checkpoint.save, []

    def save_and_signal(path, state):
        saves.append(state["step"])
        save(path, state)
        if len(saves) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(checkpoint, "save", save_and_signal)
    capsys.readouterr()
    train.main(base_args(corpus, tmp_path, 6, "--resume", *every))
    out = capsys.readouterr().out
    assert saves == [3] and final_state(tmp_path)["step"] == 3 and not final_state(tmp_path)["eval_pending"], saves
    assert f"stopped by SIGTERM: saved {tmp_path}/ckpt.pt at step 3; rerun with --resume" in out, out
    assert "step 4/6" not in out, out
    assert [r["step"] for r in metrics(tmp_path)[1]] == [3]


def start(cmd, ignore=()):
    """A job as a scheduler runs it: its own process group, so a signal can go to every process of the job. Its stop
    signals are the default ones but those in `ignore`, whatever pytest inherited (started with `&` from a script it
    ignores SIGINT, under nohup SIGHUP), since train.py keeps a signal it was started ignoring ignored."""
    def dispositions():
        for sig in data.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)
    return subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=dispositions)


def signal_group_at(proc, marker, sig):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(marker):
            os.killpg(proc.pid, sig)
            break
    try:
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a job the signal did not stop: no test leaves it training
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return "".join(lines) + rest


def test_a_job_started_here_has_the_default_stop_signals_whatever_pytest_inherited():
    """A signal pytest runs ignoring (nohup's SIGHUP, SIGINT for a job started with `&` from a script) would pass to
    the jobs the signal tests start, which train.py would keep ignoring: those tests would time out."""
    ask = "import signal; from data import STOP_SIGNALS; print([signal.getsignal(s) for s in STOP_SIGNALS])"
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGHUP, signal.SIGINT)}
    try:
        said, _ = start([sys.executable, "-c", ask]).communicate(timeout=60)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    assert "SIG_DFL" in said and "SIG_IGN" not in said, said


@pytest.mark.parametrize("sig", data.STOP_SIGNALS, ids=[s.name for s in data.STOP_SIGNALS])
def test_signal_to_the_process_group_with_workers_saves(corpus, tmp_path, sig):
    """Each signal that ends a job (SIGHUP and SIGUSR1/2 would otherwise kill it unsaved, workers first)."""
    proc = start([sys.executable, str(HERE / "train.py"), *base_args(corpus, tmp_path, 100_000, "--workers", "1")])
    output = signal_group_at(proc, "step 2/", sig)
    assert proc.returncode == 0, output[-3000:]
    assert f"stopped by {sig.name}" in output and "killed by signal" not in output
    assert 2 <= final_state(tmp_path)["step"] < 100_000


def test_a_signal_the_job_started_ignoring_stays_ignored(corpus, tmp_path):
    """nohup's SIGHUP (or `trap '' USR1`): the job was started to run through it, so it neither stops nor dies."""
    proc = start([sys.executable, str(HERE / "train.py"), *base_args(corpus, tmp_path, 6, "--workers", "1")],
                 ignore=(signal.SIGHUP,))
    output = signal_group_at(proc, "step 2/", signal.SIGHUP)
    assert proc.returncode == 0 and "SIGHUP" not in output and "step 6/6 | val loss" in output, output[-3000:]
    assert final_state(tmp_path)["step"] == 6


def test_sigterm_to_torchrun_group_saves_on_both_ranks_and_the_resume_is_bit_exact(corpus, tmp_path):
    # 2 micro-batches per rank: the signal may come within an update (dropped, made again) or at its end
    args = ["--workers", "1", "--batch_size", "2", "--eval_every", "4"]
    split, straight = tmp_path / "split", tmp_path / "straight"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / "train.py"),
           *base_args(corpus, split, 12, *args)]
    output = signal_group_at(start(cmd), "step 2/", signal.SIGTERM)
    assert "stopped by SIGTERM" in output and "killed by signal" not in output, output[-3000:]
    assert "broadcast_buffers" not in output  # DDP's FutureWarning, once per rank, says nothing about this run
    state = final_state(split)
    assert 2 <= state["step"] < 12 and state["world"] == 2 and all(state["data"])
    out = run_torchrun(base_args(corpus, split, 12, *args, "--resume"))
    assert out.count("resuming from") == 1, "said once, by rank 0"
    run_torchrun(base_args(corpus, straight, 12, *args))
    a, b = metrics(straight), metrics(split)
    assert [(r["step"], r["loss"]) for r in a[0]] == [(r["step"], r["loss"]) for r in b[0]] and a[1] == b[1]
    sa, sb = final_state(straight)["model"], final_state(split)["model"]
    for name, t in sa.items():
        assert torch.equal(t, sb[name]), f"{name} differs by {(t - sb[name]).abs().max()}"


def test_sigquit_to_torchrun_group_saves_on_both_ranks(corpus, tmp_path):
    """torchrun passes SIGQUIT (Ctrl-\\) on to its ranks as it does SIGTERM: by default it dumped their core and lost
    every update since the last checkpoint."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / "train.py"),
           *base_args(corpus, tmp_path, 100_000, "--workers", "1")]
    output = signal_group_at(start(cmd), "step 2/", signal.SIGQUIT)
    assert "stopped by SIGQUIT" in output and "killed by signal" not in output, output[-3000:]
    state = final_state(tmp_path)
    assert 2 <= state["step"] < 100_000 and state["world"] == 2 and all(state["data"])


def test_ranks_whose_torchrun_is_killed_stop_with_a_checkpoint(corpus, tmp_path):
    """torchrun's workers run in sessions of their own: a kill -9 of torchrun (or a signal it does not pass on,
    SIGUSR1 by default, which kills it) reaches no rank. Each rank then gets SIGTERM (PR_SET_PDEATHSIG) and stops
    with a checkpoint of both ranks, instead of training on unwatched to the end."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / "train.py"),
           *base_args(corpus, tmp_path, 60, "--workers", "1", "--batch_size", "2")]
    output = signal_group_at(start(cmd), "step 2/", signal.SIGKILL)  # the ranks write to the same pipe
    assert "stopped by SIGTERM" in output and "killed by signal" not in output, output[-3000:]
    state = final_state(tmp_path)
    assert 2 <= state["step"] < 60 and state["world"] == 2 and all(state["data"])


def kill_rank_at(cmd, marker, rank=1, after=0.0):
    """Runs cmd (torchrun) and SIGKILLs one rank `after` seconds past the first output line starting with marker, as
    the OOM killer does: no handler sees it. Returns (torchrun's exit code, the whole output)."""
    from suite import process_tree
    proc, lines = start(cmd), []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):
                time.sleep(after)
                pids = [pid for pid in process_tree(proc.pid) if pid != proc.pid and
                        f"\0RANK={rank}\0".encode() in b"\0" + open(f"/proc/{pid}/environ", "rb").read()]
                assert len(pids) == 1, pids
                os.kill(pids[0], signal.SIGKILL)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, "".join(lines) + rest


def test_a_rank_killed_mid_run_leaves_the_others_one_line_and_the_last_checkpoint(corpus, tmp_path):
    """One rank killed outright (the OOM killer's SIGKILL, which no handler sees) while the others train: each rank
    left finds its next collective failed (gloo here, NCCL on GPUs) and says so in one line, with the checkpoint to
    resume from, where it printed gloo's traceback from inside backward. torchrun then reports the dead rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(HERE / "train.py"),
           *base_args(corpus, tmp_path, 200, "--total_batch_size", "6", "--batch_size", "2", "--save_every", "2")]
    returncode, output = kill_rank_at(cmd, "step 5/")  # saved at step 4
    assert returncode != 0, output[-3000:]
    for rank in (0, 2):
        said = [line for line in output.splitlines() if line.startswith(f"rank {rank}: ")]
        assert len(said) == 1 and "a collective with the other ranks failed" in said[0], output[-3000:]
        assert "rerun with --resume" in said[0] and "ckpt.pt (step " in said[0], said[0]
    assert 'train.py", line' not in output, output[-3000:]  # no traceback through train.py
    state = final_state(tmp_path)
    assert 4 <= state["step"] < 200 and state["world"] == 3


def test_a_rank_killed_while_rank_0_writes_a_checkpoint_leaves_the_line_naming_that_one(corpus, tmp_path):
    """Rank 1 killed while rank 0 writes the checkpoint of update 4 (tens of seconds at 7b): the write ends whole,
    then the ranks' agreement on it fails. Rank 0's line names that checkpoint's step, not the one before it."""
    script = tmp_path / "slow_save.py"  # train.py whose checkpoint writes take 3 s
    script.write_text(f"import sys, time\nsys.path.insert(0, {str(HERE)!r})\nimport checkpoint, train\n"
                      "save = checkpoint.save\ndef slow(path, state):\n"
                      "    print(f'saving step {state[\"step\"]}', flush=True)\n    time.sleep(3)\n"
                      "    save(path, state)\ncheckpoint.save = slow\ntrain.main(sys.argv[1:])\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *base_args(corpus, tmp_path / "out", 200, "--batch_size", "2", "--save_every", "2")]
    output = kill_rank_at(cmd, "saving step 4")[1]
    said = [line for line in output.splitlines() if line.startswith("rank 0: ")]
    assert len(said) == 1 and "a collective with the other ranks failed" in said[0], output[-3000:]
    assert final_state(tmp_path / "out")["step"] == 4
    assert said[0].endswith(f"rerun with --resume {tmp_path}/out/ckpt.pt (step 4)"), said[0]


def test_ranks_whose_torchrun_is_killed_while_they_set_up_end_too(corpus, tmp_path):
    """Reading the data and building the model can take minutes: a torchrun killed meanwhile must not leave its ranks
    to train on unwatched once built. Nothing is trained yet: the SIGTERM they are sent ends them with one line."""
    script = tmp_path / "slow_build.py"  # train.py whose build() takes 30 s (cut short by the kill)
    script.write_text(f"import sys, time\nsys.path.insert(0, {str(HERE)!r})\nimport train\nbuild = train.build\n"
                      "train.build = lambda *a: (print('building', flush=True), time.sleep(30), build(*a))[-1]\n"
                      "train.main(sys.argv[1:])\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *base_args(corpus, tmp_path / "out", 4, "--workers", "1", "--batch_size", "2")]
    output = signal_group_at(start(cmd), "building", signal.SIGKILL)
    assert "step 1/" not in output and not (tmp_path / "out" / "ckpt.pt").exists(), output[-3000:]
    assert "stopped by SIGTERM before the first update: nothing was saved" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def slow_on_rank(tmp_path, name, rank, what):
    """train.py as a script whose train.<what> on one rank says `name` and then takes 30 s: the other ranks go on
    to their next collective and wait there, as they do while a rank loads a large checkpoint or builds a model."""
    script = tmp_path / f"{name}.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {str(HERE)!r})\nimport train\nslow = train.{what}\n"
                      f"def {what}(*a):\n    if os.environ['RANK'] == '{rank}':\n"
                      f"        print({name!r}, flush=True)\n        time.sleep(30)\n    return slow(*a)\n"
                      f"train.{what} = {what}\ntrain.main(sys.argv[1:])\n")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]


def test_a_rank_killed_while_the_ranks_set_up_leaves_the_others_one_line(corpus, tmp_path):
    """A rank killed before the first update (the OOM killer, as every rank reads the checkpoint it resumes): the
    rank waiting for it in a collective of the setup (here DDP's broadcast of the supports) says so in one line, as
    mid-run, where it printed gloo's traceback through train.py."""
    cmd = slow_on_rank(tmp_path, "building", 1, "build") + base_args(corpus, tmp_path / "out", 4, "--batch_size", "2")
    output = kill_rank_at(cmd, "building", after=1.0)[1]  # rank 0 is in the broadcast of the supports by then
    said = [line for line in output.splitlines() if line.startswith("rank 0: ")]
    assert len(said) == 1 and "setting up the run: a collective with the other ranks failed" in said[0], output[-3000:]
    assert "Nothing was trained yet: run the same command again" in said[0], said[0]
    assert 'train.py", line' not in output and "[rank0]" not in output, output[-3000:]
    assert not (tmp_path / "out" / "ckpt.pt").exists()


@pytest.mark.parametrize("eval_only", [False, True], ids=["train", "eval-only"])
def test_a_stop_signal_while_one_rank_still_sets_up_is_one_line(corpus, tmp_path, eval_only):
    """torchrun passes the signal to every rank at once; one still setting up (rank 0 here, after the last collective
    of the setup) stops before the first update, while the other, set up, waits for it in its first collective (the
    metrics opened, or the evaluation's). That one must stop with it in silence, where it printed gloo's traceback
    through train.py, or said that a rank had died."""
    out = tmp_path / "out"
    if eval_only:
        train.main(base_args(corpus, out, 1))
    args = eval_args(corpus, out) if eval_only else base_args(corpus, out, 4, "--batch_size", "2")
    output = signal_group_at(start(slow_on_rank(tmp_path, "describing", 0, "describe") + args), "describing",
                             signal.SIGTERM)
    assert output.count("stopped by SIGTERM before the first update: nothing was saved") == 1, output[-3000:]
    assert 'train.py", line' not in output and "[rank1]" not in output, output[-3000:]
    assert "a collective with the other ranks failed" not in output and "step 1/" not in output, output[-3000:]
    assert final_state(out)["step"] == 1 if eval_only else not (out / "ckpt.pt").exists()


def test_ranks_whose_torchrun_is_killed_while_they_import_torch_end_too(corpus, tmp_path):
    """A rank asks for its parent-death signal before torch's import (seconds): asked after it, from a torchrun
    already gone, it is never sent, and the rank waited in init_process_group for the dead agent's store (minutes,
    holding its GPU). Killed 1 s after its start, mid-import, it ends at once."""
    from suite import process_tree
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / "train.py"),
           *base_args(corpus, tmp_path, 4, "--workers", "1", "--batch_size", "2")]
    proc = start(cmd)
    try:
        deadline = time.monotonic() + 120
        while len(ranks := process_tree(proc.pid) - {proc.pid}) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(ranks) == 2, "torchrun started no ranks"
        time.sleep(1.0)  # their Python has started; torch's import has not ended
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

        def alive():  # not ended, nor a zombie its new parent has yet to reap
            return [pid for pid in ranks if os.path.exists(f"/proc/{pid}") and
                    open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        deadline = time.monotonic() + 20
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive() and not (tmp_path / "ckpt.pt").exists()
    finally:
        for pid in process_tree(proc.pid) | ranks:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_cpu_allocation_refused_mid_run_is_one_line_and_keeps_the_checkpoint(corpus, tmp_path):
    """Under a limit on the address space (`ulimit -v`, a scheduler's h_vmem) a CPU's allocator raises where a GPU's
    raises OutOfMemoryError: the same line, not a traceback. At update 4 the process is held to the size it has and
    the model's forward asks for a GiB more, as a longer batch's activations would; the run ends under that limit."""
    script = ("import resource, runpy, sys, torch, model\n"
              "forward, calls = model.LLaMA.forward, []\n"
              "def limited(self, *a, **k):\n"
              "    calls.append(self.training and a[0].shape[0] == 4)  # a micro-batch's (not the flags' estimate)\n"
              "    if calls.count(True) == 7:  # update 4's first (two an update)\n"
              "        size = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize'))\n"
              "        resource.setrlimit(resource.RLIMIT_AS, (size * 1024, resource.RLIM_INFINITY))\n"
              "        torch.empty(2**30, dtype=torch.uint8)\n"
              "    return forward(self, *a, **k)\n"
              "model.LLaMA.forward = limited\n"
              f"sys.argv = ['train.py'] + {base_args(corpus, tmp_path, 6, '--save_every', '2')!r}\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    ckpt = tmp_path / "ckpt.pt"
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"out of memory in update 4; the last checkpoint is {ckpt}, step 2: rerun with --resume {ckpt} and "
        "--batch_size 2 (the same 8 sequences per update, in more micro-batches)"), run.stderr[-3000:]
    assert final_state(tmp_path)["step"] == 2 and "step 3/6" in run.stdout and "step 4/6" not in run.stdout


def test_out_of_memory_mid_run_is_one_line_and_its_advice_works(corpus, tmp_path, monkeypatch):
    """A GPU's OutOfMemoryError after the checks passed (here raised in update 3, then in an evaluation): one line
    naming where, the last checkpoint and a micro-batch that divides the update; following it finishes the run."""
    train_step = train.train_step

    def no_memory(*_):
        raise torch.OutOfMemoryError("CUDA out of memory")

    def oom_at(n):
        def step(args, run, micro_batches, stop):
            if len(metrics(args.out_dir)[0]) + 1 == n:  # the update about to be made
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            return train_step(args, run, micro_batches, stop)
        return step
    with monkeypatch.context() as m:
        m.setattr(train, "train_step", oom_at(1))
        with pytest.raises(SystemExit, match=r"^out of memory in update 1; no checkpoint was saved yet: start again "
                                             r"with --batch_size 2 \(the same 8 sequences per update"):
            train.main(base_args(corpus, tmp_path, 6, "--save_every", "2"))
        m.setattr(train, "train_step", oom_at(3))
        ckpt = tmp_path / "ckpt.pt"
        with pytest.raises(SystemExit, match=rf"^out of memory in update 3; the last checkpoint is {ckpt}, step 2: "
                                             rf"rerun with --resume {ckpt} and --batch_size 2 \(the same 8"):
            train.main(base_args(corpus, tmp_path, 6, "--save_every", "2", "--overwrite"))
    with monkeypatch.context() as m:  # the advice, whose smaller batch then fails in the evaluation before a save
        m.setattr(train, "evaluate", no_memory)
        with pytest.raises(SystemExit, match=r"^out of memory in the evaluation or checkpoint after update 4; the last "
                                             r"checkpoint is .*, step 2: rerun with --resume .* and --batch_size 1 "):
            train.main(base_args(corpus, tmp_path, 6, "--save_every", "2", "--eval_every", "4", "--resume", str(ckpt),
                                 "--batch_size", "2"))
    train.main(base_args(corpus, tmp_path, 6, "--save_every", "2", "--resume", str(ckpt), "--batch_size", "1"))
    assert final_state(tmp_path)["step"] == 6
    with monkeypatch.context() as m:  # at batch 1 nothing divides smaller: recompute the blocks instead
        m.setattr(train, "train_step", oom_at(1))
        with pytest.raises(SystemExit, match=r"start again with --activation_checkpointing and --overwrite \(it "
                                             r"replaces this run's rows\)$"):
            train.main(base_args(corpus, tmp_path / "b1", 2, "--batch_size", "1"))
        m.setattr(train, "evaluate", no_memory)
        said = r"^out of memory in the evaluation; rerun --eval_only with --batch_size 2$"  # half of 4
        with pytest.raises(SystemExit, match=said):
            train.main(eval_args(corpus, tmp_path))
        with pytest.raises(SystemExit, match=r"rerun --eval_only with --batch_size 2$"):  # any batch: half of 5
            train.main(eval_args(corpus, tmp_path, "--batch_size", "5"))
        with pytest.raises(SystemExit, match=r"rerun --eval_only with more memory \(a higher address-space limit\)$"):
            train.main(eval_args(corpus, tmp_path, "--batch_size", "1"))
        m.setattr(train, "train_step", oom_at(3))  # at batch 1, recomputing: --resume keeps the size
        with pytest.raises(SystemExit, match=r"step 2: rerun with --resume .* and more memory \(a higher "
                                             r"address-space limit\)$"):  # (a CPU's run: a GPU's names a GPU)
            train.main(base_args(corpus, tmp_path / "ac", 4, "--batch_size", "1", "--activation_checkpointing",
                                 "--save_every", "2"))
    train.main(eval_args(corpus, tmp_path, "--batch_size", "1"))
    def wrapped(*_):  # as torch.compile reports an error in the code it runs
        try:
            no_memory()
        except torch.OutOfMemoryError as e:
            raise RuntimeError("compiled code failed") from e
    with monkeypatch.context() as m:
        m.setattr(train, "train_step", wrapped)
        with pytest.raises(SystemExit, match=r"^out of memory in update 1; no checkpoint was saved yet"):
            train.main(base_args(corpus, tmp_path / "wrapped", 6))
        m.setattr(train, "train_step", lambda *_: (_ for _ in ()).throw(RuntimeError("not memory")))
        with pytest.raises(RuntimeError, match="^not memory$"):  # any other error stays itself
            train.main(base_args(corpus, tmp_path / "other", 6))
    with monkeypatch.context() as m:  # a stop within update 3, whose checkpoint of update 2 checks a forward first
        signal_in_micro_batch(m, 5)  # 2 micro-batches per update: the first of update 3
        m.setattr(keeper, "checked_loss", no_memory)
        with pytest.raises(SystemExit, match=r"^out of memory in the checkpoint of update 2, on a stop signal; no "
                                             r"checkpoint was saved yet: start again with --batch_size 2 "):
            train.main(base_args(corpus, tmp_path / "stop", 6))


def test_a_fault_of_a_rank_of_its_own_is_said_by_that_rank(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOCAL_RANK", "1")
    for fault, code in ((SystemExit("bad input every rank meets"), 1), (train.RankFault("rank 1: out of memory"),
                                                                        "rank 1: out of memory")):
        with pytest.raises(SystemExit) as e:
            train.rank_0_speaks(lambda: (_ for _ in ()).throw(fault))()
        assert e.value.code == code
    # under torchrun the line is said at once, not at exit after the process group's teardown (which NCCL may hold)
    args = argparse.Namespace(total_batch_size=8, batch_size=4, eval_only=False, activation_checkpointing=False,
                              out_dir=str(tmp_path / "out"))
    run = argparse.Namespace(world=2, rank=1, device=torch.device("cpu"))
    ckpt = tmp_path / "out" / "ckpt.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"saved")  # named to rerun from while it is there
    fault = train.out_of_memory(args, run, "update 3", [str(ckpt), 2])
    assert isinstance(fault, train.RankFault) and fault.code == 1
    assert capsys.readouterr().err == (f"rank 1: out of memory in update 3; the last checkpoint is {ckpt}, step 2: "
                                       f"rerun with --resume {ckpt} and --batch_size 2 (the same 8 sequences per "
                                       "update, in more micro-batches)\n")


@pytest.mark.parametrize("lr, why", [
    # one update at lr 1e9 leaves the parameters finite (near 1e9) but the next forward NaN
    ("1e9", "has non-finite parameters or loss"),
    # at lr 30 the tiny model's loss explodes to some 20,000 after one update, finite, far past 2·ln 96 = 9.13
    ("30", r"has a loss on a validation batch of \d+\.\d\d, above 2·ln V = 9\.13 \(V = 96\): worse than a uniform "
          "guess, V times over")])
def test_diverged_run_never_saves_a_diverged_model_and_its_advice_works(corpus, tmp_path, lr, why):
    diverge = ["--lr", lr, "--warmup_steps", "0", "--save_every", "1"]
    with pytest.raises(SystemExit, match=f"^the model after step 1 {why}; stopping. No checkpoint was saved yet: start "
                                         "again with a lower --lr"):
        train.main(base_args(corpus, tmp_path, 6, *diverge))
    assert not (tmp_path / "ckpt.pt").exists()
    train.main(base_args(corpus, tmp_path, 4, "--save_every", "1", "--overwrite"))  # the advice, followed
    good = (tmp_path / "ckpt.pt").read_bytes()
    # a run that diverges after good checkpoints keeps the last of them, and says how to go on from it
    with pytest.raises(SystemExit, match=f"^the model after step 5 {why}") as e:
        train.main(base_args(corpus, tmp_path, 8, "--resume", *diverge))
    assert (tmp_path / "ckpt.pt").read_bytes() == good and final_state(tmp_path)["step"] == 4
    assert f"last good checkpoint is {tmp_path}/ckpt.pt, step 4 (no diverged model is ever saved)" in str(e.value)
    assert f"--resume {tmp_path}/ckpt.pt and a lower --lr" in str(e.value)
    train.main(base_args(corpus, tmp_path, 8, "--resume", "--lr", "1e-3"))  # the advice, followed
    rows, evals = metrics(tmp_path)
    assert final_state(tmp_path)["step"] == 8 and [r["step"] for r in rows] == list(range(1, 9))
    assert math.isfinite(evals[-1]["val_loss"])


def test_a_run_resumed_from_a_lone_checkpoint_that_stops_before_its_first_save_names_a_rerun_that_is_taken(
        corpus, tmp_path):
    """A checkpoint shared without its metrics.jsonl, resumed into a new --out_dir: the run's rows there start after
    its step, and nothing beside the checkpoint tells them from another run's, so a rerun before the first save there
    is refused for them. The rerun that a divergence (or a failed write) names must be one that is taken."""
    lone, out = tmp_path / "shared" / "ckpt.pt", tmp_path / "b"
    train.main(base_args(corpus, tmp_path / "a", 8, "--stop_after", "2"))
    lone.parent.mkdir()
    shutil.copy(tmp_path / "a" / "ckpt.pt", lone)
    with pytest.raises(SystemExit, match="^non-finite loss or gradient norm at step 4") as e:
        train.main(base_args(corpus, out, 8, "--resume", str(lone), "--lr", "1e9", "--warmup_steps", "0"))
    assert f"rerun with --resume {lone} --overwrite and a lower --lr" in str(e.value)
    assert keeper.go_on_from([str(lone), 2], str(out)) == f"rerun with --resume {lone} --overwrite (step 2)"
    with pytest.raises(SystemExit, match="holds the rows of a run that saved no checkpoint"):  # why it is needed
        train.main(base_args(corpus, out, 8, "--resume", str(lone), "--lr", "1e-3"))
    train.main(base_args(corpus, out, 8, "--resume", str(lone), "--overwrite", "--lr", "1e-3"))  # the advice, taken
    assert final_state(out)["step"] == 8 and [r["step"] for r in metrics(out)[0]] == list(range(3, 9))
    # beside its rows, the same run's rerun is taken as it is: no --overwrite
    with pytest.raises(SystemExit, match="^non-finite loss") as e:
        train.main(base_args(corpus, tmp_path / "c", 8, "--resume", str(tmp_path / "a"), "--lr", "1e9"))
    assert f"rerun with --resume {tmp_path / 'a'}/ckpt.pt and a lower --lr" in str(e.value)


def test_a_resume_of_a_run_that_saved_nothing_names_the_fix_that_works_at_once(corpus, tmp_path):
    """A run that diverged before its first save, rerun with --resume: "no checkpoint ...; drop --resume", whose
    rerun was then refused for the rows left behind, naming --overwrite. The one line names both."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="No checkpoint was saved yet"):
        train.main(base_args(corpus, out, 4, "--lr", "1e9", "--warmup_steps", "0"))
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, out, 4, "--resume"))
    assert str(e.value.code) == (f"--resume: no checkpoint at {out}/ckpt.pt; pass its path with --resume or drop "
                                 f"--resume and pass --overwrite (it replaces the rows in {out} of a run that saved no "
                                 "checkpoint)")
    train.main(base_args(corpus, out, 4, "--overwrite"))  # the advice, taken at once
    assert final_state(out)["step"] == 4
    with pytest.raises(SystemExit, match=rf"no checkpoint at {tmp_path}/empty/ckpt.pt; pass its path with --resume "
                                         r"or drop --resume$"):  # no rows there: dropping --resume is enough
        train.main(base_args(corpus, tmp_path / "empty", 4, "--resume"))


def test_a_divergence_after_its_last_good_checkpoint_is_gone_names_no_rerun_from_it(corpus, tmp_path, monkeypatch):
    """A resume from another folder, deleted once read (the run goes on into its own --out_dir), diverges before its
    first save there: the message named the deleted checkpoint to rerun from, a rerun refused as having none."""
    source, out, step = tmp_path / "a", tmp_path / "b", train.train_step
    train.main(base_args(corpus, source, 8, "--stop_after", "2"))

    def deleting(*a, **k):
        shutil.rmtree(source, ignore_errors=True)
        return step(*a, **k)
    monkeypatch.setattr(train, "train_step", deleting)
    with pytest.raises(SystemExit, match=rf"^non-finite loss or gradient norm at step \d; stopping. The last good "
                                         rf"checkpoint, {source}/ckpt.pt \(step 2\), is gone: start again with a "
                                         r"lower --lr \(or --grad_clipping\) and --overwrite"):
        train.main(base_args(corpus, out, 8, "--resume", str(source), "--lr", "1e9", "--warmup_steps", "0"))
    monkeypatch.undo()
    train.main(base_args(corpus, out, 2, "--overwrite"))  # the advice, followed
    assert final_state(out)["step"] == 2


def test_out_of_memory_after_its_last_checkpoint_is_gone_names_no_rerun_from_it(corpus, tmp_path, monkeypatch):
    """As a divergence: a run resumed from another folder, deleted once read, runs out of memory before its first
    save: the line named the deleted checkpoint to rerun from, a rerun refused as having none. It says the checkpoint
    is gone and to start again (a smaller --size among the fixes, which a resume would refuse)."""
    source, out, step = tmp_path / "a", tmp_path / "b", train.train_step
    train.main(base_args(corpus, source, 8, "--stop_after", "2"))

    def deleting_then_no_memory(*a, **k):
        shutil.rmtree(source, ignore_errors=True)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(train, "train_step", deleting_then_no_memory)
    with pytest.raises(SystemExit, match=rf"^out of memory in update 3; the last checkpoint, {source}/ckpt.pt \(step "
                                         r"2\), is gone: start again with --batch_size 2 \(the same 8 sequences per "
                                         r"update, in more micro-batches\) and --overwrite \(it replaces"):
        train.main(base_args(corpus, out, 8, "--resume", str(source)))
    monkeypatch.setattr(train, "train_step", step)
    train.main(base_args(corpus, out, 2, "--overwrite", "--batch_size", "2"))  # the advice, followed
    assert final_state(out)["step"] == 2


def test_the_fixes_after_a_stop_name_a_checkpoint_to_rerun_from_only_while_it_is_there(tmp_path):
    """keeper.go_on_from, which a lost rank's and a signalled evaluation's lines end with, as a failed write's: a
    checkpoint there is named to rerun from; one gone since is said gone, with the start again."""
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"x")
    assert keeper.go_on_from([str(ckpt), 4], str(tmp_path)) == f"rerun with --resume {ckpt} (step 4)"
    ckpt.unlink()
    assert keeper.go_on_from([str(ckpt), 4], str(tmp_path)) == (
        f"the last checkpoint, {ckpt} (step 4), is gone: start again with --overwrite (it replaces this run's rows)")
    assert keeper.go_on_from([], str(tmp_path)) == "start again with --overwrite (it replaces this run's rows)"


def test_an_exploded_validation_loss_stops_the_run_before_its_row(corpus, tmp_path):
    """An evaluation between saves judges the model too: a finite validation loss past 2·ln V stops the run, naming
    it, and is not recorded as a result. Training losses are logged as they are (a spike may come back)."""
    with pytest.raises(SystemExit, match=r"^the validation loss after step 2 is \d+\.\d\d, above 2·ln V = 9\.13 \(V = "
                                         r"96\): worse than a uniform guess, V times over; stopping. No checkpoint"):
        train.main(base_args(corpus, tmp_path, 6, "--lr", "3", "--warmup_steps", "0", "--eval_every", "2"))
    rows, evals = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and evals == [] and not (tmp_path / "ckpt.pt").exists()
    assert max(r["loss"] for r in rows) > 2 * math.log(96), rows  # shown: the update that blew it up is the first


def test_exploded_is_past_twice_ln_v_and_a_fresh_model_is_far_from_it():
    """2·ln V: the right tokens get under 1/V² of probability, V times less than a uniform guess. A fresh model sits
    near ln V, above it by half its logits' variance (about 0.0002 × its width): 0.8 at 7b's width."""
    assert keeper.exploded(2 * math.log(96), 96) is None and keeper.exploded(9.14, 96).startswith("9.14, above 2·ln V")
    assert keeper.exploded(math.inf, 96) == "inf" and keeper.exploded(math.nan, 96) == "nan"
    assert keeper.exploded(20.8, 32000) and keeper.exploded(20.7, 32000) is None
    torch.manual_seed(0)
    config = replace(config_for("7b", method="lowrank"), n_layers=1, ffn_dim=64, rank=8, vocab_size=96)  # its width
    loss = float(keeper.checked_loss(LLaMA(config), (torch.randint(96, (4, 256)), torch.randint(96, (4, 256))), "cpu"))
    assert 0.5 < loss - math.log(96) < 1.1 and keeper.exploded(loss, 96) is None, loss


def test_damaged_checkpoint_is_one_clear_line(corpus, tmp_path):
    train.main(base_args(corpus, tmp_path, 2))
    path = tmp_path / "ckpt.pt"
    good = path.read_bytes()
    weight = max((t for t in final_state(tmp_path)["model"].values() if t.is_floating_point()), key=torch.numel)
    at = good.index(weight.numpy().tobytes()[:64]) + 7
    for name, damaged in [("truncated", good[: len(good) // 2]), ("empty", b""), ("zeroed", bytes(4096) + good[4096:]),
                          ("flipped", good[:at] + bytes([good[at] ^ 0x10]) + good[at + 1:])]:
        path.write_bytes(damaged)
        with pytest.raises(SystemExit, match=f"checkpoint {path} .*restore it from a copy") as e:
            train.main(base_args(corpus, tmp_path, 4, "--resume"))
        assert "\n" not in str(e.value), name


def test_a_whole_torch_file_of_another_program_is_not_called_damaged(tmp_path):
    """torch.save of a whole module, or of a dict holding an argparse.Namespace (another repo's checkpoint): whole files
    that a weights-only load refuses. They were "damaged ... restore it from a copy", a fix that cannot work; a
    checkpoint cut short or changed inside its pickle is still called damaged."""
    other = ("pass a checkpoint that train.py or export.py --merged wrote (a run's ckpt.pt, or its folder); a Hugging "
             "Face export is not read back")
    for name, obj in [("module.pt", torch.nn.Linear(2, 2)), ("namespace.pt", {"args": argparse.Namespace(lr=0.1)})]:
        torch.save(obj, tmp_path / name)
        with pytest.raises(ValueError) as e:
            checkpoint.load(tmp_path / name)
        assert str(e.value).startswith(f"{tmp_path / name} was not written by train.py: it holds Python objects that "
                                       "a weights-only load refuses (") and str(e.value).endswith(f"); {other}") \
            and "damaged" not in str(e.value), e.value
    checkpoint.save(tmp_path / "ckpt.pt", {"model": {"w": torch.randn(4, 4)}, "step": 3})
    good = (tmp_path / "ckpt.pt").read_bytes()
    at = good.index(b"torch._utils") + 8  # a byte of a global's name in the pickle: torch then refuses the global
    for damaged in (good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1:], good[: len(good) // 2]):
        (tmp_path / "ckpt.pt").write_bytes(damaged)
        with pytest.raises(ValueError, match=r"cannot be read \(\w+\); it is damaged"):
            checkpoint.load(tmp_path / "ckpt.pt")


def test_checkpoint_command_checks_a_file_or_its_folder(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 1))
    capsys.readouterr()
    checkpoint.main([str(tmp_path), str(tmp_path / "ckpt.pt")])
    assert capsys.readouterr().out == f"{tmp_path}/ckpt.pt: ok, step 1\n" * 2
    (tmp_path / "empty").mkdir()
    # every path is checked, a bad one said in one line, and the exit is non-zero at the end
    with pytest.raises(SystemExit, match=r"^2 of 3 checkpoint\(s\) not whole$"):
        checkpoint.main([str(tmp_path / "missing.pt"), str(tmp_path / "empty"), str(tmp_path)])
    said = capsys.readouterr()
    assert said.out == f"{tmp_path}/ckpt.pt: ok, step 1\n", said.out
    assert said.err == (f"no checkpoint at {tmp_path}/missing.pt; pass a ckpt.pt that train.py wrote, or its "
                        f"--out_dir\nno checkpoint at {tmp_path}/empty/ckpt.pt; pass a ckpt.pt that train.py wrote, "
                        "or its --out_dir\n"), said.err
    for argv in ([], ["--help"]):  # a usage line; --help is help, not a path
        with pytest.raises(SystemExit):
            checkpoint.main(argv)
    assert "verify checkpoints" in capsys.readouterr().out


def test_the_checkpoint_command_read_by_a_reader_that_stops_ends_quietly(tmp_path):
    """`python checkpoint.py out/*/ckpt.pt | head -1`: each line after the reader's end failed with "[Errno 32] Broken
    pipe", which was counted as a checkpoint not whole: "3 of 4 checkpoint(s) not whole" of four whole ones. It reads
    and writes no file, so the reader's end ends it (SIGPIPE's default)."""
    paths = [str(tmp_path / f"{i}.pt") for i in range(4)]
    for step, path in enumerate(paths):
        checkpoint.save(path, {"step": step, "w": torch.ones(3)})
    status, err = read_then_stop([str(HERE / "checkpoint.py"), *paths])
    assert quiet(err) and "not whole" not in err and status in (0, -signal.SIGPIPE), (status, err)


@contextmanager
def tmpfs(mnt, size):
    """A real disk of `size` bytes at mnt (skipped without root), unmounted lazily at the end, as a failed run may
    still hold a file open there."""
    mnt.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size)}", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@contextmanager
def small_disk(corpus, tmp_path, checkpoints):
    """A disk with room for `checkpoints` checkpoints of the tiny run."""
    train.main(base_args(corpus, tmp_path / "probe", 1))
    with tmpfs(tmp_path / "small", (tmp_path / "probe" / "ckpt.pt").stat().st_size * checkpoints) as mnt:
        yield mnt


def test_disk_full_is_named_wherever_the_write_stops(tmp_path):
    """Where the disk fills decides how torch's zip writer fails: with the OSError (ENOSPC) itself, or later with a
    RuntimeError of its own that has no errno. Both are a full disk, the old file stays whole, no partial file stays."""
    old, new = {"w": torch.arange(100.0)}, {"w": torch.randn(300_000)}  # 1.2 MB; the sizes below fill up inside it
    for kb in range(1000, 1175, 25):
        with tmpfs(tmp_path / f"disk{kb}", kb * 1024) as mnt:
            with pytest.raises(checkpoint.SaveFailed, match=r"^disk full: could not write .*ckpt.pt \(No space left on "
                                                            r"device\); none was saved there yet$"):
                checkpoint.save(mnt / "ckpt.pt", new)
            checkpoint.save(mnt / "ckpt.pt", old)
            with pytest.raises(checkpoint.SaveFailed, match=r"\(No space left on device\); the previous checkpoint "
                                                            "there is kept$"):
                checkpoint.save(mnt / "ckpt.pt", new)
            assert os.listdir(mnt) == ["ckpt.pt"], f"{kb} kB: {os.listdir(mnt)}"
            assert torch.equal(checkpoint.load(mnt / "ckpt.pt")["w"], old["w"]), f"{kb} kB: the old file changed"


@pytest.mark.parametrize("failing", [1, 2])
def test_a_write_the_filesystem_refuses_is_one_line_and_keeps_what_was_saved(corpus, tmp_path, monkeypatch, failing):
    """Not a full disk alone: any error the filesystem gives a checkpoint's write (here EFBIG; read-only, failing or
    lost permissions alike) stops the run in one line naming it, leaves no partial file and keeps the last checkpoint,
    from which the run resumes once the cause is gone."""
    save, calls = checkpoint.save, []

    def save_under_a_limit_from_the_failing_call(path, state):
        calls.append(path)
        with file_size_limit(4096) if len(calls) >= failing else suppress():  # the checkpoint is a few MB
            save(path, state)

    monkeypatch.setattr(checkpoint, "save", save_under_a_limit_from_the_failing_call)
    then = r"then start again with --overwrite \(it replaces this run's rows\)" if failing == 1 else \
        rf"then rerun with --resume {tmp_path}/ckpt.pt \(step 1\)"
    kept = "none was saved there yet" if failing == 1 else "the previous checkpoint there is kept"
    with pytest.raises(SystemExit, match=rf"^could not write {tmp_path}/ckpt.pt \(File too large\); {kept}\. See to "
                                         rf"the cause \(.*\) or pass a new --out_dir, {then}$") as e:
        train.main(base_args(corpus, tmp_path, 4, "--save_every", "1"))
    assert "\n" not in str(e.value) and not list(tmp_path.glob("*.tmp"))
    if failing == 1:
        assert not (tmp_path / "ckpt.pt").exists()
        return
    assert final_state(tmp_path)["step"] == 1
    monkeypatch.setattr(checkpoint, "save", save)
    train.main(base_args(corpus, tmp_path, 4, "--save_every", "1", "--resume"))
    assert final_state(tmp_path)["step"] == 4


def test_atomic_file_leaves_the_old_file_whole_on_any_error(tmp_path):
    """checkpoint.atomic_file, under checkpoints, metrics rewrites, exports and bench results: an error or a Ctrl-C
    while writing leaves the earlier file as it was and no partial one; a write that ends replaces it."""
    path = tmp_path / "f"
    path.write_bytes(b"old")
    for error in (OSError(errno.EIO, "Input/output error"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with checkpoint.atomic_file(path) as f:
                f.write(b"new, cut short")
                raise error
        assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]
    with checkpoint.atomic_file(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.EOPNOTSUPP], ids=["EINVAL", "EOPNOTSUPP"])
def test_a_filesystem_that_cannot_sync_a_folder_still_saves(tmp_path, monkeypatch, refusal):
    """Some filesystems (CIFS, some FUSE and network ones) refuse fsync on a folder. The folder's fsync comes after
    the rename, so the new checkpoint was in place, yet save() reported a failed write with "the previous checkpoint
    there is kept" (and train.py stopped, naming the step before). The file and the rename are what count: saved."""
    path, real = tmp_path / "ckpt.pt", os.fsync
    checkpoint.save(path, {"step": 1, "w": torch.zeros(3)})

    def no_folder_sync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(refusal, os.strerror(refusal))
        real(fd)
    monkeypatch.setattr(os, "fsync", no_folder_sync)
    checkpoint.save(path, {"step": 2, "w": torch.ones(3)})
    assert checkpoint.load(path)["step"] == 2 and os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_folder_sync_that_fails_after_the_rename_says_the_new_checkpoint_is_in_place(corpus, tmp_path,
                                                                                     monkeypatch):
    """A failing disk's I/O error at the folder's fsync comes after the new checkpoint was written, fsynced and
    renamed into place: the run said the write had failed, "the previous checkpoint there is kept", and named the
    step before as the one to rerun from, when the file there was the new one. It says what is so, and the rerun
    goes on from the new step."""
    real, folder_syncs = os.fsync, []

    def failing_folder_sync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            folder_syncs.append(fd)
            if len(folder_syncs) == 2:  # the second checkpoint's
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)
    monkeypatch.setattr(os, "fsync", failing_folder_sync)
    with pytest.raises(SystemExit) as e:
        train.main(base_args(corpus, tmp_path, 4, "--save_every", "1"))
    assert str(e.value).startswith(f"wrote {tmp_path}/ckpt.pt, but could not sync its folder (Input/output error): "
                                   "the new checkpoint is in place, and a crash of the machine may lose it. "), e.value
    assert str(e.value).endswith("(step 2)"), e.value
    assert final_state(tmp_path)["step"] == 2 and not list(tmp_path.glob("*.tmp"))


def test_two_writers_of_one_file_never_write_into_the_same_temporary(tmp_path):
    """Two runs saving into one folder at once (a requeued job beside the old one still ending) once shared
    path.tmp: the second truncated the first's file mid-write and moved it away, so a save reported as done was
    damaged. Each writer now has a temporary of its own: the last to finish wins, whole."""
    path = tmp_path / "ckpt.pt"
    with checkpoint.atomic_file(path) as first:
        first.write(b"A" * 1000)
        with checkpoint.atomic_file(path) as second:
            second.write(b"B" * 2000)
        first.write(b"A" * 1000)
    assert path.read_bytes() == b"A" * 2000 and os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_run_into_a_folder_another_run_writes_is_refused_before_any_work(corpus, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(train, "build", lambda *args: built.append(args))
    with checkpoint.folder_lock(str(tmp_path / "run")):  # another run, alive
        for extra in ([], ["--overwrite"]):
            with pytest.raises(SystemExit, match=rf"^--out_dir: another process \(pid {os.getpid()}\) is writing into "
                                                 rf"{tmp_path}/run; wait for it to end, or pass a new --out_dir$"):
                train.main(base_args(corpus, tmp_path / "run", 4, *extra))
    assert not built
    # a run refused for another reason leaves no folder (nor lock file) it made
    with pytest.raises(SystemExit, match="no checkpoint at"):
        train.main(base_args(corpus, tmp_path / "none", 4, "--resume"))
    assert not (tmp_path / "none").exists() and not (tmp_path / "run").exists()


def test_a_killed_runs_lock_is_free_at_once_though_its_data_workers_live_on(tmp_path):
    """A DataLoader worker (forked) outlives its killed main process by seconds. It must not hold the lock: the
    requeued run, started at once, would be refused, naming a process that is gone."""
    script = tmp_path / "holder.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {str(HERE)!r})\nimport checkpoint\n"
                      f"with checkpoint.folder_lock({str(tmp_path / 'run')!r}):\n"
                      "    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)\n"
                      "    print('locked', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "locked\n"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with checkpoint.folder_lock(str(tmp_path / "run")):  # the worker is still asleep
            pass
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_the_lock_clears_what_a_killed_writer_left(tmp_path):
    left = tmp_path / "ckpt.pt.4242.0badcafe.tmp"  # a SIGKILL mid-save: a whole checkpoint's worth, at 7b 40 GB
    left.write_bytes(b"partial")
    (tmp_path / "notes.tmp").write_bytes(b"the user's")
    with checkpoint.folder_lock(str(tmp_path)):
        assert not left.exists() and (tmp_path / "notes.tmp").exists()
    assert sorted(os.listdir(tmp_path)) == [".lock", "notes.tmp"]


def test_a_stop_signal_with_stdouts_reader_gone_still_saves(corpus, tmp_path):
    """`python train.py | tee log`, and the job's signal ends tee too: each write to stdout then fails (EPIPE). The
    stop must still save its checkpoint and exit 0, not die of a BrokenPipeError in the signal handler."""
    proc = start([sys.executable, str(HERE / "train.py"), *base_args(corpus, tmp_path, 100_000, "--workers", "1")])
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.stdout.close()  # the reader is gone
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert 2 <= final_state(tmp_path)["step"] < 100_000


def test_a_script_run_ignores_stop_signals_once_it_has_ended(corpus, tmp_path):
    # python train.py: between main's end and the exit, a late signal's default action would kill a saved run
    old = {sig: signal.getsignal(sig) for sig in data.STOP_SIGNALS}
    try:
        train.main(base_args(corpus, tmp_path, 2), exiting=True)
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in data.STOP_SIGNALS)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_disk_full_keeps_the_previous_checkpoint(corpus, tmp_path):
    with small_disk(corpus, tmp_path, 1.5) as mnt:  # the second checkpoint, written beside the first, fails
        with pytest.raises(SystemExit, match="^disk full: could not write .*the previous checkpoint there is kept"):
            train.main(base_args(corpus, mnt, 4, "--save_every", "1"))
        assert final_state(mnt)["step"] == 1 and not list(mnt.glob("*.tmp"))


def test_disk_full_under_torchrun_stops_every_rank_in_one_line(corpus, tmp_path):
    # only rank 0 writes; the other must stop with it, not wait for it in the next collective and die of the hang-up
    with small_disk(corpus, tmp_path, 1.5) as mnt:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(HERE / "train.py"), *base_args(corpus, mnt, 4, "--save_every", "1", "--workers", "1")]
        proc = subprocess.run(cmd, cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=240)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0 and output.count("disk full: could not write") == 1, output
        # no word of gloo's but the header's, nor of rank 1 (torchrun's own report of rank 0 stays)
        said = [line for line in output.splitlines() if " (DDP: gloo) | " not in line]
        assert not any("gloo" in line or "[rank1]" in line for line in said), output
        assert final_state(mnt)["step"] == 1 and not list(mnt.glob("*.tmp"))


def test_disk_full_in_the_metrics_stops_in_one_line_and_resumes(corpus, tmp_path):
    with small_disk(corpus, tmp_path, 3) as mnt:
        train.main(base_args(corpus, mnt, 6, "--stop_after", "2"))
        with open(mnt / "filler", "wb", buffering=0) as f:  # the disk fills up while the run is away, to the byte
            for block in (4096, 1):
                with suppress(OSError):
                    while True:
                        f.write(b"\0" * block)
        with pytest.raises(SystemExit, match=rf"^cannot write {mnt}/metrics.jsonl \(No space left on device\); "
                                             rf"free space .* then rerun with --resume {mnt}/ckpt.pt \(step 2\)$"):
            train.main(base_args(corpus, mnt, 60, "--resume"))  # the resume's rewrite of the metrics fails first
        os.truncate(mnt / "filler", (mnt / "filler").stat().st_size - 4096)  # one page free: the rows fill it
        with pytest.raises(SystemExit, match=rf"^cannot write {mnt}/metrics.jsonl at step \d+ \(No space left on "
                                             rf"device\); free space .*, then rerun with --resume {mnt}/ckpt.pt "
                                             r"\(step 2\)$"):
            train.main(base_args(corpus, mnt, 60, "--resume"))
        assert final_state(mnt)["step"] == 2
        (mnt / "filler").unlink()
        train.main(base_args(corpus, mnt, 60, "--resume"))
        assert [r["step"] for r in metrics(mnt)[0]] == list(range(1, 61))


def test_the_rows_a_checkpoint_covers_are_on_disk_before_it(corpus, tmp_path, monkeypatch):
    """A power cut after a save must not keep the checkpoint and lose the rows before it (the resume would go on with
    a gap in metrics.jsonl): they are fsynced before the checkpoint is renamed into place. A metrics disk that fails
    then (a delayed-allocation disk says ENOSPC at fsync, not at write) stops the run before the save, in one line."""
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[-1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), replace(a, b))[-1])
    train.main(base_args(corpus, tmp_path, 4, "--save_every", "2", "--log_every", "1"))
    path, rows = str(tmp_path / "metrics.jsonl"), str(tmp_path / "ckpt.pt")
    saves = [i for i, e in enumerate(events) if e == ("replace", rows)]
    assert len(saves) == 2, events
    for i in saves:
        assert ("fsync", path) in events[:i] and events[:i][::-1].index(("fsync", path)) < i, events
    written = os.path.getsize(path)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error"))
                        if os.readlink(f"/proc/self/fd/{fd}") == path else fsync(fd))
    with pytest.raises(SystemExit, match=rf"^cannot write {path} at step 6 \(Input/output error\); .*--resume "
                                         rf"{rows} \(step 4\)"):
        train.main(base_args(corpus, tmp_path, 8, "--save_every", "2", "--log_every", "1", "--resume"))
    assert final_state(tmp_path)["step"] == 4 and os.path.getsize(path) > written


def test_ranks_agree_on_the_first_update_any_of_them_flagged(tmp_path):
    """Each rank flags the first update whose loss (its own share) or norm was not finite; the message names the
    earliest of them, which every rank must say alike, and none when no rank flagged. Before a save each rank checks
    the model on a validation batch of its own: they stop on the worst loss, non-finite before exploded, all alike."""
    script = tmp_path / "flags.py"
    script.write_text(f"import math, sys, types, torch, torch.distributed as dist\nsys.path.insert(0, {str(HERE)!r})\n"
                      "import keeper\ndist.init_process_group('gloo')\nrank = dist.get_rank()\n"
                      f"said = open({str(tmp_path)!r} + f'/rank{{rank}}', 'w')\n"
                      "def says(check):\n    try:\n        check()\n        print('none', file=said)\n"
                      "    except SystemExit as e:\n        print(str(e).split(';')[0], file=said)\n"
                      "for mine in ([5, 3, -1], [-1, -1, -1], [-1, 7, -1]):\n"
                      "    k = types.SimpleNamespace(ddp=True, first_bad=torch.tensor(mine[rank]), last_good=[],\n"
                      "                              args=types.SimpleNamespace(out_dir=None))\n"
                      "    says(lambda: keeper.Keeper.check_finite(k))\n"
                      "k = types.SimpleNamespace(ddp=True, model=None, val=[None], device=None, last_good=[],\n"
                      "                          args=types.SimpleNamespace(out_dir=None),\n"
                      "                          config=types.SimpleNamespace(vocab_size=96))\n"
                      "for mine in ([1.0, 50.0, 2.0], [1.0, 50.0, math.inf], [4.0, 3.0, 2.0]):\n"
                      "    keeper.checked_loss = lambda *_: torch.tensor(mine[rank])\n"
                      "    says(lambda: keeper.Keeper.check_model(k, 9))\n"
                      "said.close()\ndist.barrier()\ndist.destroy_process_group()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script)]
    proc = subprocess.run(cmd, cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = "non-finite loss or gradient norm at step"
    model = ["the model after step 9 has a loss on a validation batch of 50.00, above 2·ln V = 9.13 (V = 96): worse "
             "than a uniform guess, V times over", "the model after step 9 has non-finite parameters or loss", "none"]
    for rank in range(3):
        assert (tmp_path / f"rank{rank}").read_text().splitlines() == [f"{step} 3", "none", f"{step} 7", *model], rank


def corpus_with_a_bad_line(corpus, tmp_path, shard="c4-train.00001-of-00002.json.gz"):
    """A copy of the corpus where line 101 of one training shard is not JSON."""
    folder = tmp_path / "c4"
    folder.mkdir()
    for f in Path(corpus[0]).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    shard = folder / shard
    lines = gzip.decompress(shard.read_bytes()).decode().splitlines(keepends=True)
    lines[100] = "not json\n"
    shard.write_bytes(gzip.compress("".join(lines).encode()))
    return str(folder), corpus[1]


@pytest.mark.parametrize("damage", ["a bad first line", "an empty shard", "not gzip"])
def test_a_shard_that_cannot_be_read_at_all_is_one_line_before_the_model_is_built(corpus, tmp_path, monkeypatch,
                                                                                    damage):
    folder = tmp_path / "c4"
    folder.mkdir()
    for f in Path(corpus[0]).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    for shard in folder.glob("c4-train.*"):  # whichever the shuffled order reads first
        lines = gzip.decompress(shard.read_bytes()).decode().splitlines(keepends=True)
        shard.write_bytes({"a bad first line": gzip.compress("".join(["not json\n", *lines[1:]]).encode()),
                           "an empty shard": gzip.compress(b""), "not gzip": b"plain text"}[damage])
    built = []
    monkeypatch.setattr(train, "build", lambda *args: built.append(args))
    expected = {"a bad first line": r"\.json\.gz:1: not a JSON object", "an empty shard": "holds no documents",
                "not gzip": "the file is truncated or corrupt"}[damage]
    with pytest.raises(SystemExit, match=rf"^train.py --size tiny: {folder}/c4-train.*{expected}"):
        train.main(base_args((str(folder), corpus[1]), tmp_path / "out", 10, "--workers", "1"))
    assert not built


def test_bad_shard_line_saves_then_names_file_and_line(corpus, tmp_path):
    args = base_args(corpus_with_a_bad_line(corpus, tmp_path), tmp_path / "out", 10_000, "--workers", "1")
    with pytest.raises(SystemExit, match=r"c4-train.00001-of-00002.json.gz:101: not a JSON object") as e:
        train.main(args)
    assert "Traceback" not in str(e.value)
    step = final_state(tmp_path / "out")["step"]
    assert f"saved {tmp_path / 'out'}/ckpt.pt at step {step}" in str(e.value)


def test_a_data_worker_killed_mid_run_saves_the_last_whole_update_and_the_resume_is_bit_exact(corpus, tmp_path):
    """The OOM killer often picks a DataLoader worker. Its death is seen between updates (torch's own SIGCHLD handler
    raised it wherever the main process was: mid-backward, with nothing whole to save, and a traceback): the run
    saves the last whole update with the data position where the next began, says so in one line, and the resume
    ends as a straight run does."""
    from suite import process_tree
    args = ["--workers", "1", "--log_every", "1", "--eval_every", "100000", "--warmup_steps", "5"]
    proc = start([sys.executable, str(HERE / "train.py"), *base_args(corpus, tmp_path / "split", 100_000, *args)])
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        workers = process_tree(proc.pid) - {proc.pid}
        assert len(workers) == 1, workers
        os.kill(workers.pop(), signal.SIGKILL)
        output = proc.communicate(timeout=120)[0]
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
    said = re.search(r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly \(killed: out of memory, or by hand\?\)\n"
                     rf"saved {tmp_path / 'split'}/ckpt.pt at step (\d+); rerun with --resume$", output.strip())
    assert said, output[-3000:]
    steps = int(said.group(1)) + 3  # the same schedule (of 100,000 updates) both ways, stopped there
    train.main(base_args(corpus, tmp_path / "split", 100_000, *args, "--resume", "--stop_after", "3"))
    train.main(base_args(corpus, tmp_path / "straight", 100_000, *args, "--stop_after", str(steps)))
    a, b = metrics(tmp_path / "straight")[0], metrics(tmp_path / "split")[0]
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]


# run in a mount namespace of its own (unshare -m), where /dev/shm is a small tmpfs of its own: once the run has begun,
# a file fills it and keeps it full, as other jobs' files (or leaked segments) fill a node's /dev/shm, or a container's
# 64 MB one
FULL_SHM_MID_RUN = r"""
import os, subprocess, sys, threading, time
if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", "/dev/shm"]).returncode:
    sys.exit(99)
def fill():
    fd = os.open("/dev/shm/fill", os.O_WRONLY | os.O_CREAT)
    while True:  # what the loader frees, the file takes again
        for n in (1 << 16, 1 << 12, 1):
            try:
                while os.write(fd, bytes(n)):
                    pass
            except OSError:
                pass
        time.sleep(0.001)
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in proc.stdout:
    print(line, end="", flush=True)
    if line.startswith("step 2/"):
        threading.Thread(target=fill, daemon=True).start()
sys.exit(proc.wait())
"""


def test_a_full_dev_shm_mid_run_stops_in_one_line_and_the_resume_is_bit_exact(corpus, tmp_path):
    """A data worker's blocks go to the main process through /dev/shm. Once it was full, the worker's queue thread
    dropped the block with a traceback, and the main process waited for it forever, past any stop signal too. The
    worker moves each block there itself: the refusal is its error, and the run saves the last whole update and says
    so in one line, with the fix; the resume with --workers 0 (no /dev/shm) ends as a straight run does."""
    probe = ["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", "/dev/shm"]  # a container may refuse
    can = os.geteuid() == 0 and shutil.which("unshare") and subprocess.run(probe, capture_output=True).returncode == 0
    if not can:
        pytest.skip("a /dev/shm of its own needs root and a mount namespace (unshare -m)")
    args = ["--log_every", "1", "--eval_every", "100000", "--warmup_steps", "5"]
    proc = start(["unshare", "-m", sys.executable, "-c", FULL_SHM_MID_RUN, sys.executable, str(HERE / "train.py"),
                  *base_args(corpus, tmp_path / "split", 100_000, *args, "--workers", "1")])
    try:
        output = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run hung once /dev/shm was full:\n{proc.communicate()[0][-3000:]}")
    assert proc.returncode != 99, "no tmpfs could be mounted on /dev/shm, though the probe could"
    assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
    said = re.search(r"/dev/shm has no room for a data worker's block of [\d.]+ [KM]iB "
                     r"\([\d.]+ [KM]iB free of 4.0 MiB\)\n"
                     rf"saved {tmp_path / 'split'}/ckpt.pt at step (\d+); rerun with --resume once /dev/shm has room, "
                     r"or add --workers 0$", output.strip())
    assert said, output[-3000:]
    steps = int(said.group(1)) + 3  # the same schedule (of 100,000 updates) both ways, stopped there
    train.main(base_args(corpus, tmp_path / "split", 100_000, *args, "--resume", "--workers", "0", "--stop_after", "3"))
    train.main(base_args(corpus, tmp_path / "straight", 100_000, *args, "--stop_after", str(steps)))
    a, b = metrics(tmp_path / "straight")[0], metrics(tmp_path / "split")[0]
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]


def test_a_full_dev_shm_from_the_start_stops_in_one_line_and_the_resume_goes_on(corpus, tmp_path, monkeypatch):
    """The same without root: /dev/shm refuses every block (torch's own error), from the first one on."""
    from test_data import refuse_shared_memory
    args = ["--warmup_steps", "5", "--stop_after", "3"]
    with monkeypatch.context() as m:
        refuse_shared_memory(m)
        with pytest.raises(SystemExit) as e:
            train.main(base_args(corpus, tmp_path / "split", 100_000, *args, "--workers", "1"))
    assert re.fullmatch(r"/dev/shm has no room for a data worker's block of [\d.]+ [KM]iB( \(.* free of .*\))?\n"
                        rf"saved {tmp_path / 'split'}/ckpt.pt at step 0; rerun with --resume once /dev/shm has room, "
                        r"or add --workers 0", str(e.value)), e.value
    train.main(base_args(corpus, tmp_path / "split", 100_000, *args, "--resume", "--workers", "0"))
    train.main(base_args(corpus, tmp_path / "straight", 100_000, *args))
    a, b = metrics(tmp_path / "straight")[0], metrics(tmp_path / "split")[0]
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_run_stopped_by_a_bad_line_goes_on_once_it_is_fixed_in_place(corpus, tmp_path, workers):
    """The advice was to fix or delete the line, then --resume; but the resume refused any shard whose size had
    changed, the fixed one included. Fixed in place (every other line as it was) it goes on, said in a line, and ends
    as a run on the good shard does, to the bit: nothing of the line's block had been trained on. Deleted, every
    document after it moves: refused, naming the fix."""
    args = ["--workers", workers, "--warmup_steps", "5"]
    bad = corpus_with_a_bad_line(corpus, tmp_path)
    shard = Path(bad[0]) / "c4-train.00001-of-00002.json.gz"
    good = gzip.decompress((Path(corpus[0]) / shard.name).read_bytes()).decode().splitlines(keepends=True)
    with pytest.raises(SystemExit) as e:
        train.main(base_args(bad, tmp_path / "split", 10_000, *args))
    assert "101: not a JSON object" in str(e.value) and "fix that line in place" in str(e.value), e.value
    assert str(e.value).endswith("after fixing the shard as said, rerun with --resume"), e.value
    step = final_state(tmp_path / "split")["step"]
    shard.write_bytes(gzip.compress("".join(good[:100] + good[101:]).encode()))  # the line deleted
    with pytest.raises(SystemExit, match=f"training shard {shard.name} stopped the run and has changed since, but not "
                                         "as its fix: it must be its bad line 101 fixed in place"):
        train.main(base_args(bad, tmp_path / "split", 10_000, *args, "--resume", "--stop_after", "3"))
    shard.write_bytes(gzip.compress("".join(good).encode()))  # fixed in place
    train.main(base_args(bad, tmp_path / "split", 10_000, *args, "--resume", "--stop_after", "3"))
    train.main(base_args(corpus, tmp_path / "straight", 10_000, *args, "--stop_after", str(step + 3)))
    a, b = metrics(tmp_path / "straight")[0], metrics(tmp_path / "split")[0]
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]


def test_a_run_stopped_at_its_first_update_takes_a_new_warmup(corpus, tmp_path):
    """A data fault at the first update saves at update 0: nothing has trained, so the resume may change anything
    the schedule holds (a changed --warmup_steps was refused as past the new warmup's end, at 0)."""
    folder = tmp_path / "c4"
    shutil.copytree(corpus[0], folder)
    shard = folder / "c4-train.00001-of-00002.json.gz"  # the first the shuffled order reads
    lines = gzip.decompress(shard.read_bytes()).decode().splitlines(keepends=True)
    shard.write_bytes(gzip.compress("".join([lines[0], "not json\n", *lines[2:]]).encode()))
    with pytest.raises(SystemExit, match=":2: not a JSON object"):
        train.main(base_args((str(folder), corpus[1]), tmp_path / "out", 10, "--warmup_steps", "5"))
    assert final_state(tmp_path / "out")["step"] == 0
    shutil.rmtree(folder)
    shutil.copytree(corpus[0], folder)
    train.main(base_args((str(folder), corpus[1]), tmp_path / "out", 10, "--warmup_steps", "0", "--resume"))
    state = final_state(tmp_path / "out")
    assert state["step"] == 10 and state["args"]["warmup_steps"] == 0


def test_a_run_stopped_by_a_cut_shard_goes_on_once_it_is_downloaded_again(corpus, tmp_path, capsys):
    """A shard cut short (a copy interrupted) stops the run where it can no longer be read; the advice, downloading
    it again, changes its size, which the resume refused. Whole again, it goes on and ends as a run on the whole shard
    does; a shard whose first lines changed too is refused."""
    folder = tmp_path / "c4"
    shutil.copytree(corpus[0], folder)
    shard = folder / "c4-train.00000-of-00002.json.gz"  # the second read: the run trains a while before the cut
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) * 2 // 3])
    args = ["--warmup_steps", "5"]
    with pytest.raises(SystemExit) as e:
        train.main(base_args((str(folder), corpus[1]), tmp_path / "split", 10_000, *args))
    # (not a C4 name, which download.py refuses: the advice is a whole copy, which C4's get by downloading again)
    assert "cannot read past line" in str(e.value) and "replace it with a whole copy" in str(e.value), e.value
    step = final_state(tmp_path / "split")["step"]
    assert step > 0
    lines = gzip.decompress(whole).decode().splitlines(keepends=True)
    shard.write_bytes(gzip.compress("".join(lines[1:]).encode()))  # another file: its first line is gone
    with pytest.raises(SystemExit, match="it must be downloaded again whole"):
        train.main(base_args((str(folder), corpus[1]), tmp_path / "split", 10_000, *args, "--resume"))
    shard.write_bytes(whole)
    capsys.readouterr()
    train.main(base_args((str(folder), corpus[1]), tmp_path / "split", 10_000, *args, "--resume", "--stop_after", "3"))
    assert (f"training shard(s) {shard.name} changed since the checkpoint as the fix of the fault that stopped it "
            "(its other lines checked): the run goes on with them") in capsys.readouterr().out
    train.main(base_args(corpus, tmp_path / "straight", 10_000, *args, "--stop_after", str(step + 3)))
    a, b = metrics(tmp_path / "straight")[0], metrics(tmp_path / "split")[0]
    assert [(r["step"], r["loss"]) for r in a] == [(r["step"], r["loss"]) for r in b]


def test_bad_shard_line_right_after_a_save_writes_it_again_with_the_lines_record(corpus, tmp_path, monkeypatch):
    """--save_every 1, the bad line in the second shard read: the last update is on disk when the line comes. That
    checkpoint lacks the record of the line, which the resume needs to take the shard fixed in place: it was kept as
    it was, and the advice followed ended in "restore them, or start a new run". So it is written again."""
    save, saves = checkpoint.save, []
    monkeypatch.setattr(checkpoint, "save", lambda path, state: (saves.append(state["step"]), save(path, state)))
    name = "c4-train.00000-of-00002.json.gz"
    bad = corpus_with_a_bad_line(corpus, tmp_path, name)
    with pytest.raises(SystemExit, match=rf"{name}:101: not a JSON object"):
        train.main(base_args(bad, tmp_path / "out", 10_000, "--workers", "1", "--save_every", "1"))
    step = final_state(tmp_path / "out")["step"]
    assert step > 0 and saves == [*range(1, step + 1), step], saves
    shutil.copy(Path(corpus[0]) / name, Path(bad[0]) / name)  # the line fixed in place, as the message says
    train.main(base_args(bad, tmp_path / "out", 10_000, "--workers", "1", "--save_every", "1", "--resume",
                         "--stop_after", "1"))
    assert final_state(tmp_path / "out")["step"] == step + 1


def test_bad_shard_line_under_torchrun_stops_every_rank_after_saving(corpus, tmp_path):
    # the line belongs to one rank's share: the other must not wait for it in a collective forever. The shard is
    # the second one read (the first is 00001), so the run has trained a few updates when it gets there
    out, bad = tmp_path / "out", corpus_with_a_bad_line(corpus, tmp_path, "c4-train.00000-of-00002.json.gz")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE / "train.py"),
           *base_args(bad, out, 10_000, "--workers", "1")]
    proc = subprocess.run(cmd, cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert len(re.findall(r"rank \d: .*c4-train.00000-of-00002.json.gz:101: not a JSON object", output)) == 1, output
    state = final_state(out)
    assert f"saved {out}/ckpt.pt at step {state['step']}" in output
    assert state["world"] == 2 and all(state["data"]) and state["step"] > 0
    # the line fixed in place, the resume goes on: the fault is the one rank's that met it, and read from every one's
    name = "c4-train.00000-of-00002.json.gz"
    (Path(bad[0]) / name).write_bytes((Path(corpus[0]) / name).read_bytes())
    proc = subprocess.run(cmd + ["--resume", "--stop_after", "2"], cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and f"training shard(s) {name} changed since the checkpoint as the fix of the fault " \
        "that stopped it" in proc.stdout, proc.stdout + proc.stderr
    assert final_state(out)["step"] == state["step"] + 2


def test_resume_after_kill_drops_metrics_past_the_checkpoint(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 6, "--stop_after", "3"))
    with open(tmp_path / "metrics.jsonl", "a") as f:  # what a kill -9 in the write of step 6's row leaves behind
        f.write(json.dumps({"step": 4, "loss": 1.0}) + "\n" + json.dumps({"step": 5, "loss": 1.0}) + "\n")
        f.write(json.dumps({"step": 6, "loss": 1.0})[:9])
    train.main(base_args(corpus, tmp_path, 6, "--resume"))
    assert "dropped 1 line(s) cut short" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path)[0]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("made_again", [False, True], ids=["removed", "removed_and_made_again"])
def test_an_out_dir_removed_under_the_run_stops_it_in_one_line(corpus, tmp_path, monkeypatch, made_again):
    """`rm -rf out_dir` (and perhaps `mkdir out_dir`) while the run trains: its rows went on into a file no one could
    read, and its checkpoints into a folder without rows or lock (or a failed write named a checkpoint that is gone)."""
    out, step, calls = tmp_path / "out", train.train_step, []

    def removing(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # update 4, after the checkpoint of step 2
            shutil.rmtree(out)
            if made_again:
                out.mkdir()
        return step(*a, **k)
    monkeypatch.setattr(train, "train_step", removing)
    with pytest.raises(SystemExit, match=rf"^{out}/metrics.jsonl was removed or replaced while the run wrote to it "
                                         rf"\(was --out_dir {out} deleted or moved\?\): stopping at step 4, writing "
                                         rf"nothing more there; the last checkpoint, {out}/ckpt.pt \(step 2\), is "
                                         r"gone: start again with --overwrite"):
        train.main(base_args(corpus, out, 8, "--save_every", "2"))
    assert list(out.iterdir()) == [] if made_again else not out.exists()
    full = OSError(errno.ENOSPC, "No space left on device")  # a failed write's advice names no gone checkpoint
    assert keeper.after_failed_write(full, [str(out / "ckpt.pt"), 2], str(out)).endswith(
        f"then the last checkpoint, {out}/ckpt.pt (step 2), is gone: start again with --overwrite (it replaces this "
        "run's rows)")


def test_resume_drops_metrics_lines_that_are_not_text_or_not_rows(corpus, tmp_path, capsys):
    """A damaged tail (bytes that are no UTF-8, as a failing disk or another program leaves them; JSON that is not
    a row) is dropped and said, as a torn line is: not a UnicodeDecodeError or a KeyError out of --resume."""
    train.main(base_args(corpus, tmp_path, 6, "--stop_after", "3"))
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 4, "loss": 1.0}\n[4]\n{"loss": 2.0}\n\xff\xfe\x00{"st\n')
    train.main(base_args(corpus, tmp_path, 6, "--resume"))
    assert "dropped 3 line(s) cut short" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path)[0]] == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_during_evaluation_is_acknowledged_and_stops_it(corpus, tmp_path):
    folder = tmp_path / "c4"
    folder.mkdir()
    for f in Path(corpus[0]).glob("c4-train.*"):
        (folder / f.name).write_bytes(f.read_bytes())
    docs = gzip.decompress((Path(corpus[0]) / "c4-validation.00000-of-00001.json.gz").read_bytes())
    (folder / "c4-validation.00000-of-00001.json.gz").write_bytes(gzip.compress(docs * 100))  # an eval of seconds
    args = base_args((str(folder), corpus[1]), tmp_path / "out", 100_000, "--eval_every", "1",
                     "--eval_tokens", "1000000")
    proc = start([sys.executable, str(HERE / "train.py"), *args])
    output = signal_group_at(proc, "step 1/", signal.SIGINT)  # the log line comes just before the evaluation
    assert proc.returncode == 0, output[-3000:]
    assert "SIGINT: stopping before the next micro-batch (or in the evaluation)" in output
    assert "val loss" not in output, "the evaluation ran to its end after Ctrl-C"
    assert final_state(tmp_path / "out")["step"] == 1


def test_ranks_agree_on_a_signal_and_a_bad_line_on_the_host(monkeypatch, corpus):
    """Under torchrun the ranks agree each update on a signal and on a bad shard line. The flags are host tensors, and
    on GPUs the process group sends host tensors through gloo (beside NCCL for the gradients), so reading a flag never
    waits for a GPU. Faked here: a second rank, which is signalled and has a bad line."""
    mark_pinning(monkeypatch)
    reduced = []

    def all_reduce(t, op=None, group=None):
        reduced.append(t.device)
        t += 1  # the other rank's flag is set

    monkeypatch.setattr(train.dist, "all_reduce", all_reduce)
    fix = "after fixing the shard, rerun with --resume"
    monkeypatch.setattr(train.dist, "all_gather_object",
                        lambda out, obj: out.__setitem__(slice(None), [obj, ("x:3", fix)]))
    stop = {"signal": None}
    assert train.stopping(stop, 2) and stop["signal"] == "a signal on another rank"
    batches = iter([(torch.randint(96, (2, 16)), torch.randint(-1, 96, (2, 16)))])
    micro_batches, fault = train.read_update(batches, 1, torch.device("meta"), 2)
    assert fault == ("rank 1: x:3", fix) and micro_batches[0][0].is_pinned()
    assert reduced == [torch.device("cpu")] * 2
    # the process group: gloo for host tensors and NCCL for the GPU's, a form this torch knows (a GPU is faked)
    backends = []
    monkeypatch.setattr(train.dist, "init_process_group", lambda backend: backends.append(backend))
    one_gpu(monkeypatch, 80e9)
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    train.setup(train.get_args(["--size", "tiny", "--device", "cuda", "--data_dir", corpus[0], "--tokenizer",
                                corpus[1]]))
    config = torch.distributed.distributed_c10d.BackendConfig(backends[0])
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def test_ranks_agree_on_a_signal_that_arrives_just_after_they_compared(monkeypatch):
    """A signal handled just after the all-reduce of the stop flags (Python runs handlers between bytecodes) is for the
    next check: this rank answers as the other did, else it would stop alone and the other wait for it forever."""
    stop = {"signal": None}

    def all_reduce(t, op=None, group=None):  # nobody was signalled yet; then this rank's handler runs
        stop["signal"] = "SIGTERM"
    monkeypatch.setattr(train.dist, "all_reduce", all_reduce)
    assert not train.stopping(stop, 2), "the other rank read 0 and goes on: so does this one"
    monkeypatch.setattr(train.dist, "all_reduce", lambda t, op=None, group=None: None)
    assert train.stopping(stop, 2) and stop["signal"] == "SIGTERM", "and both stop at the next check"


def test_pending_evaluation_whose_checkpoint_failed_is_recorded_once(corpus, tmp_path, monkeypatch, capsys):
    every = ["--eval_every", "3"]
    train.main(base_args(corpus, tmp_path / "straight", 6, *every))
    out, other = tmp_path / "sig", tmp_path / "other"
    with monkeypatch.context() as m:
        signal_in_update(m, 3)
        train.main(base_args(corpus, out, 6, *every))
    with monkeypatch.context() as m:  # the evaluation is made, then the disk is full for its checkpoint
        full = checkpoint.SaveFailed("ckpt.pt", OSError(errno.ENOSPC, "No space left on device"), True)
        m.setattr(checkpoint, "save", lambda path, state: (_ for _ in ()).throw(full))
        with pytest.raises(SystemExit, match="disk full"):
            train.main(base_args(corpus, out, 6, "--resume", *every))
    with monkeypatch.context() as m:  # a signal in the pending evaluation of another folder's checkpoint
        evaluate = train.evaluate
        m.setattr(train, "evaluate", lambda *a: (os.kill(os.getpid(), signal.SIGTERM), evaluate(*a))[1])
        train.main(base_args(corpus, other, 6, "--resume", str(out), *every))
    assert f"rerun with --resume {out}/ckpt.pt" in capsys.readouterr().out
    train.main(base_args(corpus, out, 6, "--resume", *every))
    assert metrics(out)[1] == metrics(tmp_path / "straight")[1]


def test_a_resume_whose_metrics_are_gone_says_so(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path, 4, "--stop_after", "2"))
    (tmp_path / "metrics.jsonl").unlink()
    train.main(base_args(corpus, tmp_path, 4, "--resume"))
    assert f"note: {tmp_path}/metrics.jsonl is missing, so the rows of steps 1 to 2 are not in " \
           f"{tmp_path}/metrics.jsonl: its rows start after step 2" in capsys.readouterr().out
    assert [r["step"] for r in metrics(tmp_path)[0]] == [3, 4]


def test_an_out_dir_that_cannot_be_written_or_cleared_is_one_line(corpus, tmp_path):
    (tmp_path / "run" / "ckpt.pt").mkdir(parents=True)  # a folder where the checkpoint would be
    with pytest.raises(SystemExit, match=rf"^--overwrite: {tmp_path}/run/ckpt.pt is a folder, which a run does not "
                                         r"remove; remove it yourself, or pass a new --out_dir$"):
        train.main(base_args(corpus, tmp_path / "run", 2, "--overwrite"))
    train.main(base_args(corpus, tmp_path / "old", 2))
    with tmpfs(tmp_path / "ro", 10 ** 7) as mnt:  # a finished run on a disk now read-only
        shutil.copytree(tmp_path / "old", mnt / "old")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(SystemExit, match=rf"^--out_dir {mnt}/old cannot be written \(Read-only file system\): "
                                             rf"pass a folder you can write, with --resume {mnt}/old/ckpt.pt$"):
            train.main(base_args(corpus, mnt / "old", 4, "--resume"))
        train.main(base_args(corpus, tmp_path / "new", 4, "--resume", str(mnt / "old" / "ckpt.pt")))  # the advice
    assert final_state(tmp_path / "new")["step"] == 4


def test_out_dir_inside_a_file_and_changed_shards_are_one_line(corpus, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match=f"^--out_dir {tmp_path}/afile/sub cannot be made \\(Not a directory\\)"):
        train.main(base_args(corpus, tmp_path / "afile" / "sub", 2))
    folder = tmp_path / "c4"
    folder.mkdir()
    for f in Path(corpus[0]).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    train.main(base_args((str(folder), corpus[1]), tmp_path / "out", 4, "--stop_after", "2"))
    (folder / "c4-train.00002-of-00003.json.gz").write_bytes((folder / "c4-train.00000-of-00002.json.gz").read_bytes())
    with pytest.raises(SystemExit, match=rf"^--resume {tmp_path}/out/ckpt.pt: the data folder's training shards are "
                                         r"not the checkpoint's: 0 gone \[\], 1 added \['c4-train.00002-of-00003"):
        train.main(base_args((str(folder), corpus[1]), tmp_path / "out", 4, "--resume"))
    (folder / "c4-train.00002-of-00003.json.gz").unlink()
    shard = folder / "c4-train.00001-of-00002.json.gz"  # cut short under its own name: a resume would read on
    lines = gzip.decompress(shard.read_bytes()).decode().splitlines(keepends=True)  # in other data
    shard.write_bytes(gzip.compress("".join(lines[:20]).encode()))
    with pytest.raises(SystemExit, match=rf"^--resume {tmp_path}/out/ckpt.pt: 1 training shard\(s\) changed since the "
                                         r"checkpoint, c4-train.00001-of-00002.json.gz from [\d,]+ to [\d,]+ bytes"):
        train.main(base_args((str(folder), corpus[1]), tmp_path / "out", 4, "--resume"))


def test_an_out_dir_that_links_to_a_folder_not_there_yet_is_made_there(corpus, tmp_path):
    """--out_dir a link to a scratch folder not made yet (or purged): the run writes there, as a file written through
    such a link is made at its target; it was refused as "cannot be made (File exists)". A run refused there leaves
    the link as it was found."""
    link, target = tmp_path / "out", tmp_path / "scratch" / "run"
    link.symlink_to(target, target_is_directory=True)
    (tmp_path / "ckpt.pt").write_bytes(b"")  # refused once out_dir is locked, before any write there
    with pytest.raises(SystemExit, match="--init_from"):
        train.main(base_args(corpus, link, 2, "--init_from", str(tmp_path / "ckpt.pt")))
    assert link.is_symlink() and not (tmp_path / "scratch").exists()
    train.main(base_args(corpus, link, 2))
    assert final_state(target)["step"] == 2 and [r["step"] for r in metrics(target)[0]] == [1, 2]


def test_a_diverged_model_is_never_evaluated_or_recorded(corpus, tmp_path):
    """The loss goes to inf/NaN at once (lr 1e9): the run stops at the first evaluation, before it, and
    metrics.jsonl holds no non-finite number (strict JSON, which NaN is not)."""
    with pytest.raises(SystemExit, match="non-finite loss or gradient norm at step"):
        train.main(base_args(corpus, tmp_path, 10, "--lr", "1e9", "--warmup_steps", "0", "--log_every", "5",
                             "--eval_every", "2"))
    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}")
    rows = [json.loads(line, parse_constant=refuse) for line in open(tmp_path / "metrics.jsonl")]
    assert not any("val_loss" in r for r in rows), rows


def test_a_signal_before_the_first_update_or_in_eval_only_is_one_line(corpus, tmp_path, monkeypatch):
    # a suite started under nohup ignores SIGHUP, which train.py then leaves ignored, as it should: heard here
    ignored = [sig for sig in data.STOP_SIGNALS if signal.getsignal(sig) is signal.SIG_IGN]
    for sig in ignored:
        signal.signal(sig, signal.SIG_DFL)
    try:
        signals_before_the_first_update(corpus, tmp_path, monkeypatch)
    finally:
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)


def signals_before_the_first_update(corpus, tmp_path, monkeypatch):
    train.main(base_args(corpus, tmp_path, 2))
    with monkeypatch.context() as m:  # Ctrl-C while the validation data loads
        m.setattr(train, "validation_batches", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(SystemExit, match="^stopped by Ctrl-C before the first update: nothing was saved$"):
            train.main(base_args(corpus, tmp_path / "new", 2))
    before = {sig: signal.getsignal(sig) for sig in data.STOP_SIGNALS}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):  # what a scheduler sends while the model is built
        with monkeypatch.context() as m:
            build = train.build
            m.setattr(train, "build", lambda *a: (os.kill(os.getpid(), sig), build(*a))[1])
            with pytest.raises(SystemExit, match=f"^stopped by {sig.name} before the first update: nothing was saved$"):
                train.main(base_args(corpus, tmp_path / sig.name, 2))
        assert not (tmp_path / sig.name).exists(), "a run stopped before its first update leaves no folder"
        assert {s: signal.getsignal(s) for s in data.STOP_SIGNALS} == before, "main restores the handlers it found"
    # while a checkpoint is read (tens of seconds at 7b): the stop is said as a stop, not as a damaged checkpoint,
    # and the checkpoint stays as it was
    ckpt = tmp_path / "ckpt.pt"
    before = ckpt.read_bytes()
    for extra in (["--resume"], ["--init_from", str(ckpt), "--out_dir", str(tmp_path / "from")], None):
        with monkeypatch.context() as m:
            load = torch.load
            m.setattr(torch, "load", lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM), load(*a, **k))[1])
            argv = eval_args(corpus, tmp_path) if extra is None else base_args(corpus, tmp_path, 4, *extra)
            with pytest.raises(SystemExit, match="^stopped by SIGTERM before the first update: nothing was saved$"):
                train.main(argv)
    assert ckpt.read_bytes() == before and not (tmp_path / "from").exists()
    with monkeypatch.context() as m:  # a signal in --eval_only's evaluation: no result, and an exit that says so
        evaluate = train.evaluate
        m.setattr(train, "evaluate", lambda *a: (os.kill(os.getpid(), signal.SIGTERM), evaluate(*a))[1])
        with pytest.raises(SystemExit, match="^stopped by SIGTERM in the evaluation: no result; run --eval_only"):
            train.main(eval_args(corpus, tmp_path))


def test_a_stop_signal_before_the_run_raises_once_and_one_after_preparing_is_answered(corpus, tmp_path, monkeypatch,
                                                                                       capsys):
    """Till the run answers the stop signals the first one raises (one line, nothing saved); a second, as a torchrun
    rank gets from the agent and again from the agent's death, must not cut the first one's exit short. One that
    comes once the run is prepared, before it answers them, is answered as soon as it does: a checkpoint, exit 0."""
    early = train.Early()
    with pytest.raises(train.StoppedBeforeTheRun, match="^SIGTERM$"):
        early(signal.SIGTERM, None)
    early(signal.SIGHUP, None)  # kept, not raised
    assert early.signal == "SIGTERM"
    run_or_evaluate = train.run_or_evaluate
    monkeypatch.setattr(train, "run_or_evaluate", lambda *a: (os.kill(os.getpid(), signal.SIGTERM),
                                                               run_or_evaluate(*a))[1])
    train.main(base_args(corpus, tmp_path, 6))
    out = capsys.readouterr().out
    assert "stopped by SIGTERM within update 1, which the resumed run makes again" in out, out[-2000:]
    assert final_state(tmp_path)["step"] == 0 and "before the first update" not in out


def test_a_stop_signal_while_the_flags_are_checked_is_one_line(corpus, tmp_path, monkeypatch):
    """The flags' memory check builds a model to count its activations (seconds at 7b): a stop signal there is the
    same line as one while the data loads, not a silent kill by the default action."""
    estimate = flags.estimate
    monkeypatch.setattr(flags, "estimate", lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM),
                                                            estimate(*a, **k))[1])
    with pytest.raises(SystemExit, match="^stopped by SIGTERM before the first update: nothing was saved$"):
        train.main(base_args(corpus, tmp_path, 6))
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_late_signal_does_not_turn_a_finished_run_into_a_kill(corpus, tmp_path):
    """A scheduler may signal again while the process exits (DDP teardown, the interpreter's own exit): the run
    has ended and said so, and its exit status stays 0. By then its heap is frozen, which the interpreter's last
    collection skips (train.py's exit)."""
    late = ("import atexit, gc, os, runpy, signal, sys; "
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), "
            "print('exit survived, frozen:', gc.get_freeze_count() > 0, flush=True))); "
            f"sys.argv = ['train.py'] + {base_args(corpus, tmp_path, 2)!r}; "
            "runpy.run_path('train.py', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", late], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "exit survived, frozen: True" in run.stdout, (run.returncode, run.stderr[-2000:])
