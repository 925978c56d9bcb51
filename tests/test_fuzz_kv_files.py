"""Fuzzing KV files (issue 60), the part of ``test_fuzz_inputs.py``'s fuzzing of the Python inputs that reads
files a chat saved: structure-aware mutations of a real KV file of the tiny llama (a dense cache, a long_context
cache with SnapKV's candidates, a sliding-window model's hybrid cache), each written with its checksums
recomputed so that it reaches the parsers behind them:

- the JSON header: a value anywhere replaced (wrong types, integers and floats at their edges, 1e999, NaN, a huge
  shape), removed or joined by another, or nested 10**5 deep, numbers of 5000 digits, text that is not UTF-8;
- the table of arrays: entries overlapping, out of range, resized, reshaped, renamed, retyped, dropped, doubled;
- the arrays' bytes (a NaN, an id out of range, a count past its block, noise), their checksum recomputed;
- the file: cut short, grown.

The contract: ``Engine.load_session`` of each case loads, or raises ``KVFileError`` with one line naming the file,
and then the conversation is the one held before (its cache too, but where the store refused its bytes as they
were imported: then empty); either way the engine answers the next message. Each kind runs in a child process
(python this_file.py KIND N MODEL DIR): a signal kills the child, not pytest, and the parent fails with the case
the child announced last. A fixed seed: the same few hundred cases every run, in seconds.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KINDS = {"dense": ("llama", 120), "long_context": ("llama", 120), "hybrid": ("gemma3", 60)}
TIMEOUT_S = 120
CHILD_BYTES = 4 << 30  # address space of a child: torch's imports need ~2 GiB of it; a case may not add much


@pytest.mark.parametrize("kind", list(KINDS))
def test_kv_files_load_or_refuse(tiny_models, tmp_path, kind):
    import resource

    model, n = KINDS[kind]
    n = max(1, round(n * float(os.environ.get("KTQ_FUZZ_SCALE", "1"))))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        r = subprocess.run([sys.executable, __file__, kind, str(n), str(tiny_models(model).path), str(tmp_path)],
                           capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (CHILD_BYTES, CHILD_BYTES)))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{kind}: no result after {TIMEOUT_S} s (a hang?); last output:\n{(e.stderr or '')[-3000:]}")
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
        pytest.fail(f"{kind}: the child ended with {how}; last output:\n{r.stderr[-6000:]}")
    counts = json.loads(r.stdout.rsplit(f"fuzz kv {kind}: ", 1)[1])
    assert counts["refused"] > n // 3 and counts["loaded"] > 0, counts  # the cases reach both ends


# ---- the mutations ----

DEEP = "\x00deep\x00"  # a value the header's JSON text then replaces by raw text (``_RAW``)
_RAW = {"deep": "[" * 100_000 + "]" * 100_000, "deep32": "[" * 32 + "]" * 32, "1e999": "1e999", "-1e999": "-1e999",
        "digits": "9" * 5000, "NaN": "NaN", "surrogate": '"\\ud800"', "deep_obj": '{"a":' * 2000 + "1" + "}" * 2000}
VALUES = [None, True, False, 0, -1, 1, 2, 7, 8, 63, 64, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1,
          2**63, 2**64, 2**70, -(2**63), 0.5, -0.0, 1e308, float("inf"), float("-inf"), float("nan"), "", "x",
          "float32", "int64", "dense", [], {}, [0], [2**70], [-1], [1, 2, 3], {"a": 1}, [[[]]], ["k0"]]
BYTES = [b"\xff\xff\xff\xff", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80",
         b"\x00\x7e", b"\x00\x00", b"\x01\x00\x00\x00", b"\x40\x00\x00\x00"]


def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[8:16])[0]
    start = -(-(16 + n + 4) // 64) * 64
    return json.loads(data[16: 16 + n]), data[start:]


def _assemble(header: object, payload: bytes, raw: str | None = None) -> bytes:
    """A KV file of ``header`` (its checksum recomputed; ``raw``: the text that stands for DEEP) and ``payload``."""
    head = json.dumps(header)
    if raw is not None:
        head = head.replace(json.dumps(DEEP), raw)
    head = head.encode("utf-8", "surrogatepass")
    pad = -(16 + len(head) + 4) % 64
    return struct.pack("<6sHQ", b"KTQKV\0", 1, len(head)) + head + struct.pack("<I", zlib.crc32(head)) + \
        b"\0" * pad + payload


def _nodes(header: dict) -> list[tuple[object, object]]:
    """Every (container, key) of the header (the table's entries and the chat's messages included)."""
    out, todo = [], [header]
    while todo:
        c = todo.pop()
        for k in (list(c) if isinstance(c, dict) else range(len(c))):
            out.append((c, k))
            if isinstance(c[k], (dict, list)):
                todo.append(c[k])
    return out


def _mutate(rng: random.Random, header: dict, payload: bytearray) -> tuple[str, object, str | None, bytes | None]:
    """One mutation: (what it is, the header, the raw text for DEEP, the file's bytes if it replaces them)."""
    table = header["arrays"]
    how = rng.choices(["value", "table", "bytes", "file", "raw", "utf8"], [45, 20, 25, 4, 5, 1])[0]
    if how == "value":
        c, k = rng.choice(_nodes(header))
        v, op = c[k], rng.choice(["set", "set", "set", "edge", "drop", "add"])
        if op == "edge" and type(v) is int:
            c[k] = rng.choice([v - 1, v + 1, 2 * v, -v, v + 2**32, float(v), str(v)])
        elif op == "drop":
            del c[k]
        elif op == "add" and isinstance(v, (dict, list)):
            v.update(zz=rng.choice(VALUES)) if isinstance(v, dict) else v.append(copy.deepcopy(v[-1]) if v else 1)
        else:
            c[k] = copy.deepcopy(rng.choice(VALUES))
        return f"{op} {k!r} (was {json.dumps(v)[:60]})", header, None, None
    if how == "raw":
        c, k = rng.choice(_nodes(header))
        name = rng.choice(sorted(_RAW))
        c[k] = DEEP
        return f"{k!r} = raw {name}", header, _RAW[name], None
    if how == "table":
        i = rng.randrange(len(table))
        a, op = table[i], rng.choice(["overlap", "outside", "bytes", "shape", "dtype", "name", "drop", "double", "crc"])
        other = table[rng.randrange(len(table))]
        if op == "overlap":
            a["offset"] = other["offset"]
        elif op == "outside":
            a["offset"] = rng.choice([len(payload), len(payload) + 64, 2**63, -64, a["offset"] + 1])
        elif op == "bytes":
            a["bytes"] += rng.choice([-4, -1, 1, 64, 2**40])
        elif op == "shape":
            a["shape"] = rng.choice([a["shape"][::-1], [*a["shape"], 1], [2**70], [0], [], a["shape"][:-1],
                                     [d + 1 for d in a["shape"]], [0, 2**40, 2**40]])
        elif op == "dtype":
            a["dtype"] = rng.choice(["float32", "float16", "bfloat16", "uint8", "int32", "int64", "complex64", 5])
        elif op == "name":
            a["name"] = rng.choice([other["name"], "zz", ["k0"], 7, ""])
        elif op == "drop":
            del table[i]
        elif op == "double":
            table.insert(i, copy.deepcopy(a))
        else:
            a["crc32"] = rng.choice([a["crc32"] ^ 1, -1, 2**32, 2**64])
        return f"table {op} of {a.get('name')!r}", header, None, None
    if how == "bytes":  # the bytes of an array, its checksum recomputed: what the caches then read
        a = rng.choice([a for a in table if a["bytes"]])
        for _ in range(rng.randint(1, 8)):
            pattern = rng.choice(BYTES) if rng.random() < 0.7 else bytes(rng.randrange(256) for _ in range(4))
            at = a["offset"] + rng.randrange(a["bytes"])
            end = min(at + len(pattern), a["offset"] + a["bytes"])
            payload[at:end] = pattern[: end - at]
        a["crc32"] = zlib.crc32(payload[a["offset"]: a["offset"] + a["bytes"]])
        return f"bytes of {a['name']} ({a['dtype']} {a['shape']})", header, None, None
    data = _assemble(header, bytes(payload))
    if how == "utf8":
        return "header not UTF-8", None, None, data.replace(b'"dense"', b'"\xff\xfe"')
    if rng.random() < 0.2:
        return "file grown", None, None, data + b"\0" * rng.choice([1, 64])
    cut = rng.choice([0, 7, 16, 20, len(data) - len(payload), len(data) - 1, rng.randrange(len(data))])
    return f"file cut to {cut}", None, None, data[:cut]


# ---- the child: one kind of cache, n cases ----

SETS = {
    "dense": {},
    "long_context": {"mode": "long_context", "long_context.block_size": 8, "long_context.init_windows_len": 8,
                     "long_context.local_windows_len": 32, "long_context.second_select_num": 4,
                     "long_context.preselect_block": True, "long_context.preselect_block_count": 4, "chunk_size": 32},
    "hybrid": {},
}


def _child(kind: str, n: int, model: str, workdir: str) -> None:
    import resource

    import ktquest
    from ktquest.kv.files import KVFileError

    eng = ktquest.load(model, threads=1, temperature=0.0, max_new_tokens=2, **SETS[kind])
    s = eng.chat_session(system="Be brief.", document="the cat sat on the mat. " * 6)
    s.send("hello there")
    base = Path(workdir) / "base.kvq"
    s.save(base)
    header, payload = _split(base.read_bytes())
    rng, counts = random.Random(f"issue-60 {kind}"), {"loaded": 0, "refused": 0, "emptied": 0,
                                                       "loaded, its answer refused": 0}
    path = Path(workdir) / "case.kvq"
    for i in range(n):
        changed = bytearray(payload)
        what, h, raw, data = _mutate(rng, copy.deepcopy(header), changed)
        path.write_bytes(data if data is not None else _assemble(h, bytes(changed), raw))
        print(f"case {i}: {what}", file=sys.stderr, flush=True)
        held = eng.load_session(base)
        before = (eng.cache.pos, eng.sequence.ids)
        try:
            session = eng.load_session(path)
            counts["loaded"] += 1
        except KVFileError as e:
            msg, session = str(e), held
            assert str(path) in msg and "\n" not in msg and len(msg) < 1000, msg
            kept = eng.sequence.owner is held and (eng.cache.pos, eng.sequence.ids) == before
            assert kept or ("store state is refused" in msg and eng.cache.pos == 0), (msg, eng.cache.pos)
            counts["refused" if kept else "emptied"] += 1
        try:
            assert isinstance(session.send("ok").text, str)
        except ValueError as e:  # a file that loaded with values no model makes (keys of 1e38: the logits overflow)
            assert session is not held and str(e) and "\n" not in str(e), e
            print(f"  its answer refused: {e}", file=sys.stderr, flush=True)
            counts["loaded, its answer refused"] += 1
            assert isinstance(eng.chat_session().send("ok").text, str)  # and the engine answers on
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"fuzz kv {kind}: {json.dumps(counts)}", flush=True)
    print(f"peak RSS {rss} MiB", file=sys.stderr)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
