"""llama.cpp's KV cache filled without a prefill: a sequence-state file of N cells written directly and
loaded (bench_engines.py's ``llama.cpp-filled``), for decode speed at 32K-256K where llama.cpp's own prefill
would take hours on two cores.

Its dense decode step reads every cached K and V row whatever their values, so the rows are zeros (a score of
0 for every position: no NaN, and nothing for its flash attention to skip, which skips masked positions only).
The layout is not documented: it is read off the state the same context writes after a 16-token prompt
(``llama_state_seq_get_data``), whose parts scale with the tokens as follows (llama-cpp-python 0.3.36's
llama.cpp; ``probe`` checks each size against a second state of 32 tokens and refuses what it cannot account
for)::

    8 bytes             copied as written
    u32 n_stream (1)    u32 cells
    cells x             i32 pos, u32 n_seq (1), i32 seq (0)
    u32 v_trans         u32 n_layer
    n_layer x           i32 k_type, u64 k_row_bytes, cells x k_row_bytes
    n_layer x           v_trans 0: i32 v_type, u64 v_row_bytes, cells x v_row_bytes
                        v_trans 1: i32 v_type, u32 v_elem_bytes, u32 v_dims, v_dims x cells x v_elem_bytes

The file around it (``llama_state_seq_save_file``): u32 magic, u32 version, u32 n_tokens, the token ids
(i32), then the state without its first 8 bytes (which the in-memory state alone has).
"""

from __future__ import annotations

import ctypes
import struct

PROBE = 16


def _seq_state(lc, llm) -> bytes:
    size = lc.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    lc.llama_state_seq_get_data(llm.ctx, buf, size, 0)
    return bytes(buf)


def _parse(state: bytes) -> dict:
    """The layout of a state (module docstring); ValueError where it is not that layout."""
    at = 8
    n_stream, cells = struct.unpack_from("<II", state, at)
    at += 8
    if n_stream != 1:
        raise ValueError(f"llama.cpp state with {n_stream} streams (1 expected)")
    for i in range(cells):
        pos, n_seq, seq = struct.unpack_from("<iIi", state, at + 12 * i)
        if (pos, n_seq, seq) != (i, 1, 0):
            raise ValueError(f"llama.cpp state cell {i}: pos {pos}, {n_seq} sequences, seq {seq}")
    at += 12 * cells
    v_trans, n_layer = struct.unpack_from("<II", state, at)
    at += 8
    k = []
    for _ in range(n_layer):
        k.append(struct.unpack_from("<iQ", state, at))
        at += 12 + cells * k[-1][1]
    v = []
    for _ in range(n_layer):
        if v_trans:
            v.append(struct.unpack_from("<iII", state, at))
            at += 12 + v[-1][2] * cells * v[-1][1]
        else:
            v.append(struct.unpack_from("<iQ", state, at))
            at += 12 + cells * v[-1][1]
    if at != len(state):
        raise ValueError(f"llama.cpp state of {len(state)} bytes, {at} accounted for")
    return dict(prefix=state[:8], v_trans=v_trans, k=k, v=v)


def probe(lc, llm, tokens: list[int]) -> dict:
    """The state layout of ``llm``'s context, from its states after ``PROBE`` and 2 x ``PROBE`` tokens."""
    layouts = []
    for n in (PROBE, 2 * PROBE):
        llm.reset()
        llm.eval(tokens[:n])
        layouts.append(_parse(_seq_state(lc, llm)))
    if layouts[0] != layouts[1]:
        raise ValueError("llama.cpp's state layout changes with the tokens in it: not the one this tool writes")
    return layouts[0]


def write_file(path: str, layout: dict, tokens: list[int], chunk: int = 64 << 20) -> None:
    """A sequence-state file of ``len(tokens)`` cells at positions 0.. with zero K/V rows."""
    n = len(tokens)
    zeros = bytes(chunk)

    def blank(f, size: int) -> None:
        while size > 0:
            f.write(zeros[: min(size, chunk)])
            size -= chunk

    with open(path, "wb") as f:
        f.write(struct.pack("<III", 0x67677371, 3, n))  # "ggsq", the version 0.3.36 writes, tokens
        f.write(struct.pack(f"<{n}i", *tokens))
        f.write(struct.pack("<II", 1, n))  # (the file's state has no 8-byte prefix: the buffer's only)
        f.write(b"".join(struct.pack("<iIi", i, 1, 0) for i in range(n)))
        f.write(struct.pack("<II", layout["v_trans"], len(layout["k"])))
        for k_type, row in layout["k"]:
            f.write(struct.pack("<iQ", k_type, row))
            blank(f, n * row)
        for v in layout["v"]:
            if layout["v_trans"]:
                f.write(struct.pack("<iII", *v))
                blank(f, v[2] * n * v[1])
            else:
                f.write(struct.pack("<iQ", *v))
                blank(f, n * v[1])


def load_file(lc, llm, path: str, tokens: list[int]) -> None:
    """Load ``path`` into ``llm``'s sequence 0; ``llm`` then continues at position len(tokens)."""
    n = len(tokens)
    out = (lc.llama_token * n)()
    count = ctypes.c_size_t(0)
    read = lc.llama_state_seq_load_file(llm.ctx, path.encode(), 0, out, n, ctypes.byref(count))
    if read == 0 or count.value != n:
        raise RuntimeError(f"llama.cpp did not load {path} ({read} bytes, {count.value} tokens of {n})")
    llm.input_ids[:n] = tokens
    llm.n_tokens = n
