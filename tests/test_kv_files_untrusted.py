"""KV files as untrusted input and as a place to write (issue 60): a file rewritten while it is read is an error,
never a crash; a save never lands on the model file, the config file or anything but a new path, an empty
file or a KV file; a crafted header or a FIFO is one ``KVFileError`` and a failed /load leaves the conversation
as it was; Ctrl-C stops /save and /load; the fingerprint holds the RoPE actually applied (dynamic NTK and LongRoPE
at another max_seq_len) and the other settings that change the stored keys."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

import ktquest
from ktquest.kv import files
from ktquest.kv.files import KVFileError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
SMALL_LC = {"long_context.block_size": 8, "long_context.init_windows_len": 8, "long_context.local_windows_len": 32,
            "long_context.second_select_num": 4, "chunk_size": 64}


@pytest.fixture
def saved(tiny_llama, tmp_path):
    """An engine in the middle of a conversation about a document, and the KV file of it."""
    eng = ktquest.load(tiny_llama.path, threads=1, max_new_tokens=4)
    s = eng.chat_session(document="a b c d " * 20)
    s.send("hello there")
    path = tmp_path / "c.kvq"
    s.save(path)
    return eng, s, path


def rewrite(path: Path, out: Path, change) -> Path:
    """``path`` with ``change(header)`` applied to its header (changed in place: None returned; or a new JSON
    value, or the header's bytes) and its checksum recomputed, written to ``out``: the change reaches the
    parsers."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[8:16])[0]
    header = json.loads(data[16: 16 + n])
    start = -(-(16 + n + 4) // files.ALIGN) * files.ALIGN
    payload = data[start:]
    new = change(header)
    header = header if new is None else new
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    new_start = -(-(16 + len(head) + 4) // files.ALIGN) * files.ALIGN
    out.write_bytes(struct.pack("<6sHQ", files.MAGIC, files.FORMAT, len(head)) + head +
                    struct.pack("<I", zlib.crc32(head)) + b"\0" * (new_start - 16 - len(head) - 4) + payload)
    return out


# ---- a file changed while it is read (it was memory-mapped: SIGBUS) ----

_SHRINK = """
import os, sys, zlib
from ktquest.kv import files
path, keep = sys.argv[1], int(sys.argv[2])
real, calls = zlib.crc32, []
def crc32(data, *rest):  # the header's checksum, then the arrays': the file shrinks before the first array's
    calls.append(1)
    if len(calls) == 2:
        os.truncate(path, keep)
    return real(data, *rest)
files.zlib = type("zlib", (), {"crc32": staticmethod(crc32)})
try:
    files.load(path)
    print("loaded")
except files.KVFileError as e:
    print("KVFileError:", e)
"""

_REWRITE = """
import os, sys, threading, time
from ktquest.kv import files
path = sys.argv[1]
data = open(path, "rb").read()
stop = []
def rewrite():  # cp over it, again and again: the same inode, truncated then written
    while not stop:
        with open(path, "r+b") as f:
            f.truncate(len(data) // 3)
            f.write(data)
        time.sleep(0.001)
threading.Thread(target=rewrite, daemon=True).start()
outcomes, t0 = {}, time.monotonic()
while time.monotonic() - t0 < 3:
    try:
        files.load(path)
        outcomes["loaded"] = outcomes.get("loaded", 0) + 1
    except files.KVFileError as e:
        outcomes[str(e).split(": ", 1)[1][:30]] = outcomes.get(str(e).split(": ", 1)[1][:30], 0) + 1
stop.append(1)
print(outcomes)
"""


def test_file_truncated_while_read_is_an_error(saved, tmp_path):
    _, _, path = saved
    header, _ = files.load(path)
    start = path.stat().st_size - header["payload_bytes"]
    r = subprocess.run([sys.executable, "-c", _SHRINK, str(path), str(start)], capture_output=True, text=True,
                       env=ENV, timeout=120, check=False)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # -7: SIGBUS
    assert r.stdout.startswith("KVFileError:") and "changed while it was read" in r.stdout, r.stdout


def test_file_rewritten_in_place_while_read(saved, tmp_path):
    """Loads racing a `cp` over the file: each one loads or is a KVFileError, the process never dies."""
    _, s, _ = saved
    big = tmp_path / "big.kvq"
    s.send("and a second question")  # more arrays' bytes: a wider window to race
    s.save(big)
    r = subprocess.run([sys.executable, "-c", _REWRITE, str(big)], capture_output=True, text=True, env=ENV,
                       timeout=120, check=False)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "'loaded'" in r.stdout, r.stdout  # (and KVFileErrors: "truncated", "changed while it was read", ...)


# ---- where a KV file is written ----


def test_save_refuses_the_model_and_config_files(tiny_llama, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_llama.path.read_bytes())
    config = tmp_path / "c.yaml"
    config.write_text("threads: 1\nmax_seq_len: 256\n")
    eng = ktquest.load(model, config, max_new_tokens=3)
    s = eng.chat_session()
    s.send("hello")
    (tmp_path / "d").mkdir()
    os.symlink(model, tmp_path / "link.gguf")
    os.link(model, tmp_path / "hard.gguf")
    os.symlink(tmp_path, tmp_path / "d" / "up")  # a symlink along the way: d/up/m.gguf is the model
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "notes.txt").write_text("my notes")
    before = {p: p.read_bytes() for p in (model, config, tmp_path / "notes.txt")}
    refused = {model: "is the model file", config: "is the config file", tmp_path / "link.gguf": "symbolic link",
               tmp_path / "hard.gguf": "is the model file .*through a link", tmp_path / "d" / "up" / "m.gguf":
               "is the model file", tmp_path / "d": "is a directory", tmp_path / "fifo": "is a FIFO",
               tmp_path / "sock": "is a socket", tmp_path / "notes.txt": "exists and is not a KV file"}
    if os.path.exists("/dev/null"):
        refused[Path("/dev/null")] = "is a character device"
    for path, why in refused.items():
        with pytest.raises(KVFileError, match=why):
            s.save(path)
    sock.close()
    assert {p: p.read_bytes() for p in before} == before
    assert not list(tmp_path.glob(".*.tmp")) and not os.path.isfile("/dev/null")
    assert ktquest.load(model, config).generate("the cat", max_new_tokens=2)  # the model still loads
    (tmp_path / "empty.kvq").touch()
    for ok in (tmp_path / "new.kvq", tmp_path / "new.kvq", tmp_path / "empty.kvq"):  # new, a KV file, empty
        assert s.save(ok) == ok.stat().st_size


def test_cli_save_kv_refusals(tiny_llama, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_llama.path.read_bytes())
    config = tmp_path / "c.yaml"
    config.write_text("threads: 1\n")
    good = tmp_path / "ok.kvq"
    stdin = (f"hello\n/save {model}\n/save {config}\n/save {tmp_path}\n/load {tmp_path}\n/load {tmp_path / 'fifo'}\n"
             f"/load /dev/zero\n/save {good}\nagain\n/exit\n")
    os.mkfifo(tmp_path / "fifo")
    base = [sys.executable, "-m", "ktquest.cli", "chat", "--model", str(model), "--config", str(config),
            "--max-new-tokens", "3", "--temperature", "0"]
    r = subprocess.run(base + ["--save-kv", str(config), "--message", "hi"], capture_output=True, text=True, env=ENV,
                       timeout=300, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("ktquest: error: "), r.stderr
    assert "is the config file" in r.stderr and "prompt tokens" not in r.stderr  # refused before the answer
    r = subprocess.run(base, input=stdin, capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    for why in ("is the model file", "is the config file", "is a directory", "is a FIFO", "is a character device"):
        assert why in r.stdout, (why, r.stdout)
    assert good.is_file() and files.load(good)[0]["extra"]["chat"]["messages"][-1]["role"] == "assistant"
    assert model.read_bytes() == tiny_llama.path.read_bytes() and config.read_text() == "threads: 1\n"


# ---- crafted headers, FIFOs: one KVFileError, the conversation kept ----

DEEP = "[" * 100_000 + "]" * 100_000
CRAFTED = {
    "not an object": lambda h: [h],
    "deep JSON": lambda h: ('{"arrays": ' + DEEP + "}").encode(),
    "deep extra": lambda h: json.loads(json.dumps(h)) | {"extra": json.loads("[" * 200 + "]" * 200)},
    "list as array name": lambda h: h["arrays"][0].update(name=["k0"]),
    "huge shape": lambda h: h["arrays"][0].update(shape=[2**70]),
    "huge zero shape": lambda h: h["arrays"][0].update(shape=[0, 2**40, 2**40], bytes=0),
    "inf payload": lambda h: h.update(payload_bytes=float("inf")),
    "string offset": lambda h: h["arrays"][1].update(offset="64"),
    "overlapping arrays": lambda h: h["arrays"][1].update(offset=h["arrays"][0]["offset"]),
    "duplicate name": lambda h: h["arrays"][1].update(name=h["arrays"][0]["name"]),
    "table a dict": lambda h: h.update(arrays={"k0": 1}),
    "model a list": lambda h: h.update(model=[1, 2]),
    "config wrong": lambda h: h.update(config={"mode": ["dense"]}),
    "config deep": lambda h: h["config"].update(dtype={"a": {"b": {"c": [[[1e999]]]}}}),
    "cache a string": lambda h: h.update(cache="pos"),
    "pos a float": lambda h: h["cache"].update(pos=1e999),
    "pos huge": lambda h: h["cache"].update(pos=2**70),
    "extra a list": lambda h: h.update(extra=[1]),
    "chat a list": lambda h: h["extra"].update(chat=[]),
    "messages wrong": lambda h: h["extra"]["chat"].update(messages=[{"role": 1, "content": None}]),
    "document a number": lambda h: h["extra"]["chat"].update(document=1e999),
    "no chat": lambda h: h["extra"].__delitem__("chat"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_header_is_one_error_and_the_conversation_stays(saved, tmp_path, bounded_process, case):
    eng, s, path = saved
    bad = rewrite(path, tmp_path / "bad.kvq", CRAFTED[case])
    held, ids = eng.cache.pos, eng.sequence.ids
    with bounded_process(10.0), pytest.raises(KVFileError) as e:
        eng.load_session(bad)
    msg = str(e.value)
    assert str(bad) in msg and "\n" not in msg and len(msg) < 1000
    assert (eng.sequence.owner, eng.cache.pos, eng.sequence.ids) == (s, held, ids)  # nothing changed
    r = s.send("and again").stats
    assert r.prompt_tokens < r.context_tokens - 60  # still cached: the document is not read again


def test_not_regular_files_refused_without_blocking(saved, tmp_path, bounded_process):
    eng, s, _ = saved
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", tmp_path / "to_fifo")
    paths = {tmp_path / "fifo": "is a FIFO", tmp_path / "to_fifo": "is a FIFO", tmp_path: "is a directory"}
    if os.path.exists("/dev/zero"):
        paths[Path("/dev/zero")] = "is a character device"
    for p, why in paths.items():
        with bounded_process(5.0), pytest.raises(KVFileError, match=why):
            eng.load_session(p)
    assert eng.sequence.owner is s


def test_non_finite_values_refused(saved, tmp_path):
    eng, _, path = saved
    header, arrays = files.load(path)
    arrays["k1"][0, 0, 0] = float("nan")
    files.save(tmp_path / "nan.kvq", {k: v for k, v in header.items() if k not in ("arrays", "payload_bytes")},
               arrays)
    with pytest.raises(KVFileError, match="array k1 holds values that are not finite"):
        eng.load_session(tmp_path / "nan.kvq")


# ---- Ctrl-C during /save and /load ----

_SLOW = """
import sys, time
from ktquest.kv import files
real_load, real_save = files.load, files.save
def slow(what, real):
    def f(*args, **kwargs):
        print(what, flush=True, file=sys.stderr)
        time.sleep(60)
        return real(*args, **kwargs)
    return f
files.load, files.save = slow("LOADING", real_load), slow("SAVING", real_save)
from ktquest.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_stops_save_and_load(saved, tiny_llama, tmp_path):
    _, _, path = saved
    p = subprocess.Popen([sys.executable, "-c", _SLOW, "chat", "--model", str(tiny_llama.path), "--max-new-tokens",
                          "3", "--temperature", "0", "--set", "threads=1"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        p.stdin.write(f"hello there, how are you today\n/save {tmp_path / 'x.kvq'}\n")
        p.stdin.flush()
        for what, then in (("SAVING", f"/load {path}\n"), ("LOADING", "ok\n/exit\n")):
            t0 = time.monotonic()
            while what not in p.stderr.readline():
                assert time.monotonic() - t0 < 120 and p.poll() is None
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
            p.stdin.write(then)
            p.stdin.flush()
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0 and "Traceback" not in out + err, out + err
    assert out.count("interrupted: ") == 2 and not (tmp_path / "x.kvq").exists(), out
    assert not list(tmp_path.glob(".*.tmp"))
    first, second = [line for line in out.splitlines() if "prompt tokens" in line]
    held = int(first.split("context ")[1].split("/")[0])
    assert int(second.split()[0]) < held, out  # the conversation was kept: the message read only itself


# ---- the fingerprint: what changes the stored keys ----


@pytest.mark.parametrize("model, a, b, why", [
    ("llama", {"rope_scaling": "dynamic", "rope_scaling_factor": 2.0, "max_seq_len": 512},
     {"rope_scaling": "dynamic", "rope_scaling_factor": 2.0, "max_seq_len": 1024}, "rope is .* other RoPE"),
    ("llama_longrope", {"max_seq_len": 64}, {"max_seq_len": 256}, "rope is .* other RoPE"),
    ("llama", {"mode": "long_context", **SMALL_LC}, {"mode": "long_context", "prefill.mode": "sparse", **SMALL_LC},
     "prefill.mode is 'exact' in the file, 'sparse' here"),
    ("llama", {"activations": "int16"}, {"activations": "int8"}, "activations is 'int16' in the file, 'int8' here"),
])
def test_settings_that_change_the_keys_refused(tiny_models, tmp_path, model, a, b, why):
    path = tiny_models(model).path
    eng = ktquest.load(path, threads=1, max_new_tokens=2, **a)
    s = eng.chat_session()
    s.send("the cat sat on the mat")
    s.save(tmp_path / "a.kvq")
    with pytest.raises(KVFileError, match=why):
        ktquest.load(path, threads=1, **b).load_session(tmp_path / "a.kvq")
    ktquest.load(path, threads=1, **a).load_session(tmp_path / "a.kvq")  # the same settings: loads


def test_max_seq_len_that_leaves_the_keys_alone_loads(tiny_llama, tmp_path):
    """Dynamic NTK below the trained context (256) changes nothing: another max_seq_len there loads."""
    sets = {"rope_scaling": "dynamic", "rope_scaling_factor": 2.0}
    s = ktquest.load(tiny_llama.path, threads=1, max_new_tokens=2, max_seq_len=128, **sets).chat_session()
    s.send("the cat")
    s.save(tmp_path / "a.kvq")
    ktquest.load(tiny_llama.path, threads=1, max_seq_len=256, **sets).load_session(tmp_path / "a.kvq")


def test_load_of_a_file_without_a_conversation_keeps_the_conversation(saved, tmp_path):
    eng, s, _ = saved
    other = ktquest.load(eng.model_path, threads=1, max_new_tokens=4)
    other.chat_session().send("hi")
    other.save_kv(tmp_path / "raw.kvq")  # a cache, no conversation
    held = eng.cache.pos
    with pytest.raises(KVFileError, match="no conversation"):
        eng.load_session(tmp_path / "raw.kvq")
    assert (eng.sequence.owner, eng.cache.pos) == (s, held)
