"""
What a training run keeps in its out_dir, and how: one run at a time writes there (the lock, out_dir/.lock), the log
and evaluation rows go to metrics.jsonl, and ckpt.pt is written whole (checkpoint.py) and never holds a diverged
model. When a write fails or the run diverges, the message names the last good checkpoint and the fix.

train.py drives it: lock_out_dir() and refuse_overwrite() before any work, a Keeper for the run. Under torchrun every
rank calls the same methods; the master alone writes, and a failed write stops every rank.
"""

import json
import math
import os
from contextlib import nullcontext, suppress
from dataclasses import asdict

import torch
import torch.distributed as dist

import checkpoint
from flags import resume_path, same_file


def lock_out_dir(args, held, rank, world):
    """One run at a time writes into out_dir (checkpoint.folder_lock, held by rank 0 till main ends): a second one,
    a requeued job beside the old one still ending, is refused before any work, on every rank."""
    busy = None
    if rank == 0:
        try:
            held.enter_context(checkpoint.folder_lock(args.out_dir))
        except checkpoint.FolderBusy as e:
            busy = f"--out_dir: {e}; wait for it to end, or pass a new --out_dir"
        except OSError as e:  # (a run resumed from a folder it cannot write goes on into a new one)
            busy = f"--out_dir {args.out_dir} cannot be {'written' if os.path.isdir(args.out_dir) else 'made'} " \
                   f"({e.strerror or e}): pass a folder you can write" + \
                   (f", with --resume {resume_path(args)}" if args.resume else "")
    if any_rank(busy is not None) if world > 1 else busy:
        raise SystemExit(busy or 1)


# a run that stopped before its first checkpoint leaves its rows alone in out_dir; a fresh run there replaces them
# only when asked (refuse_overwrite), so every message that says to start again says how
OVERWRITE_ROWS = "--overwrite (it replaces this run's rows)"
START_AGAIN = f"start again with {OVERWRITE_ROWS}"


def refuse_overwrite(args):
    """A checkpoint in out_dir is replaced only with --overwrite: by a fresh run, or by one continuing another
    checkpoint (--resume PATH) into this out_dir."""
    path = os.path.join(args.out_dir, "ckpt.pt")
    if args.overwrite:  # (flags.py refuses it with a --resume of this checkpoint) removed by the Keeper, once every
        if os.path.isdir(path):  # check of the run has passed: a refused run keeps the checkpoint it was to replace
            raise SystemExit(f"--overwrite: {path} is a folder, which a run does not remove; remove it yourself, or "
                             "pass a new --out_dir")
        return
    rows = os.path.join(args.out_dir, "metrics.jsonl")
    if not args.eval_only and others_rows(args.out_dir, args.resume and resume_path(args)):
        into = f"--resume {resume_path(args)} would train on into --out_dir {args.out_dir}, and " if args.resume else ""
        raise SystemExit(f"{into}{rows} holds the rows of a run that saved no checkpoint (it stopped before its "
                         "first): pass a new --out_dir, or --overwrite to replace them")
    if not os.path.exists(path) or args.eval_only:  # --eval_only writes nothing
        return
    if args.resume and not os.path.exists(resume_path(args)):
        return  # load_for_resume says there is no checkpoint to resume
    if not args.resume:
        raise SystemExit(f"{path} exists: continue that run with --resume, or pass a new --out_dir, or --overwrite "
                         "to replace it")
    if not same_file(path, resume_path(args)):
        raise SystemExit(f"--resume {resume_path(args)} would train on into --out_dir {args.out_dir}, which holds "
                         f"another checkpoint: continue that one with --resume {path} (a run resumed into it and "
                         f"stopped?), pass a new --out_dir, or --overwrite to replace it")


def others_rows(out_dir, resumed=None):
    """Whether out_dir holds rows beside no checkpoint that are not those of a resume of the checkpoint at `resumed`
    (continued_here; None: a fresh run), which a run into out_dir would replace: refused without --overwrite."""
    rows = os.path.join(out_dir, "metrics.jsonl")
    return not os.path.exists(os.path.join(out_dir, "ckpt.pt")) and os.path.isfile(rows) and \
        os.path.getsize(rows) > 0 and not (resumed and continued_here(rows, resumed))


