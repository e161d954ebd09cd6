"""
Checkpoint files that survive faults: written atomically, checked on load, never half-written when the disk fills or
fails.

    python checkpoint.py out/ckpt.pt          # verify a checkpoint (or out/, its folder): its step, or what is wrong

load_model() gives the model of a checkpoint (sample.py, analyze.py, export.py); check_tokenizer() checks the
tokenizer that is to read it first.

A checkpoint is a plain torch.save file of a dict (loadable with torch.load(..., weights_only=True)); save() adds
"sha256", a digest of every other entry (tensor bytes, dtypes, shapes and plain values, in order), so a truncated,
empty or bit-flipped file is caught on load instead of training on from garbage.
"""

import argparse
import atexit
import errno
import fcntl
import gc
import hashlib
import os
import pickle
import re
import secrets
import signal
import sys
import tempfile
import zipfile
from contextlib import contextmanager, suppress

import torch

from data import load_tokenizer
from model import LLaMA, LLaMAConfig, METHODS


def digest(obj, h=None):
    """sha256 over a nested dict/list of tensors and plain values; the same state gives the same digest."""
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            h.update(repr(k).encode())
            digest(v, h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            digest(v, h)
    else:
        h.update(repr(obj).encode())
    return h


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: the fix is free space


class SaveFailed(Exception):
    """save() could not write its file: `cause` is the OSError that stopped it (a full disk or quota: `disk_full`; a
    read-only, failing or full-sized filesystem, lost permissions, ...), `kept` whether an earlier file at the path is
    still there, whole. The partial file is removed. The caller adds what to do, which depends on the program.
    `written`: the file was written, fsynced and renamed into place, and only its folder's sync failed (an I/O error:
    a failing disk); the new file is then the one at the path, whole, though a crash of the machine may lose it."""

    def __init__(self, path, cause, kept, written=False):
        self.path, self.cause, self.kept, self.written = path, cause, kept, written
        self.disk_full = cause.errno in DISK_FULL
        what = "disk full: " if self.disk_full else ""
        if written:
            super().__init__(f"wrote {path}, but could not sync its folder ({cause.strerror or cause}): the new "
                             "checkpoint is in place, and a crash of the machine may lose it")
            return
        super().__init__(f"{what}could not write {path} ({cause.strerror or cause}); "
                         + ("the previous checkpoint there is kept" if kept else "none was saved there yet"))


class _Writes:
    """The file torch.save writes into, keeping the first OSError a write raised: torch's zip writer goes on and
    reports its own RuntimeError ("unexpected pos ..."), which has no errno."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self):
        self.f.flush()


# what fsync of a folder says on a filesystem that has no such sync (CIFS, some FUSE and network ones)
NO_FOLDER_SYNC = (errno.EINVAL, errno.EOPNOTSUPP)
TEMPORARY = re.compile(r".+\.\d+\.[0-9a-f]{8}\.tmp")  # the name of atomic_file's temporary: path.PID.RANDOM.tmp


@contextmanager
def atomic_file(path):
    """A binary file to write that appears at path whole or not at all: a temporary file beside it, of a name of its
    own (path.PID.RANDOM.tmp: two writers never write into one file), fsynced, renamed over path. A kill leaves the
    old file or the new one, never a mix (and the temporary, which folder_lock removes); an error (or Ctrl-C) in the
    writing removes the temporary, a partial file that would only fill the disk further, and leaves an earlier file
    at path as it was."""
    with atomic_files([path]) as (f,):
        yield f


@contextmanager
def atomic_files(paths):
    """atomic_file for files that belong together (an export's weights, config and tokenizer; a set of figures): all
    or none. Each is written into a temporary of its own, and every one is flushed and fsynced before the first is
    renamed, so that a write or an fsync that fails (a full disk; a delayed-allocation one says so at fsync), or a
    Ctrl-C, removes them all and leaves the earlier set as it was, not new files beside old ones. Only a kill in the
    renames themselves can leave some renamed. An OSError of its own names the file (not its temporary)."""
    paths, tmps, files = list(paths), [], []
    try:
        for path in paths:
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # TEMPORARY matches it
            with _naming(path):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to open()'s
            tmps.append(tmp)
            files.append(open(fd, "wb"))
        yield files
        for path, f in zip(paths, files):
            with _naming(path):
                f.flush()
                os.fsync(f.fileno())
                f.close()
        for tmp, path in zip(tmps, paths):
            os.replace(tmp, path)
    except BaseException:
        for f in files:
            with suppress(OSError):
                f.close()
        for tmp in tmps:  # (one renamed already is not there)
            with suppress(OSError):
                os.remove(tmp)
        raise
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the renames themselves
        except OSError as e:  # the files are synced and renamed: saved, on a filesystem that cannot sync a folder too
            if e.errno not in NO_FOLDER_SYNC:
                e.renamed = True  # any other error: the new files are in place, their names perhaps not on the disk
                raise
        finally:
            os.close(dir_fd)


@contextmanager
def _naming(path):
    """An OSError raised inside names path: fsync's names no file, and os.open's the temporary."""
    try:
        yield
    except OSError as e:
        e.filename = path
        raise


class FolderBusy(Exception):
    """Another process holds the folder's lock (folder_lock)."""


_HELD = set()  # the file descriptors of the folder locks this process holds


def _close_held_in_child():
    """In a forked child (a DataLoader worker): the parent's lock is the parent's. flock belongs to the open file,
    which the child shares; left open, a worker that outlives a killed parent by seconds (its watchdog's period)
    holds the lock, and a resume started at once is refused, naming a process that is gone."""
    for fd in _HELD:
        with suppress(OSError):
            os.close(fd)
    _HELD.clear()


@contextmanager
def folder_lock(folder):
    """An exclusive lock on folder/.lock while inside, so that one run at a time writes a folder's checkpoint and
    metrics (two at once, a requeued job beside the old one still ending, would write over each other's files).
    The OS releases it when the process ends, however it ends. FolderBusy names the holder's process id. Once held,
    the temporaries of atomic_file that a killed writer left in the folder (a whole checkpoint each) are removed. A
    filesystem without locks (some network ones) gets no lock, and a note says so. A folder left holding the lock
    file alone (a run refused before it wrote) is left as it was found: the lock file goes, and the folder if made."""
    made, lock = make_folder(folder), os.path.join(folder, ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        remove_empty(made)
        raise
    held = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            holder = os.pread(fd, 20, 0).decode(errors="replace").strip() or "unknown"
            raise FolderBusy(f"another process (pid {holder}) is writing into {folder}") from None
        except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem that cannot lock
            print(f"note: {folder} cannot be locked ({e.strerror or e}): make sure no other run writes into it")
        else:
            if not hasattr(folder_lock, "forks_close"):  # once per process: register_at_fork has no undo
                os.register_at_fork(after_in_child=_close_held_in_child)
                folder_lock.forks_close = True
            _HELD.add(fd)
            with suppress(OSError):  # the holder's id, for the message; a full disk may refuse it
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
            for name in os.listdir(folder):
                if TEMPORARY.fullmatch(name):
                    with suppress(OSError):
                        os.remove(os.path.join(folder, name))
        yield
    finally:
        _HELD.discard(fd)
        os.close(fd)  # releases the lock
        with suppress(OSError):
            if held and os.listdir(folder) == [".lock"]:  # (another's lock file stays: it holds its lock)
                os.remove(lock)
                remove_empty(made)


def make_folder(path):
    """Make folder path and the parents it lacks, and try a file in it; returns the folders made, outermost first, for
    remove_empty. A command makes its output folder before its expensive work, so that one it cannot make or write
    into is refused first, with nothing of it left. realpath: "link/.." is where the link points, up one, as the OS
    reads it; and a link to a folder not there (made before its target, or one a scratch purge removed) is followed
    to it, made as a file is made through such a link, where os.makedirs(link) fails with "File exists"."""
    made, head = [], os.path.realpath(path)
    while not os.path.exists(head):
        made.insert(0, head)
        head = os.path.dirname(head)
    try:
        os.makedirs(os.path.realpath(path), exist_ok=True)
        # tried, not read from permissions: root passes os.access where the filesystem refuses (/proc, a read-only
        # mount)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:  # made part of the way (a name too long below a new folder): what it made goes again
        remove_empty(made)
        raise
    return made


def remove_empty(folders):
    """Remove those of folders that are empty, innermost first: a command that fails leaves no empty folder it made."""
    for folder in reversed(folders):
        with suppress(OSError):  # not empty (or gone): it stays as it is
            os.rmdir(folder)


def save(path, state):
    """state, with its sha256, to path through atomic_file; a write the filesystem refuses (a full disk, ...) raises
    SaveFailed, with the old file kept."""
    state = {**state, "sha256": digest(state).hexdigest()}
    out = None
    try:
        with atomic_file(path) as f:
            out = _Writes(f)
            torch.save(state, out)
    except (OSError, RuntimeError) as e:
        cause = out.error if out and out.error else e
        if isinstance(cause, OSError):
            raise SaveFailed(path, cause, os.path.exists(path), getattr(cause, "renamed", False)) from None
        raise  # torch's own error, not the filesystem's


def load(path):
    """The checkpoint at path, verified; a missing, unreadable or corrupt file raises ValueError naming the fix."""
    fix = ("it is damaged (truncated, emptied or changed since it was written): restore it from a copy, or start a "
           "fresh run with a new --out_dir")
    other = ("pass a checkpoint that train.py or export.py --merged wrote (a run's ckpt.pt, or its folder); a Hugging "
             "Face export is not read back")
    try:
        # the open file, not its name: torch.load reads a path ending in .safetensors as a safetensors file (with that
        # package, else it says to install it), so a --merged dense.safetensors was "damaged"; and a real one, an
        # export's weights, is refused here from its first bytes, not read whole (13.5 GB at 7b)
        with open(path, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except PermissionError as e:  # (a shared cluster's run of another user, say): the file is whole, not damaged
        raise ValueError(f"checkpoint {path} cannot be read ({e.strerror}); ask for read access to it, or pass a copy "
                         "you can read") from None
    except Exception as e:  # noqa: BLE001 - torch reports damage as RuntimeError, EOFError, UnpicklingError, ...
        if not _zip_start(path):  # torch.save writes a zip archive, which a cut or damaged one still starts as
            raise ValueError(f"{path} is not a checkpoint (not a torch zip file); {other}") from None
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))  # torch.save(model), a Namespace of args
        if isinstance(e, pickle.UnpicklingError) and refused and _pickle_whole(path):
            raise ValueError(f"{path} was not written by train.py: it holds Python objects that a weights-only load "
                             f"refuses ({refused.group(1)}); {other}") from None
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}); {fix}") from None
    if not isinstance(state, dict) or "sha256" not in state:
        raise ValueError(f"{path} has no checksum, so it was not written by train.py; {other}")
    stored = state.pop("sha256")
    if digest(state).hexdigest() != stored:
        raise ValueError(f"checkpoint {path} fails its sha256 check; {fix}")
    return state


