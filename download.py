"""
C4 en shards and T5's tokenizer fetched from Hugging Face (or a mirror): resumed after a dropped connection, checked
(size, sha256, gzip stream, sentencepiece model) before a file takes its name, and refused before the first byte when
a name is wrong, the network is down or the disk cannot hold them. data.py's `download` command and train.py's
--download call it.

    python data.py download --out data/c4 --tokenizer data/t5_spiece.model --train_shards 1 --validation_shards 1
    python -m pytest -q test_download.py
"""
import errno
import fcntl
import gzip
import hashlib
import http.client
import os
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from contextlib import suppress
from pathlib import Path

import sentencepiece as spm

HF_ENDPOINT = "https://huggingface.co"  # override with base_url= or the HF_ENDPOINT environment variable
KNOWN_SHA256 = {  # from ../shared/data/SOURCES.md
    "c4-validation.00000-of-00008.json.gz": "1f25b6af12da84115301d4ee93ea5246c8fea5bb4a2008472794d95b917cc97f",
    "c4-train.00000-of-01024.json.gz": "8ef8d75b0e045dec4aa5123a671b4564466b0707086a7ed1ba8721626dfffbc9",
    "spiece.model": "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86",
}
T5_PIECES = 32000  # the pieces of T5's spiece.model, the one of KNOWN_SHA256 that download fetches
# the bytes of a C4 en shard, about: shard 00000's of each split (SOURCES.md: 319,308,785 and 40,471,190); the others
# are cut to the same number of documents. What a download needs on disk is reckoned from them before it starts
SHARD_BYTES = {"train": 320e6, "validation": 41e6}


def shard_names(train=1, validation=1):
    """The first `train` and `validation` allenai/c4 en shard names (1024 train shards, 8 validation)."""
    if not (0 <= train <= 1024 and 0 <= validation <= 8):
        raise ValueError(f"C4 en has 1024 train and 8 validation shards, asked for {train} and {validation}")
    return ([f"c4-train.{i:05d}-of-01024.json.gz" for i in range(train)]
            + [f"c4-validation.{i:05d}-of-00008.json.gz" for i in range(validation)])


C4_NAMES = frozenset(shard_names(1024, 8))  # every allenai/c4 en shard, which download takes by name