def rerun_resume(path, out_dir):
    """The --resume of a rerun from the checkpoint at path into out_dir, with --overwrite where out_dir's rows would
    have it refused: those of a resume from another folder, stopped before its first save there, that no rows beside
    its checkpoint tell apart from another run's (a ckpt.pt copied without its metrics.jsonl)."""
    return f"--resume {path}" + (" --overwrite" if others_rows(out_dir, path) else "")


def continued_here(rows, resumed):
    """Whether rows (an out_dir's metrics.jsonl, beside no checkpoint) are those of a resume of the checkpoint at
    `resumed` into that out_dir that stopped before its first save: they begin with the same row as the rows beside
    that checkpoint (a row holds its step's time, so two runs never write the same one), and this resume rewrites
    them. Rows of any other run there would be replaced without a word."""
    beside = os.path.join(os.path.dirname(resumed), "metrics.jsonl")
    if same_file(beside, rows) or not os.path.exists(resumed):  # its own folder's; or no such checkpoint (said later)
        return True
    try:
        with open(rows, errors="replace") as mine, open(beside, errors="replace") as theirs:
            return mine.readline().strip() == theirs.readline().strip() != ""
    except OSError:  # no rows beside the checkpoint: none to tell these apart by
        return False


def trim_metrics(source, step, path, eval_pending=False, resume_from=None):
    """The rows of the resumed run, up to its checkpoint's step, into path: after a kill, the rows past the
    checkpoint are redone on resume, so they are dropped and each step appears once. source is path itself, or the
    metrics beside a checkpoint resumed from another folder (none there: path starts empty). A line that a kill or
    a full disk cut short is dropped too, and said."""
    rows, torn = [], 0
    if not os.path.exists(source) and step > 0:  # deleted, or never copied beside the checkpoint: not in silence
        print(f"note: {source} is missing, so the rows of steps 1 to {step} are not in {path}: its rows start after "
              f"step {step}")
    if not os.path.exists(source) and same_file(source, path):
        return
    # a torn line may end within a character, or another program may have damaged the file: undecodable bytes are
    # read as U+FFFD, so that such a line is dropped as torn (the run itself writes ASCII)
    with open(source, errors="replace") if os.path.exists(source) else nullcontext([]) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
                torn += 1  # cut short, or not a row of this program's
                continue
            redone = eval_pending and row["step"] == step and "val_loss" in row  # made again
            if row["step"] <= step and not redone:
                rows.append(line if line.endswith("\n") else line + "\n")
    if torn:
        print(f"{source}: dropped {torn} line(s) cut short by the end of the last run")
    try:
        with checkpoint.atomic_file(path) as f:
            f.write("".join(rows).encode())
    except OSError as e:  # a full disk: nothing is changed yet
        then = after_failed_write(e, [resume_from, step], os.path.dirname(path))
        raise SystemExit(f"cannot write {path} ({e.strerror or e}); {then}") from None


def after_failed_write(e, last_good, out_dir):
    """What to do once a file of the run into out_dir could not be written: the fix by the error (a full disk, or
    another cause), then where the run goes on from: the last good checkpoint, named (it may be in another folder), or
    a new start."""
    fix = "free space (or pass a new --out_dir on a disk with room)" if e.errno in checkpoint.DISK_FULL else \
        "see to the cause (permissions, a read-only or failing disk, a file size limit) or pass a new --out_dir"
    return f"{fix}, then {go_on_from(last_good, out_dir)}"


def resumable(last_good):
    """Whether a rerun can go on from last_good, (path, step) or empty: there is one, and it is not gone since (its
    folder removed under the run, or the checkpoint a resume began from deleted once read)."""
    return bool(last_good) and os.path.exists(last_good[0])


