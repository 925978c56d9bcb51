"""KV files: save, load, continue gives the same greedy tokens as never having stopped (dense, long_context with
every kv_type, DYNAMIC anchors, SnapKV preselection, the hybrid cache of Gemma 3); a file from another model or
config is refused with what differs; truncated and bit-flipped files are refused, and the conversation in the
cache is kept; the command line's --save-kv / --load-kv and /save /load; the server's first slot."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ktquest
from ktquest.kv import files
from ktquest.kv.files import KVFileError
from ktquest.native.store import KVStore

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
DOC = ("The lighthouse keeper wrote in his log every evening. On Monday the ship Aurora passed at dusk; on "
       "Tuesday a storm closed the harbour; on Wednesday the keeper painted the door green. ") * 6
SMALL_LC = {"long_context.block_size": 8, "long_context.init_windows_len": 8, "long_context.local_windows_len": 32,
            "long_context.second_select_num": 4, "chunk_size": 64}
CASES = {  # bundled SmolLM2 (head_dim 64: every kv_type)
    "dense": (None, {}),
    **{f"quest-{t}": (CONFIGS / "quest.yaml", {**SMALL_LC, "long_context.kv_type": t})
       for t in ("FP32", "FP16", "BF16", "Q8_0", "Q4_0")},
    "dynamic": (CONFIGS / "ktransformers.yaml", {**SMALL_LC, "long_context.preselect_block_count": 8,
                                                 "long_context.anchor_type": "DYNAMIC", "long_context.anchor_num": 1,
                                                 "long_context.head_select_mode": "SHARED"}),
    "snapkv": (CONFIGS / "snapkv.yaml", {**SMALL_LC, "long_context.preselect_block_count": 8}),
    "snapkv-refresh": (CONFIGS / "snapkv.yaml", {**SMALL_LC, "long_context.preselect_block_count": 8,
                                                 "long_context.preselect_refresh": 2}),
}


def _load(model, config, sets):
    return ktquest.load(model, config, threads=1, temperature=0.0, max_new_tokens=8, **sets)


@pytest.mark.parametrize("case", list(CASES))
def test_save_load_continue_equals_never_stopping(bundled_gguf, tmp_path, case):
    config, sets = CASES[case]
    a = _load(bundled_gguf, config, sets)
    s = a.chat_session(system="Answer briefly.", document=DOC)
    read = s.read_document()
    assert read.prompt_tokens > 200 and read.new_tokens == 0
    s.save(tmp_path / "doc.kvq")
    first = s.send("What did the keeper paint?")
    s.save(tmp_path / "turn.kvq")
    second = s.send("Which ship passed?")
    b = _load(bundled_gguf, config, sets)
    t = b.load_session(tmp_path / "doc.kvq")  # the document: the first question reads only itself
    r = t.send("What did the keeper paint?")
    assert r.text == first.text and r.stats.prompt_tokens == first.stats.prompt_tokens < 20
    c = _load(bundled_gguf, config, sets)
    u = c.load_session(tmp_path / "turn.kvq")  # after a turn: the conversation goes on as if never stopped
    assert u.messages == s.messages[:3] and u.document == DOC
    r = u.send("Which ship passed?")
    assert r.text == second.text and r.stats.prompt_tokens == second.stats.prompt_tokens


def test_gemma3_hybrid_cache(tiny_gemma3, tmp_path):
    for config, sets in ((None, {}), (CONFIGS / "quest.yaml", {**SMALL_LC, "long_context.kv_type": "FP32",
                                                               "long_context.dense_layer_num": 0})):
        a = ktquest.load(tiny_gemma3.path, config, threads=1, max_new_tokens=6, **sets)
        s = a.chat_session(document="the cat sat on the mat " * 12)
        s.send("hello")
        s.save(tmp_path / "g.kvq")
        want = s.send("and again")
        b = ktquest.load(tiny_gemma3.path, config, threads=1, max_new_tokens=6, **sets)
        got = b.load_session(tmp_path / "g.kvq").send("and again")
        assert got.text == want.text and got.stats.prompt_tokens == want.stats.prompt_tokens
        assert got.stats.prompt_tokens < got.stats.context_tokens - 60  # the document was not read again


def test_store_state_round_trip_and_checks():
    a = KVStore(2, 2, 64, 256, 16, "Q8_0", "QUEST", 2, 1, False, 2)
    k = torch.randn(50, 2, 64)
    for layer in range(2):
        a.append(layer, k, k * 0.5)
    b = KVStore(2, 2, 64, 512, 16, "Q8_0", "QUEST", 2, 1, False, 2)  # max_seq_len may differ
    for layer in range(2):
        b.native.import_layer(layer, 50, a.native.export_layer(layer))
    q = torch.randn(4, 64)
    for layer in range(2):
        assert torch.equal(a.block_scores(layer, q), b.block_scores(layer, q))
        assert torch.equal(a.group_bounds(layer, q), b.group_bounds(layer, q))
        ra, rb = a.select_attend(layer, q, 2), b.select_attend(layer, q, 2)
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))
    state = a.native.export_layer(0)
    with pytest.raises(ValueError, match="bytes given"):
        b.native.import_layer(0, 50, state[:-1].copy())
    with pytest.raises(ValueError, match="max_seq_len"):
        b.native.import_layer(0, 1000, state)
    with pytest.raises(TypeError, match="uint8"):
        b.native.import_layer(0, 50, state.astype(np.int16))
    with pytest.raises(IndexError):
        b.native.import_layer(5, 50, state)
    assert b.length(0) == 50  # a refused import changed nothing


@pytest.fixture
def saved(tiny_llama, tmp_path):
    eng = ktquest.load(tiny_llama.path, threads=1, max_new_tokens=6)
    s = eng.chat_session(document="a b c d " * 20)
    s.send("hello there")
    path = tmp_path / "c.kvq"
    s.save(path)
    return eng, s, path


def test_other_model_or_config_refused(saved, tiny_qwen2, tiny_llama):
    eng, s, path = saved
    with pytest.raises(KVFileError, match="another model"):
        ktquest.load(tiny_qwen2.path, threads=1).load_session(path)
    lc = ktquest.load(tiny_llama.path, threads=1, mode="long_context", **SMALL_LC)
    with pytest.raises(KVFileError, match="mode is 'dense' in the file, 'long_context' here"):
        lc.load_session(path)
    a = ktquest.load(tiny_llama.path, CONFIGS / "quest.yaml", threads=1, **SMALL_LC)
    s2 = a.chat_session()
    s2.send("hi")
    s2.save(path)
    b = ktquest.load(tiny_llama.path, CONFIGS / "quest.yaml", threads=1, **{**SMALL_LC, "long_context.block_size": 4})
    with pytest.raises(KVFileError, match="long_context.block_size is 8 in the file, 4 here"):
        b.load_session(path)
    # a knob that does not shape the cache: loads
    ktquest.load(tiny_llama.path, CONFIGS / "quest.yaml", threads=1,
                 **{**SMALL_LC, "long_context.threads_num": 1}).load_session(path)


def _damaged(path: Path, out: Path, at: int | None = None, size: int | None = None) -> Path:
    data = bytearray(path.read_bytes())
    if at is not None:
        data[at] ^= 0x10
    out.write_bytes(bytes(data[:size]))
    return out


def test_truncated_and_bit_flipped_files_refused(saved, tmp_path):
    eng, s, path = saved
    n = path.stat().st_size
    header, arrays = files.load(path)
    start = n - header["payload_bytes"]
    head = int.from_bytes(path.read_bytes()[8:16], "little")  # after the magic and format
    spots = {"magic": 2, "format": 6, "header length": 9, "header": 40, "header checksum": 16 + head + 1}
    spots |= {f"array {a['name']}": start + a["offset"] + a["bytes"] // 2 for a in header["arrays"][:3]}
    spots["tokens"] = start + next(a for a in header["arrays"] if a["name"] == "tokens")["offset"]
    before = eng.cache.pos
    for what, at in spots.items():
        bad = _damaged(path, tmp_path / "bad.kvq", at=at)
        with pytest.raises(KVFileError, match="not a KV file|corrupted|truncated"):
            eng.load_session(bad)
        assert eng.cache.pos == before and eng.sequence.owner is s, what  # the conversation is kept
    for size in (0, 10, 30, start, n - 1):
        with pytest.raises(KVFileError, match="not a KV file|truncated"):
            eng.load_session(_damaged(path, tmp_path / "bad.kvq", size=size))
    with pytest.raises(KVFileError, match="cannot open"):
        eng.load_session(tmp_path / "missing.kvq")
    r = s.send("and again").stats
    assert r.prompt_tokens < r.context_tokens - 80  # still cached: the document (80 tokens) is not read again


def test_written_atomically(saved, tmp_path, monkeypatch):
    eng, s, path = saved
    good = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        s.save(path)
    assert path.read_bytes() == good and sorted(p.name for p in path.parent.iterdir()) == ["c.kvq"]


def test_cli_save_and_load(tiny_llama, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat " * 12)
    kv = tmp_path / "doc.kvq"

    def chat(*args, stdin=""):
        return subprocess.run([sys.executable, "-m", "ktquest.cli", "chat", "--model", str(tiny_llama.path),
                               "--max-new-tokens", "5", "--temperature", "0", *args], input=stdin,
                              capture_output=True, text=True, env=env, timeout=300)

    r = chat("--prompt-file", str(doc), "--save-kv", str(kv), "--message", "hello")
    assert r.returncode == 0 and kv.is_file() and "saved" in r.stderr, r.stderr
    again = chat("--load-kv", str(kv), "--message", "hello")
    assert again.returncode == 0 and again.stdout == r.stdout
    assert again.stderr.startswith(r.stderr.splitlines()[-1].split(",")[0])  # the same prompt tokens read
    r = chat("--load-kv", str(kv), "--prompt-file", str(doc), "--message", "x")
    assert r.returncode == 2 and "--load-kv" in r.stderr
    r = chat("--load-kv", str(doc), "--message", "x")
    assert r.returncode == 2 and r.stderr.startswith("ktquest: error: ") and "not a KV file" in r.stderr
    second = tmp_path / "s.kvq"
    r = chat(stdin=f"hello\n/save {second}\n/load {tmp_path / 'nope.kvq'}\n/load {second}\n/exit\n")
    assert r.returncode == 0 and second.is_file(), r.stderr
    assert "cannot open the KV file" in r.stdout and "loaded" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_server_worker_starts_from_a_kv_file(bundled_gguf, tmp_path):
    from ktquest.chat import encode_chat
    from ktquest.config import CHAT_GENERATION
    from ktquest.server.worker import Worker

    eng = ktquest.load(bundled_gguf, threads=1, **{**CHAT_GENERATION, "temperature": 0.0, "max_new_tokens": 8})
    s = eng.chat_session(document=DOC)
    s.read_document()
    s.save(tmp_path / "doc.kvq")
    worker = Worker(ktquest.load(bundled_gguf, threads=1, **{**CHAT_GENERATION, "temperature": 0.0}))
    held = worker.load_kv(tmp_path / "doc.kvq")
    tokens = encode_chat(worker.engine, [{"role": "user", "content": f"{DOC}\n\nWhich ship passed?"}])
    r = worker.complete(tokens, dataclasses.replace(worker.engine.config.generation, max_new_tokens=8))
    assert r.cached_tokens == held > 200
    assert r.text == s.send("Which ship passed?").text


@pytest.mark.parametrize("table", [5, [{"name": "x"}], [{"name": "x", "dtype": "float32", "shape": [-1, -1],
                                                       "offset": 0, "bytes": 4, "crc32": 0}],
                                   [{"name": "x", "dtype": "complex", "shape": [1], "offset": 0, "bytes": 4,
                                     "crc32": 0}]])
def test_crafted_headers_refused(tmp_path, table):
    import json
    import struct
    import zlib

    head = json.dumps({"arrays": table, "payload_bytes": 64}).encode()
    data = struct.pack("<6sHQ", files.MAGIC, files.FORMAT, len(head)) + head + struct.pack("<I", zlib.crc32(head))
    (tmp_path / "x.kvq").write_bytes(data + b"\0" * ((-len(data)) % 64 + 64))
    with pytest.raises(KVFileError, match="corrupted"):
        files.load(tmp_path / "x.kvq")


# ---- issue 60: the store's bytes in a KV file are untrusted (the file's checksums can be recomputed) ----


def test_store_bytes_altered_and_checksummed_again_refused(tiny_llama, tmp_path):
    """A file whose store state was altered and saved again with valid checksums: an anchor count past its block
    (the next decode step read out of bounds: SIGBUS) is a KVFileError naming the layer, KV head, block and
    value, checked before the cache is touched: the conversation goes on as it was, and the file as it was saved
    still loads."""
    sets = {**SMALL_LC, "long_context.anchor_type": "FIXED", "long_context.anchor_num": 2,
            "long_context.dense_layer_num": 0}
    eng = ktquest.load(tiny_llama.path, CONFIGS / "quest.yaml", threads=1, max_new_tokens=4, **sets)
    s = eng.chat_session(document="a b c d " * 20)
    s.send("hello")
    path = tmp_path / "c.kvq"
    s.save(path)
    header, arrays = files.load(path)
    n = header["cache"]["pos"]
    off = eng.cache.store.state_regions(n)["n_anchor"][1][0] + 3 * 4  # layer 1's KV head 1, block 3 (selectable)
    bad = arrays["store1"].clone()
    bad[off: off + 4] = torch.tensor([2**31 - 1], dtype=torch.int32).view(torch.uint8)
    files.save(tmp_path / "bad.kvq", {k: v for k, v in header.items() if k not in ("arrays", "payload_bytes")},
               {**arrays, "store1": bad})  # every checksum recomputed
    with pytest.raises(KVFileError, match=r"layer 1, kv head 1, block 3 \(8 tokens\): n_anchor=2147483647"):
        eng.load_session(tmp_path / "bad.kvq")
    held = eng.cache.pos
    assert held > 80 and eng.cache.store.length(0) == held and eng.sequence.owner is s  # untouched
    assert s.send("and now?").stats.prompt_tokens < 80  # goes on from its cache: the document is not read again
    r = eng.load_session(path).send("again").stats
    assert r.prompt_tokens < r.context_tokens - 80  # the file as saved: the document (80 tokens) is not read again


def test_a_file_from_before_a_decode_key_existed_reads_at_its_default():
    """A file written before a long_context key was added (e.g. ``rerank``) was made as that key's default makes
    a cache: its fingerprint gains the key at the default, so it loads under the default and not under another."""
    from ktquest.config import Config, to_dict
    from ktquest.kv.compat import with_later_keys

    now = to_dict(Config())["long_context"]
    now.pop("threads_num")
    old = {"mode": "long_context", "long_context": {k: v for k, v in now.items() if k != "rerank"}}
    assert with_later_keys(old)["long_context"] == now
    assert with_later_keys(old) == {"mode": "long_context", "long_context": now}
    assert with_later_keys(old) != {"mode": "long_context", "long_context": {**now, "rerank": 4}}
    kept = {"mode": "long_context", "long_context": {**now, "rerank": 4}}
    assert with_later_keys(kept) == kept  # a key the file has is its own
    assert with_later_keys({"mode": "dense"}) == {"mode": "dense"} and with_later_keys(None) is None
