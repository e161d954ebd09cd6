"""
Tests for download.py: a local HTTP server stands in for Hugging Face (ranges, dropped connections, errors), with
tiny gzipped shards and a sentencepiece model made here; no network.

    python -m pytest -q test_download.py
"""
import errno
import gzip
import hashlib
import http.server
import io
import json
import os
import random
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import data
import download
from test_data import corpus, make_docs, quiet, read_then_stop, tok  # noqa: F401 (fixtures shared with test_data)


class Server:
    """A local HTTP server, with Range support unless ranges=False; paths in `drop` lose their connection
    halfway, once. pause: (bytes, event) for the first answers in turn: each sends that many bytes of its body, then
    waits for its event before the rest."""

    def __init__(self, files, drop=(), ranges=True, pause=()):
        self.files, self.drop, self.requests, pause = files, set(drop), [], list(pause)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body, rng = server.files.get(self.path), self.headers.get("Range")
                server.requests.append((self.path, rng))
                rng = rng if ranges else None
                if body is None:
                    return self.send_error(404)
                start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1)) if rng else 0
                if start >= len(body):
                    return self.send_error(416)
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                if self.path in server.drop:
                    server.drop.discard(self.path)
                    self.wfile.write(body[start:start + (len(body) - start) // 2])
                    return  # HTTP/1.0: returning closes the connection short of Content-Length
                if len(server.requests) <= len(pause):
                    sent, event = pause[len(server.requests) - 1]
                    self.wfile.write(body[start:start + sent])
                    self.wfile.flush()
                    event.wait(10)
                    start += sent
                self.wfile.write(body[start:])

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    """The shards these tests fetch are small: a download's room is reckoned at theirs, not a real C4 shard's, so
    that a machine with less disk free than 320 MB a shard still runs them (test_download_refuses_... sets its own)."""
    monkeypatch.setattr(download, "SHARD_BYTES", {"train": 1e3, "validation": 1e3})


def test_download_refuses_shards_the_disk_cannot_hold_before_fetching_any(tmp_path, monkeypatch):
    """A full disk stopped a download part way (hours in, at 1b's 205 shards). What the missing shards need, at a real
    shard's size less a .part's bytes, is checked against the disk first; shards present are not counted."""
    fetched = []
    monkeypatch.setattr(download, "fetch", lambda url, dest, *a, **kw: fetched.append(url))
    monkeypatch.setattr(download, "SHARD_BYTES", {"train": 320e6, "validation": 41e6})
    free = 700e6
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: SimpleNamespace(total=1e12, used=0, free=free))
    folder = tmp_path / "c4"
    names = download.shard_names(2, 1)  # 681 MB: fits
    download.download(folder, None, names)
    assert len(fetched) == 3
    fetched.clear()
    with pytest.raises(ValueError, match=r"^the 4 shard\(s\) to fetch need about 1.0 GB, and the disk of .* has 0.7 GB "
                                         r"free; free some, fetch into a folder on a larger disk \(train.py "
                                         r"--data_dir, data.py download --out\), or fetch fewer shards"):
        download.download(folder, None, download.shard_names(3, 1))
    assert not fetched
    folder.mkdir()
    (folder / names[0]).write_bytes(b"")  # present: not fetched again, not counted
    (folder / (download.shard_names(4, 0)[3] + ".part")).write_bytes(b"x" * 100)  # a .part's bytes are there already
    download.download(folder, None, names[:1] + download.shard_names(4, 0)[2:4])
    assert len(fetched) == 2
    with pytest.raises(SystemExit, match="need about 1.0 GB"):  # the command line says it in one line
        data.main(["download", "--out", str(tmp_path / "other"), "--tokenizer", "", "--train_shards", "3"])
    # --shards rechecks the named shards (what a truncated shard's message says to run): a whole one stays and needs
    # no room; a broken one is fetched again, its own bytes counted as freed
    fetched.clear()
    monkeypatch.setattr(download, "SHARD_BYTES", {"train": 3000, "validation": 3000})  # shards of 3 kB, 2 kB free
    free = 2000
    shard = folder / names[1]
    shard.write_bytes(gzip.compress(b'{"text": "a whole shard"}\n'))
    data.main(["download", "--out", str(folder), "--tokenizer", "", "--shards", names[1]])
    assert not fetched and shard.exists()
    shard.write_bytes(gzip.compress(bytes(range(256)) * 8, compresslevel=0)[:1500])  # cut short: 1.5 kB of 3
    data.main(["download", "--out", str(folder), "--tokenizer", "", "--shards", names[1]])
    assert len(fetched) == 1 and not shard.exists()  # (the fake fetch writes nothing)


@pytest.fixture
def serve(monkeypatch):
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)  # talk to 127.0.0.1 directly, never through a proxy
    servers = []
    yield lambda *args, **kw: servers.append(Server(*args, **kw)) or servers[-1]
    for s in servers:
        s.httpd.shutdown()
        s.httpd.server_close()