def fetch(url, dest, sha256=None, retries=5, backoff=2.0):
    """Download url to dest through dest.part: resumed with an HTTP Range request after a dropped connection
    (also by a later call), checked (size, sha256 if given, gzip stream, sentencepiece model), then renamed."""
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    _on_disk(dest.parent, dest.parent.mkdir, parents=True, exist_ok=True)
    lock = _claim(part, dest)
    if lock is None:  # another process fetched it while this one waited
        return dest
    try:
        _fetch(url, dest, part, sha256, retries, backoff, lock)
    except KeyboardInterrupt:  # Ctrl-C: what came stays in the .part, which the same command resumes from
        if dest.exists() and not part.exists():  # (between the rename and the folder's sync)
            raise Interrupted(f"{dest} came whole: run the same command again for the rest") from None
        held = os.fstat(lock).st_size
        raise Interrupted(f"{part} keeps the {held:,} bytes that came: run the same command again to resume" if held
                          else f"nothing of {dest} came yet: run the same command again") from None
    finally:
        with suppress(OSError):  # the .part made by _claim, where nothing came (an address refused): no trace left
            if os.stat(part).st_ino == os.fstat(lock).st_ino and not os.fstat(lock).st_size:
                os.remove(part)
        os.close(lock)  # releases the lock: a process waiting in _claim goes on
    return dest


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a fetch, still a KeyboardInterrupt, its message saying what the .part keeps for the resume."""


def _claim(part, dest):
    """An open descriptor of part, locked while the download writes it: two downloads of one file at once (two runs
    with --download into one --data_dir) wrote into one .part, each appending where it saw the other end, and the
    one that finished first checked the file and renamed it with the other's bytes still coming into it. The second
    waits, then takes the file the first renamed, or resumes the .part it left. None: the file is there now."""
    while True:
        fd = _on_disk(part, os.open, part, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"another process is downloading {dest}: waiting for it", flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # ENOLCK, EOPNOTSUPP: a filesystem that cannot lock (some network ones) goes unlocked
                return fd
            with suppress(FileNotFoundError):
                if os.stat(part).st_ino == os.fstat(fd).st_ino:  # the .part is still this file: ours to write
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the holder renamed or removed it while this one waited
        if dest.exists():
            return None


def _fetch(url, dest, part, sha256, retries, backoff, fd):
    """fetch's download into part (fd: its descriptor, held by _claim), then checked, synced and renamed to dest."""
    for attempt in range(retries + 1):
        have = part.stat().st_size if part.exists() else 0
        try:
            request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
            with urllib.request.urlopen(request, timeout=60) as r:
                if have and r.status != 206:
                    have = 0  # the server ignored the Range header: start over
                length = r.headers.get("Content-Length")
                print(f"{url} -> {dest}" + (f" (resuming at {have:,} bytes)" if have else ""), flush=True)
                f = _on_disk(part, open, part, "ab" if have else "wb")
                try:
                    while chunk := r.read(1 << 20):  # (the network's errors are retried below)
                        _on_disk(part, f.write, chunk)
                finally:
                    _on_disk(part, f.close)
            if length is not None and part.stat().st_size != have + int(length):  # urllib does not raise for this
                raise ConnectionError(f"connection closed at {part.stat().st_size:,} of {have + int(length):,} bytes")
            break
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:
                break  # nothing left to fetch: the .part file is complete
            if e.code not in (408, 429) and e.code < 500:
                raise ConnectionError(f"{url}: HTTP {e.code} {e.reason}; check the name (and base URL or HF_ENDPOINT)")
            if attempt == retries:
                raise ConnectionError(f"{url}: HTTP {e.code} {e.reason}; the server is failing, try again later")
        except (OSError, http.client.HTTPException) as e:  # includes dropped connections and timeouts
            reason = getattr(e, "reason", e)
            held = part.stat().st_size if part.exists() else 0
            if not held and getattr(reason, "errno", None) in _UNREACHABLE:  # offline: retries only wait
                raise ConnectionError(_offline(url, dest, reason)) from None
            if attempt == retries:
                resume = f"run the same command again to resume from {part}" if held else "try again later"
                raise ConnectionError(f"{url}: {e}; {resume}") from None
        time.sleep(backoff * 2 ** attempt)
    _verify(part, dest.name, sha256)
    # synced, then renamed, then the rename synced: after a crash or power loss dest is either absent or complete and
    # checked (a filesystem may keep a rename and not the data written before it: an empty shard that counts as whole)
    _on_disk(part, os.fsync, fd)
    os.replace(part, dest)
    with suppress(OSError):  # dest is in place: a filesystem that cannot sync a folder (some FUSE ones) loses no data
        dir_fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _on_disk(path, call, *args, **kwargs):
    """call(*args, **kwargs), a step of writing path: an error of the disk (full, read-only, not ours) is one line,
    raised at once, where as an OSError it was retried as a dropped connection's, for a minute, and then said to be
    one. What the .part holds stays, for the resume."""
    try:
        return call(*args, **kwargs)
    except OSError as e:
        fix = "free space on its disk, or pass a path on another" if e.errno in (errno.ENOSPC, errno.EDQUOT) else \
            "pass a path you can write to"
        raise ValueError(f"cannot write {path} ({e.strerror or e}): {fix} (data.py download --out or --tokenizer, "
                         "train.py --data_dir or --tokenizer), then run the command again") from None


# name or address lookup failed, network unreachable, connection refused: no retry will help soon
_UNREACHABLE = {socket.EAI_NONAME, socket.EAI_AGAIN, getattr(socket, "EAI_NODATA", -5), errno.ENETUNREACH,
                errno.EHOSTUNREACH, errno.ECONNREFUSED}


def _offline(url, dest, reason):
    return (f"the network is unreachable ({reason}). The files come from Hugging Face: C4 en shards from "
            f"{HF_ENDPOINT}/datasets/allenai/c4/tree/main/en (each train shard ~320 MB, 1024 of them; a validation "
            f"shard ~40 MB; a 60m run needs 17 train shards) and T5's tokenizer from {HF_ENDPOINT}/google-t5/t5-base "
            f"(spiece.model, 0.8 MB). Fetch them on a machine with a network and place them by hand: this one was "
            f"{url} -> {dest}")


def _gzip_ok(path):
    try:
        with gzip.open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        return True
    except (EOFError, OSError, zlib.error):
        return False


def _verify(part, name, sha256):
    def fail(why):
        part.unlink()  # a finished but wrong file cannot be resumed into a right one
        raise ValueError(f"download of {name} is bad ({why}) and was deleted; run the command again")
    if sha256 is not None:
        h = hashlib.sha256()
        with open(part, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        if h.hexdigest() != sha256:
            fail(f"sha256 {h.hexdigest()}, expected {sha256}")
    if name.endswith(".gz"):
        try:
            with gzip.open(part, "rb") as f:
                while f.read(1 << 24):
                    pass
        except (EOFError, OSError, zlib.error) as e:
            fail(f"truncated or corrupt gzip: {e}")
    if name.endswith(".model"):
        try:
            spm.SentencePieceProcessor(model_file=str(part))
        except (OSError, RuntimeError) as e:
            fail(f"not a sentencepiece model: {e}")


def endpoint(base_url=None):
    """The server to fetch from: base_url, else $HF_ENDPOINT, else Hugging Face. Anything but an http(s) address is
    refused here, in one line, where urllib would fail at the first fetch with "unknown url type"."""
    source, given = ("--base_url", base_url) if base_url else ("HF_ENDPOINT", os.environ.get("HF_ENDPOINT"))
    base = (given or HF_ENDPOINT).rstrip("/")
    parts = urllib.parse.urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{source} {given!r} is not an http(s) address; pass one such as {HF_ENDPOINT}"
                         + (" (or unset HF_ENDPOINT)" if source == "HF_ENDPOINT" else ""))
    return base