def go_on_from(last_good, out_dir):
    """Where a stopped run into out_dir goes on from: the last good checkpoint (path, step), named (it may be in another
    folder), or a new start where there is none, or it is gone since (its folder removed under the run)."""
    if not last_good:
        return START_AGAIN
    path, step = last_good
    if not resumable(last_good):
        return start_again(last_good)
    return f"rerun with {rerun_resume(path, out_dir)} (step {step})"


def start_again(last_good, fixes=None, which="last"):
    """The words for a run whose `which` checkpoint, last_good (path, step), is gone since (its folder removed under
    the run, or the checkpoint a resume began from deleted once read): a rerun naming it would be refused as having
    none, so it starts again, with the fixes where there are some."""
    path, step = last_good
    return f"the {which} checkpoint, {path} (step {step}), is gone: start again with " + \
        (f"{fixes} and {OVERWRITE_ROWS}" if fixes else OVERWRITE_ROWS)


def diverged(why, last_good, out_dir):
    """The message for a diverged run into out_dir; last_good is (path, step) of the checkpoint it continues from or
    last saved, empty when there is none yet (an older run's checkpoint in out_dir does not count). One gone since
    (its folder removed under the run, or the checkpoint a resume began from deleted once read) is said so, as
    go_on_from says it: a rerun that names it would be refused as having no checkpoint."""
    if not last_good:
        return SystemExit(f"{why}; stopping. No checkpoint was saved yet: start again with a lower --lr (or "
                          f"--grad_clipping) and {OVERWRITE_ROWS}")
    path, step = last_good
    if not resumable(last_good):
        said = start_again(last_good, "a lower --lr (or --grad_clipping)", "last good")
        return SystemExit(f"{why}; stopping. {said[0].upper()}{said[1:]}")
    return SystemExit(f"{why}; stopping. The last good checkpoint is {path}, step {step} (no diverged model is ever "
                      f"saved): rerun with {rerun_resume(path, out_dir)} and a lower --lr (or --grad_clipping)")


def exploded(loss, vocab_size):
    """The words for a loss that says the model diverged, or None: one that is not finite, or past 2·ln V. A fresh
    model guesses about uniformly over its V tokens (a loss near ln V) and learns down from there. Past 2·ln V it
    gives the right tokens, on average, less than 1/V² of probability, V times less than a uniform guess: where too
    high an lr leaves a model (logits in the hundreds), never where a learning one goes, nor a fresh one: ln V plus
    half its logits' variance, about 0.0002 × its width (0.8 at 7b's, where 2·ln V is ln V + 10.4 for T5's 32000)."""
    worst = 2 * math.log(vocab_size)
    if not math.isfinite(loss):
        return str(loss)
    if loss > worst:
        return f"{loss:.2f}, above 2·ln V = {worst:.2f} (V = {vocab_size}): worse than a uniform guess, V times over"
    return None


@torch.no_grad()
def checked_loss(model, batch, device):
    """The loss on one fixed batch as a float32 tensor, inf where it or any parameter is not finite. The parameters
    alone can be finite yet ruined: one update at --lr 1e9 leaves them near 1e9, and the next forward gives NaN."""
    model.eval()
    loss = model(*(t.to(device) for t in batch))[1].float()
    model.train()
    params = torch.stack([p.isfinite().all() for p in model.parameters()]).all()
    return torch.where(params & loss.isfinite(), loss, math.inf)


def any_rank(flag):
    """Whether flag is true on some rank: a one-number all-reduce of a host tensor (gloo, also beside NCCL), which
    waits for the other ranks' processes to get here, never for a device."""
    count = torch.tensor(int(flag))
    dist.all_reduce(count)
    return bool(count.numpy())  # read as the host memory it is: not an aten op, which --sync_debug would count