def gz_shard(n, seed=0):
    return gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in make_docs(0, n, random.Random(seed))).encode())


def sha(b):
    return hashlib.sha256(b).hexdigest()


def test_fetch_resumes_after_a_dropped_connection(serve, tmp_path):
    body = gz_shard(200)
    server = serve({"/a.json.gz": body}, drop={"/a.json.gz"})
    dest = download.fetch(server.url + "/a.json.gz", tmp_path / "a.json.gz", sha256=sha(body), backoff=0)
    assert dest.read_bytes() == body, "resumed file differs from the served one"
    assert server.requests == [("/a.json.gz", None), ("/a.json.gz", f"bytes={len(body) // 2}-")], server.requests
    assert not (tmp_path / "a.json.gz.part").exists()
    server = serve({"/a.json.gz": body}, drop={"/a.json.gz"}, ranges=False)  # a server that ignores Range
    dest = download.fetch(server.url + "/a.json.gz", tmp_path / "b.json.gz", sha256=sha(body), backoff=0)
    assert dest.read_bytes() == body, "a 200 answer to a Range request must restart the file, not append"


def test_fetch_resumes_in_a_later_call(serve, tmp_path):
    body = gz_shard(200)
    server = serve({"/a.json.gz": body}, drop={"/a.json.gz"})
    with pytest.raises(ConnectionError, match="again to resume"):
        download.fetch(server.url + "/a.json.gz", tmp_path / "a.json.gz", retries=0)
    assert not (tmp_path / "a.json.gz").exists(), "a partial download must never have the final name"
    assert (tmp_path / "a.json.gz.part").stat().st_size == len(body) // 2
    download.fetch(server.url + "/a.json.gz", tmp_path / "a.json.gz", sha256=sha(body), retries=0)
    assert (tmp_path / "a.json.gz").read_bytes() == body
    assert server.requests[-1] == ("/a.json.gz", f"bytes={len(body) // 2}-")