def _zip_start(path):
    """Whether the file may be a damaged checkpoint: empty, zeroed at the start (a crash can leave either), or
    beginning as a zip archive does (a cut one), or unreadable here. Else it is some other file, a safetensors or a
    JSON one, say."""
    try:
        with open(path, "rb") as f:
            start = f.read(4)
    except OSError:  # a folder, no permission, an I/O error: load says it cannot be read
        return True
    return start.strip(b"\0") == b"" or start == b"PK\x03\x04"


def _pickle_whole(path):
    """Whether the file's pickle is as it was written (its zip CRC holds): a pickle that a weights-only load refuses
    is then another program's objects, not damage (a changed byte can turn a tensor's rebuild into a refused name)."""
    try:
        with zipfile.ZipFile(path) as z:
            z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))  # raises on a CRC mismatch
        return True
    except Exception:  # noqa: BLE001 - a cut or damaged archive fails here in many ways: damaged, as load says
        return False


def peek(path):
    """The checkpoint at path with its tensors mapped from the file, not read, and its checksum not checked: a quick
    look at its run (args, data positions) before the real load; None where it cannot be read that way."""
    if not _zip_start(path):  # a safetensors file, say, which torch.load would read whole (mmap needs the name)
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - load() says what is wrong with it, when it comes to that
        return None