def download(data_dir, tokenizer_path, shards=None, base_url=None,
             known_sha256=KNOWN_SHA256, retries=5, backoff=2.0, recheck=False):
    """Fetch C4 shards (default shard_names(1, 1)) into data_dir and T5's spiece.model to tokenizer_path
    (None: skip it) from Hugging Face; files already present are kept, since fetch only ever renames checked ones,
    unless recheck: then a present shard that fails its gzip check (a truncated copy placed by hand) is replaced."""
    base = endpoint(base_url)
    names = shard_names() if shards is None else list(shards)
    # every name checked before the first fetch: a typo in the last one must not cost the ~320 MB shards before it
    bad = [n for n in names if n not in C4_NAMES]
    if bad:
        what = "is not a C4 en shard name" if len(bad) == 1 else "are not C4 en shard names"
        raise ValueError(f"{', '.join(map(repr, bad))} {what}; they look like c4-train.00000-of-01024.json.gz "
                         f"and c4-validation.00000-of-00008.json.gz")
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        raise ValueError(f"{data_dir} is a file; pass a folder for the shards")
    if tokenizer_path is not None and Path(tokenizer_path).is_dir():
        raise ValueError(f"tokenizer {tokenizer_path} is a folder; pass the file to write, such as "
                         f"{Path(tokenizer_path) / 'spiece.model'}")
    above = [p for p in [*Path(tokenizer_path or ".").parents, *Path(data_dir).parents] if p.exists()]
    if any(not p.is_dir() for p in above):
        raise ValueError(f"{next(p for p in above if not p.is_dir())} is a file where a folder of the paths should be; "
                         "pass other paths")
    # what is to be fetched, known before the room for it is counted: the missing shards, and with recheck the present
    # ones that fail their gzip check (a whole one stays, and needs no room)
    broken = [n for n in names if recheck and (Path(data_dir) / n).exists() and not _gzip_ok(Path(data_dir) / n)]
    check_room(data_dir, [n for n in names if n in broken or not (Path(data_dir) / n).exists()])
    fetched = 0
    for name in names:
        path = Path(data_dir) / name
        if name in broken:
            print(f"{path} is truncated or corrupt: downloading it again", flush=True)
            path.unlink()
        if not path.exists():
            fetch(f"{base}/datasets/allenai/c4/resolve/main/en/{name}", Path(data_dir) / name,
                  known_sha256.get(name), retries, backoff)
            fetched += 1
    if tokenizer_path is not None and not Path(tokenizer_path).exists():
        fetch(f"{base}/google-t5/t5-base/resolve/main/spiece.model", tokenizer_path,
              known_sha256.get("spiece.model"), retries, backoff)
        fetched += 1
    if not fetched:
        tokenizer = f" and {tokenizer_path}" if tokenizer_path is not None else ""
        print(f"nothing to fetch: the {len(names)} shard(s) in {data_dir}{tokenizer} are there already", flush=True)


def check_room(data_dir, names):
    """Refuse, before the first byte, shards that the disk of data_dir cannot hold (SHARD_BYTES each, less what a
    .part of each already holds, and less a broken copy's bytes, removed before its fetch): a full disk would
    otherwise stop the download part way, hours in at 1b."""
    def bytes_of(name):
        held = sum(p.stat().st_size for p in (Path(data_dir) / (name + ".part"), Path(data_dir) / name) if p.exists())
        return max(0.0, SHARD_BYTES[name.split(".")[0].removeprefix("c4-")] - held)
    need = sum(bytes_of(n) for n in names)
    disk = next(p for p in [Path(data_dir), *Path(data_dir).absolute().parents] if p.exists())
    free = shutil.disk_usage(disk).free
    if need > free:
        raise ValueError(f"the {len(names)} shard(s) to fetch need about {need / 1e9:.1f} GB, and the disk of {disk} "
                         f"has {free / 1e9:.1f} GB free; free some, fetch into a folder on a larger disk (train.py "
                         "--data_dir, data.py download --out), or fetch fewer shards (train.py fetches enough for "
                         "--num_training_steps x --total_batch_size)")


if __name__ == "__main__":  # the command is data.py's, with the other data commands
    raise SystemExit("download.py is what data.py's download command runs: python data.py download -h lists its flags")