def test_fetch_rejects_bad_files(serve, tmp_path):
    body = gz_shard(200)
    server = serve({"/a.json.gz": body, "/cut.json.gz": body[:len(body) // 2], "/spiece.model": b"garbage"})
    cases = [("a.json.gz", "0" * 64, "sha256"), ("cut.json.gz", None, "gzip"), ("spiece.model", None, "sentencepiece")]
    for name, digest, message in cases:
        with pytest.raises(ValueError, match=message):
            download.fetch(f"{server.url}/{name}", tmp_path / name, sha256=digest, backoff=0)
        assert not (tmp_path / name).exists() and not (tmp_path / f"{name}.part").exists(), f"{name} left behind"
    with pytest.raises(ConnectionError, match="404"):
        download.fetch(server.url + "/missing.json.gz", tmp_path / "missing.json.gz", backoff=0)


def test_download_uses_the_hugging_face_layout(serve, tok, tmp_path, monkeypatch, capsys):
    names = download.shard_names(2, 1)[1:]  # shard 00000 has a known sha256 that the fixtures cannot match
    files = {f"/datasets/allenai/c4/resolve/main/en/{n}": gz_shard(30, i) for i, n in enumerate(names)}
    files["/google-t5/t5-base/resolve/main/spiece.model"] = Path(tok).read_bytes()
    server = serve(files, drop=list(files)[:1])
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    known = {"spiece.model": sha(Path(tok).read_bytes())}
    download.download(tmp_path / "c4", tmp_path / "t5.model", names, known_sha256=known, backoff=0)
    for n in names:
        assert (tmp_path / "c4" / n).read_bytes() == files[f"/datasets/allenai/c4/resolve/main/en/{n}"]
    assert data.load_tokenizer(tmp_path / "t5.model").vocab_size() == 300
    assert [p.name for p in data.find_shards(tmp_path / "c4", "train")] == names[:1]
    count = len(server.requests)
    capsys.readouterr()
    download.download(tmp_path / "c4", tmp_path / "t5.model", names, base_url=server.url)
    assert len(server.requests) == count, "files already downloaded were fetched again"
    said = capsys.readouterr().out  # a command that does nothing says so
    assert said == f"nothing to fetch: the 2 shard(s) in {tmp_path / 'c4'} and {tmp_path / 't5.model'} are there " \
        "already\n", said
    with pytest.raises(ValueError, match="c4-train.00000-of-01024.json.gz"):
        download.download(tmp_path / "c4", None, ["c4-train.0-of-1024.json"], base_url=server.url)


def test_a_download_whose_reader_is_gone_fetches_every_file_and_exits_0(serve, tmp_path):
    """`python data.py download ... | tee log`, and tee ends: the line said before each fetch failed, was taken for a
    dropped connection and retried, and the download stopped with "[Errno 32] Broken pipe; try again later" after
    its first file. The lines now go nowhere and every file is fetched."""
    names = download.shard_names(2, 2)[1::2]  # shards 00001: 00000's known sha256 is the real shard's
    files = {f"/datasets/allenai/c4/resolve/main/en/{n}": gz_shard(30, i) for i, n in enumerate(names)}
    server = serve(files)
    small = "import download, functools, runpy; download.SHARD_BYTES = {'train': 1e3, 'validation': 1e3}; " \
            "download.download = functools.partial(download.download, backoff=0); " \
            "runpy.run_path('data.py', run_name='__main__')"  # small_shards' room, and retries without waits
    status, err = read_then_stop(["-c", small, "download", "--out", str(tmp_path), "--tokenizer", "", "--shards",
                                  *names, "--base_url", server.url])
    assert status == 0 and quiet(err), (status, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


@pytest.mark.parametrize("base_url,env,message", [
    ("notaurl", None, "--base_url 'notaurl' is not an http(s) address; pass one such as https://huggingface.co"),
    ("ftp://mirror.example/hf", None, "--base_url 'ftp://mirror.example/hf' is not an http(s) address"),
    ("http://", None, "--base_url 'http://' is not an http(s) address"),  # no host
    (None, "huggingface.co", "HF_ENDPOINT 'huggingface.co' is not an http(s) address; pass one such as "
                             "https://huggingface.co (or unset HF_ENDPOINT)"),
])
def test_a_download_address_that_is_not_http_is_refused_before_any_fetch(tmp_path, monkeypatch, base_url, env,
                                                                         message):
    """urllib failed at the first fetch with "unknown url type", naming neither the flag nor the variable."""
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    if env:
        monkeypatch.setenv("HF_ENDPOINT", env)
    argv = ["download", "--out", str(tmp_path / "c4"), "--tokenizer", ""]
    argv += ["--base_url", base_url] if base_url else []
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    assert str(e.value).startswith(message), e.value
    assert not (tmp_path / "c4").exists(), "refused after the download began"


def test_download_checks_every_shard_name_before_fetching_any(tmp_path, monkeypatch, capsys):
    fetched = []
    monkeypatch.setattr(download, "fetch", lambda url, dest, *a, **kw: fetched.append(url))  # no network
    # a typo in the last name only; then indexes past C4 en's 1024 train and 8 validation shards, of the right form
    for typo in ("c4-train.00003-of-1024.json.gz", "c4-train.01024-of-01024.json.gz",
                 "c4-validation.00008-of-00008.json.gz"):
        with pytest.raises(SystemExit, match=f"'{typo}' is not a C4 en shard name"):
            data.main(["download", "--out", str(tmp_path / "c4"), "--tokenizer", "", "--shards",
                       *download.shard_names(3, 1), typo])
        assert not fetched and not (tmp_path / "c4").exists(), f"fetched before the bad name was seen: {fetched}"
    assert len(download.C4_NAMES) == 1032 and set(download.shard_names(1024, 8)) == download.C4_NAMES


def test_offline_download_says_so_at_once(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: the connection is refused, as with no network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        data.main(["download", "--out", str(tmp_path), "--tokenizer", "", "--train_shards", "1",
                   "--validation_shards", "0", "--base_url", f"http://127.0.0.1:{port}"])
    assert time.perf_counter() - t < 5, "no minute of silent retries when the network is unreachable"
    message = str(e.value)
    assert "network is unreachable" in message and "~320 MB" in message and "place them by hand" in message
    assert ".part" not in message and not list(tmp_path.iterdir())


def test_download_of_a_named_shard_replaces_a_truncated_copy(serve, tmp_path, capsys):
    name = download.shard_names(2, 0)[1]  # shard 00000 has a known sha256 that the fixtures cannot match
    body = gz_shard(30)
    server = serve({f"/datasets/allenai/c4/resolve/main/en/{name}": body})
    (tmp_path / name).write_bytes(body[: len(body) // 2])
    with pytest.raises(ValueError, match=r"python data.py download --shards .*") as e:
        list(data._lines(tmp_path / name))
    fix = str(e.value).split("(python ", 1)[1].split(")", 1)[0].split()  # the command the message gives
    data.main(fix[1:] + ["--tokenizer", "", "--base_url", server.url])
    assert (tmp_path / name).read_bytes() == body, "the suggested command must replace the truncated shard"


def test_a_disk_that_cannot_take_the_download_is_said_at_once_not_retried(serve, tmp_path, monkeypatch):
    """A write of the .part that fails (a full disk, a folder not ours) was taken for a dropped connection: retried for
    a minute, then a ConnectionError saying to try again later. It is one line at once, naming the file and the fix;
    the bytes written so far stay in the .part, for the resume once there is room."""
    body = gz_shard(200)
    server = serve({"/a.json.gz": body})

    class Full(io.FileIO):
        def write(self, chunk):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(download, "open", lambda path, mode: Full(path, mode[0]), raising=False)
    with pytest.raises(ValueError, match=rf"^cannot write {re.escape(str(tmp_path / 'a.json.gz.part'))} \(No space "
                                         r"left on device\): free space on its disk, or pass a path on another"):
        download.fetch(server.url + "/a.json.gz", tmp_path / "a.json.gz", backoff=0)
    assert len(server.requests) == 1, f"a disk error was retried as the network's: {server.requests}"
    monkeypatch.undo()
    (tmp_path / "b.json.gz.part").mkdir()  # the .part cannot be opened for writing at all
    with pytest.raises(ValueError, match=r"^cannot write .*b\.json\.gz\.part \(Is a directory\): pass a path you can "
                                         r"write to \(data.py download --out or --tokenizer, train.py --data_dir"):
        download.fetch(server.url + "/a.json.gz", tmp_path / "b.json.gz", backoff=0)



def test_two_downloads_of_one_file_at_once_write_it_once_and_whole(serve, tmp_path, capsys):
    """Two runs with --download into one --data_dir (a sweep started at once) fetched a shard into the same .part: the
    second appended from the size it saw, the first checked and renamed the file, and the second's bytes went on into
    the renamed, checked shard (or the first's check failed on them: "bad, deleted"). The second now waits for the
    first, and takes its file."""
    body = gzip.compress(random.Random(0).randbytes(3 << 20), compresslevel=0)  # past the 1 MB that a read takes
    first, second = threading.Event(), threading.Event()
    server = serve({"/a.json.gz": body}, pause=[(3 << 19, first), (0, second)])  # 1.5 MB, then none, till the events
    dest, got = tmp_path / "a.json.gz", {}

    def fetch(name):
        try:
            got[name] = download.fetch(server.url + "/a.json.gz", dest, retries=0)
        except Exception as e:  # noqa: BLE001 - said by the assert below
            got[name] = e
    a = threading.Thread(target=fetch, args=("a",))
    a.start()
    while not (dest.parent / "a.json.gz.part").exists() or (dest.parent / "a.json.gz.part").stat().st_size < 1 << 20:
        time.sleep(0.01)  # the first MB of the first download is in its .part
    b = threading.Thread(target=fetch, args=("b",))
    b.start()
    said, t = "", time.perf_counter()
    while "waiting" not in said and len(server.requests) < 2 and time.perf_counter() - t < 5:
        said += capsys.readouterr().out
        time.sleep(0.01)
    time.sleep(0.2)  # (the second, where it fetches too, opens the .part once its answer's headers come)
    first.set()
    a.join()
    second.set()
    b.join()
    assert dest.read_bytes() == body, f"{dest.stat().st_size:,} bytes, served {len(body):,}"
    assert got == {"a": dest, "b": dest}, got
    assert len(server.requests) == 1 and os.listdir(tmp_path) == ["a.json.gz"], (server.requests, os.listdir(tmp_path))


def test_a_fetched_file_is_on_disk_before_it_takes_its_name(serve, tmp_path, monkeypatch):
    """The rename made a shard whole by its name, but its bytes were never synced: after a crash or power loss the
    filesystem may keep the rename and not the data (an empty or zero-filled shard), which download then keeps as
    whole. The file, then its folder (the rename), are synced, as checkpoint.atomic_file does."""
    body = gz_shard(30)
    server = serve({"/a.json.gz": body})
    synced, fsync, replace = [], download.os.fsync, download.os.replace

    def record(fd):
        synced.append(os.fstat(fd).st_ino)
        fsync(fd)

    def replaced(src, dst):
        synced.append(("rename", Path(dst).name))
        replace(src, dst)
    monkeypatch.setattr(download.os, "fsync", record)
    monkeypatch.setattr(download.os, "replace", replaced)
    dest = download.fetch(server.url + "/a.json.gz", tmp_path / "a.json.gz", sha256=sha(body))
    monkeypatch.undo()
    assert synced == [dest.stat().st_ino, ("rename", "a.json.gz"), tmp_path.stat().st_ino], synced


def test_ctrl_c_mid_download_is_one_line_and_the_same_command_resumes(serve, tmp_path, monkeypatch):
    """Ctrl-C in `python data.py download` ended with a traceback through urllib, not saying that the bytes that
    came are kept. It is one line saying how to go on, and the command run again resumes from the .part."""
    name = download.shard_names(2, 0)[1]  # shard 00000 has a known sha256 that the fixtures cannot match
    body = gzip.compress(random.Random(0).randbytes(3 << 20), compresslevel=0)  # past the 1 MB that a read takes
    server = serve({f"/datasets/allenai/c4/resolve/main/en/{name}": body})
    urlopen = download.urllib.request.urlopen

    class Interrupted:  # the answer, with Ctrl-C pressed as its second MB is read
        def __init__(self, *args, **kwargs):
            self.answer, self.reads = urlopen(*args, **kwargs), 0

        def __enter__(self):
            self.answer.__enter__()
            return self

        def __exit__(self, *exc):
            return self.answer.__exit__(*exc)

        def read(self, n):
            self.reads += 1
            if self.reads == 2:
                raise KeyboardInterrupt
            return self.answer.read(n)

        def __getattr__(self, attr):
            return getattr(self.answer, attr)
    monkeypatch.setattr(download.urllib.request, "urlopen", Interrupted)
    argv = ["download", "--out", str(tmp_path), "--tokenizer", "", "--shards", name, "--base_url", server.url]
    with pytest.raises(SystemExit) as e:
        data.main(argv)
    part = tmp_path / f"{name}.part"
    held = part.stat().st_size
    assert held and str(e.value) == f"download: interrupted; {part} keeps the {held:,} bytes that came: run the " \
        "same command again to resume", e.value
    monkeypatch.undo()
    data.main(argv)
    assert (tmp_path / name).read_bytes() == body and not part.exists()
    assert server.requests[-1] == (f"/datasets/allenai/c4/resolve/main/en/{name}", f"bytes={held}-")
    # Ctrl-C before any byte came: no .part is left, and the line says so
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    (tmp_path / name).unlink()
    with pytest.raises(SystemExit, match=rf"^download: interrupted; nothing of {re.escape(str(tmp_path / name))} came "
                                         r"yet: run the same command again$"):
        data.main(argv)
    assert not list(tmp_path.iterdir())
    # Ctrl-C once the file has its name (the folder's sync after the rename): it is whole, and the line says so
    monkeypatch.undo()
    replace = download.os.replace
    monkeypatch.setattr(download.os, "replace", lambda *a: replace(*a) or (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit, match=rf"^download: interrupted; {re.escape(str(tmp_path / name))} came whole"):
        data.main(argv)
    assert (tmp_path / name).read_bytes() == body