def check_tokenizer(path, tokenizer=None):
    """The tokenizer that is to read a checkpoint's model (tokenizer, else the one its run recorded) checked at a quick
    look, before the full read (minutes at 7b): a missing file, other pieces or, where the run says, another sha256
    raise as load_tokenizer says. Nothing is checked where the look cannot tell: load_model then says what is wrong."""
    look = peek(checkpoint_file(path))
    if not isinstance(look, dict) or not isinstance(look.get("model_config"), dict):
        return
    run = look.get("args") if isinstance(look.get("args"), dict) else {}
    tokenizer = tokenizer or run.get("tokenizer")
    if not tokenizer:
        raise ValueError(f"{path} names no tokenizer; pass --tokenizer")
    load_tokenizer(tokenizer, pieces=look["model_config"].get("vocab_size"), sha256=run.get("tokenizer_sha256"))


def load_model(path, device="cpu"):
    """A model from a checkpoint that train.py (or export.py --merged) wrote, verified -> (model in eval mode,
    checkpoint). path may be the run's folder (its ckpt.pt), as for train.py --resume. Refuses, with the reason, a
    file that is not such a checkpoint."""
    path = checkpoint_file(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; pass the ckpt.pt that train.py wrote into its --out_dir")
    ckpt = load(path)
    if not {"model", "model_config"} <= set(ckpt):
        raise ValueError(f"{path} has no 'model' and 'model_config' entries: not written by train.py or "
                         "export.py --merged; pass one that was")
    # packed_support is how the supports are stored, not the model: a checkpoint from before it stores them flat
    missing = set(LLaMAConfig.__dataclass_fields__) - set(ckpt["model_config"]) - {"packed_support"}
    unknown = unknown_fields(ckpt["model_config"])
    if unknown or missing:  # a missing one would take its default: alpha or n_heads change no shape, only the model
        what = ", ".join(f"{k} model_config fields {sorted(v)}" for k, v in (("unknown", unknown),
                                                                             ("missing", missing)) if v)
        raise ValueError(f"{path}: {what}; it was written by another version of model.py")
    if ckpt["model_config"]["method"] not in METHODS:
        raise ValueError(f"{path}: model_config method {ckpt['model_config']['method']!r} is none of {METHODS}; the "
                         "file was written by another program")
    model = LLaMA(LLaMAConfig(**ckpt["model_config"]), device="meta")
    try:
        model.load_state_dict(ckpt["model"], strict=True, assign=True)  # the checkpoint's tensors, no copy
    except RuntimeError as e:
        raise ValueError(f"{path}: the weights do not fit its model_config ({str(e).splitlines()[0]}); "
                         "the file was edited") from None
    dtype = next(iter(ckpt["model"].values())).dtype
    return model.to(device=device, dtype=dtype).eval(), ckpt


def unknown_fields(model_config):
    """The fields of a checkpoint's model_config that this model.py's LLaMAConfig lacks, sorted: a newer version
    wrote it, whose model they change (taken as this one's, they would be dropped without a word)."""
    return sorted(set(model_config) - set(LLaMAConfig.__dataclass_fields__))


# the model's fields that no flag sets: every model that train.py builds has them as they are
UNFLAGGED = {k: LLaMAConfig.__dataclass_fields__[k].default for k in ("norm_eps", "rope_theta")}
OTHER_VERSION = "it was written by another version of model.py, whose model this one does not build: use that one"


def other_model(model_config):
    """What in a checkpoint's model_config says it is of a model that train.py does not build from its flags, in
    words ("" for nothing): fields this model.py lacks, or one no flag sets (UNFLAGGED) at another value. A resume,
    an evaluation or an --init_from taking it as this version's model would drop them without a word."""
    other = [f"unknown model_config fields {unknown}"] if (unknown := unknown_fields(model_config)) else []
    other += [f"{k} {model_config[k]!r} (this one's {v!r})" for k, v in UNFLAGGED.items()
              if model_config.get(k, v) != v]
    return ", ".join(other)


def checkpoint_file(path):
    """path, or the ckpt.pt in it when it is a folder (a train.py --out_dir)."""
    return os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path


def main(argv=None):
    """Verify each checkpoint (a ckpt.pt, or the --out_dir that holds one): its step, or one line on what is wrong;
    every one is checked, and the exit is non-zero if any is not whole."""
    p = argparse.ArgumentParser(description="verify checkpoints: the step of each, or what is wrong with it",
                                allow_abbrev=False)
    p.add_argument("ckpt", nargs="+", help="a ckpt.pt that train.py wrote, or the --out_dir holding one")
    paths, bad = p.parse_args(argv).ckpt, 0
    for path in map(checkpoint_file, paths):
        try:
            if not os.path.isfile(path):
                raise ValueError(f"no checkpoint at {path}; pass a ckpt.pt that train.py wrote, or its --out_dir")
            print(f"{path}: ok, step {load(path).get('step')}", flush=True)
        except (OSError, ValueError) as e:
            bad += 1
            print(e, file=sys.stderr, flush=True)
    if bad:
        raise SystemExit(f"{bad} of {len(paths)} checkpoint(s) not whole")


if __name__ == "__main__":
    atexit.register(gc.freeze)  # no last walk of the heap at exit: train.py says why
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # it writes no file: a reader that stops (| head) ends it at once
    main()