class Keeper:
    """What a run keeps, and never of a diverged model: out_dir/metrics.jsonl (one row per log and eval) and
    out_dir/ckpt.pt. A non-finite loss or gradient norm is flagged on the device (no host sync) and read at log and
    save steps (check_finite); before each save the parameters and the loss of one validation batch are checked too
    (check_model): finite, and not past 2·ln V (exploded)."""

    def __init__(self, args, run, ckpt, val):
        self.args, self.model, self.val, self.config, self.device = args, run.raw_model, val, run.config, run.device
        self.optimizer, self.scheduler = run.per_layer or run.optimizer, run.scheduler
        self.master, self.ddp, self.world = run.rank == 0, run.world > 1, run.world
        self.path = os.path.join(args.out_dir, "ckpt.pt")
        self.metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
        start = ckpt["step"] if ckpt else 0
        self.last_good = [resume_path(args), start] if ckpt else []  # (path, step), for the divergence message
        resumed_here = ckpt and same_file(resume_path(args), self.path)
        self.on_disk = (start, ckpt.get("eval_pending", False)) if resumed_here else None  # (step, eval_pending) there
        self.first_bad = torch.tensor(-1, device=run.device)  # the first update with a non-finite loss or norm
        self.metrics = None
        self.master_writes(lambda: self._open_metrics(ckpt, start))

    def master_writes(self, write):
        """write() on the master, the only rank that writes files. Should it fail (a full disk: a SystemExit with the
        message), every rank stops with it, not the master alone: the others would wait for it in their next
        collective. Under DDP that costs one host all-reduce, at log, eval and save steps only."""
        message = None
        if self.master:
            try:
                write()
            except SystemExit as e:
                message = str(e)
        if any_rank(message is not None) if self.ddp else message is not None:
            raise SystemExit(message if self.master else 1)

    def _open_metrics(self, ckpt, start):
        try:
            os.makedirs(self.args.out_dir, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"--out_dir {self.args.out_dir} cannot be made ({e.strerror or e}): pass a folder "
                             "you can write") from None
        if self.args.overwrite:  # now, as metrics.jsonl is emptied: a run that fails before its first save leaves
            try:  # neither the old run's checkpoint nor its rows
                os.remove(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:  # a read-only disk
                raise SystemExit(f"--overwrite: cannot remove {self.path} ({e.strerror or e}); remove it yourself, "
                                 "or pass a new --out_dir") from None
        if ckpt:
            beside = os.path.join(os.path.dirname(resume_path(self.args)), "metrics.jsonl")
            trim_metrics(beside, start, self.metrics_path, ckpt.get("eval_pending", False), resume_path(self.args))
        try:
            self.metrics = open(self.metrics_path, "a" if ckpt else "w")
        except OSError as e:
            raise SystemExit(f"--out_dir {self.args.out_dir}: cannot write {self.metrics_path} ({e.strerror or e}); "
                             "pass a folder you can write") from None

    def flag(self, done, loss, norm):
        """Update `done` gave this loss and norm: flag it if they are not finite and none was before (on the device)."""
        bad = (self.first_bad < 0) & ~(torch.isfinite(loss) & torch.isfinite(norm))
        self.first_bad = torch.where(bad, done, self.first_bad)

    def check_finite(self):
        """Stop if an update was flagged. Under DDP each rank holds its own share of the loss, so the ranks agree on
        the earliest update any of them flagged (-1, none, counts as the largest)."""
        if self.ddp:
            none = torch.iinfo(self.first_bad.dtype).max
            first = torch.where(self.first_bad < 0, none, self.first_bad)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            self.first_bad = torch.where(first == none, -1, first)
        if self.first_bad.item() >= 0:
            raise diverged(f"non-finite loss or gradient norm at step {self.first_bad.item()}", self.last_good,
                           self.args.out_dir)

    def check_model(self, step):
        """Stop if the model after update `step` has a non-finite parameter, or a loss on the first validation batch
        that is not finite or has exploded. Under DDP every rank scores the same batch on the same model, which a GPU's
        kernels may still round apart: they stop on the worst of their losses, all alike, as none may save alone."""
        loss = checked_loss(self.model, self.val[0], self.device)
        if self.ddp:
            dist.all_reduce(loss, op=dist.ReduceOp.MAX)
        loss = loss.item()
        if not math.isfinite(loss):
            raise diverged(f"the model after step {step} has non-finite parameters or loss", self.last_good,
                           self.args.out_dir)
        if why := exploded(loss, self.config.vocab_size):
            raise diverged(f"the model after step {step} has a loss on a validation batch of {why}",
                           self.last_good, self.args.out_dir)

    def record(self, row):
        self.master_writes(lambda: self._write_row(row))

    def _write_row(self, row):
        self._check_out_dir(row["step"])
        try:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        except OSError as e:  # a full disk: stop with what is saved (resume drops the torn line)
            raise self._metrics_failed(row["step"], e) from None

    def _check_out_dir(self, step):
        """Stop if metrics.jsonl is no longer at its path (out_dir removed, moved or replaced while the run wrote
        into it): the rows would go on into a file no one can read, and a checkpoint would be written beside no rows
        and no lock, where another run may have started."""
        try:
            there = os.stat(self.metrics_path)
        except OSError:
            there = None
        if there is not None and os.path.samestat(there, os.fstat(self.metrics.fileno())):
            return
        raise SystemExit(f"{self.metrics_path} was removed or replaced while the run wrote to it (was --out_dir "
                         f"{self.args.out_dir} deleted or moved?): stopping at step {step}, writing nothing more "
                         f"there; {go_on_from(self.last_good, self.args.out_dir)}")

    def _metrics_failed(self, step, e):
        return SystemExit(f"cannot write {self.metrics_path} at step {step} ({e.strerror or e}); "
                          f"{after_failed_write(e, self.last_good, self.args.out_dir)}")

    def save(self, step, data_state, eval_pending=False, meter_state=None, again=False):
        """A checkpoint after `step` updates, with this rank's data position (all ranks call it): first the loss and
        norm flags, then the parameters and the loss of one fixed validation batch, so that no diverged model is
        ever written over the last good one. Nothing is written if out_dir's checkpoint holds this already (a stop
        right after a save or a resume): at 7b a second copy would spend a scheduler's grace period. `again` (the
        same on every rank) writes it all the same: the data position holds what that one lacks (a bad line's
        record, which the resume needs to take the shard fixed in place)."""
        if self.on_disk == (step, eval_pending) and not again:
            return
        self.check_finite()
        self.check_model(step)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler else None, "step": step,
                 "args": vars(self.args), "model_config": asdict(self.config), "world": self.world,
                 "rng": torch.get_rng_state(), "data": [None] * self.world, "eval_pending": eval_pending}
        both = [None] * self.world
        if self.ddp:
            dist.all_gather_object(both, (data_state, meter_state))
        else:
            both[0] = (data_state, meter_state)
        state["data"], state["meter"] = [d for d, _ in both], [m for _, m in both]
        self.master_writes(lambda: self._write_checkpoint(state))
        self.last_good[:] = self.path, step
        self.on_disk = (step, eval_pending)

    def _write_checkpoint(self, state):
        self._check_out_dir(state["step"])
        try:  # the rows up to this step reach the disk before the checkpoint that says they were written
            os.fsync(self.metrics.fileno())  # (a power cut could otherwise keep the checkpoint and lose them)
        except OSError as e:
            raise self._metrics_failed(state["step"], e) from None
        try:
            checkpoint.save(self.path, state)
        except checkpoint.SaveFailed as e:  # last_good is still the one before, unless this one is in place
            if e.written:
                self.last_good[:] = self.path, state["step"]
            said = after_failed_write(e.cause, self.last_good, self.args.out_dir)
            raise SystemExit(f"{e}. {said[0].upper()}{said[1:]}") from None
        # written whole: on the master at once, before the ranks agree on it in master_writes, so that should that
        # collective fail (a rank killed meanwhile) the line names this checkpoint, not the one it replaced
        self.last_good[:] = self.path, state["step"]

    def close(self):
        if self.metrics:
            with suppress(OSError):  # a write that failed already said so; its buffer cannot be kept
                self.metrics.close()
