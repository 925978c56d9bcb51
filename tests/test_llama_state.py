"""tools/llama_state.py (bench_engines' llama.cpp-filled): a sequence-state file written for N cells has the
layout its probe read, in both of llama.cpp's V layouts, with M-RoPE's longer cell records and a hybrid model's
recurrent memory after the attention layers; a state it cannot account for is refused. (llama.cpp
itself is not a test dependency: the states here are built by hand in the layout the module documents.)"""

from __future__ import annotations

import struct

import pytest
from test_make_shaped_gguf import _tool


@pytest.fixture(scope="module")
def ls():
    return _tool("llama_state")


TOKENS = list(range(100, 1100))


def _state(cells: int, v_trans: int, layers: int = 3, mrope: bool = False, recurrent: bytes = b"") -> bytes:
    """A state in the documented layout: K rows of 68 bytes, V rows of 68 (or 64 dims of 1 byte, transposed);
    ``mrope``: cell records (pos, 1, pos, pos, token, 0); ``recurrent``: a hybrid's recurrent memory after it
    (one cell at the last position, then these bytes)."""
    out = [b"\xd8\x3c\x14\xaf\0\0\0\0", struct.pack("<II", 1, cells)]
    out += [struct.pack("<6i", i, 1, i, i, TOKENS[i], 0) if mrope else struct.pack("<iIi", i, 1, 0)
            for i in range(cells)]
    out.append(struct.pack("<II", v_trans, layers))
    for i in range(layers):
        out.append(struct.pack("<iQ", 8, 68) + bytes([i + 1]) * (68 * cells))
    for i in range(layers):
        if v_trans:
            out.append(struct.pack("<iII", 1, 1, 64) + bytes(64 * cells))
        else:
            out.append(struct.pack("<iQ", 8, 68) + bytes(68 * cells))
    if recurrent:
        out.append(struct.pack("<IiI", 1, cells - 1, 0) + recurrent)
    return b"".join(out)


@pytest.mark.parametrize("v_trans,mrope,recurrent", [(0, False, b""), (1, False, b""), (1, True, b"\x07" * 40)])
def test_a_written_file_has_the_probed_layout(ls, tmp_path, v_trans, mrope, recurrent):
    layout = ls._parse(_state(16, v_trans, mrope=mrope, recurrent=recurrent), TOKENS)
    tail = {"tail", "tail_bytes"}
    later = ls._parse(_state(32, v_trans, mrope=mrope, recurrent=recurrent), TOKENS)
    assert {k: v for k, v in layout.items() if k not in tail} == {k: v for k, v in later.items() if k not in tail}
    assert layout["v_trans"] == v_trans and len(layout["cell"]) == (6 if mrope else 3)
    tokens = TOKENS
    path = tmp_path / "seq.bin"
    ls.write_file(str(path), layout, tokens, chunk=4096)
    data = path.read_bytes()
    magic, version, n = struct.unpack_from("<III", data)
    assert (magic, version, n) == (0x67677371, 3, 1000)
    assert list(struct.unpack_from("<1000i", data, 12)) == tokens
    state = layout["prefix"] + data[12 + 4 * 1000:]  # (the file's state lacks the buffer's 8-byte prefix)
    got = ls._parse(state, tokens)  # every cell at its position in sequence 0, every row's bytes there
    assert {k: v for k, v in got.items() if k not in tail} == {k: v for k, v in layout.items() if k not in tail}
    if recurrent:  # the recurrent cell moved to the file's last token, its states copied
        assert got["tail"] == struct.pack("<IiI", 1, 999, 0) + recurrent
    else:
        assert got["tail"] == b""
        assert state.count(b"\0") >= len(state) - 12 * 1000 - 200  # the rows are zeros


def test_a_state_it_cannot_account_for_is_refused(ls):
    good = _state(4, 0)
    with pytest.raises(ValueError, match="accounted for"):
        ls._parse(good + b"\0", TOKENS)
    with pytest.raises(ValueError, match="accounted for"):  # more than the K/V, and not one recurrent cell
        ls._parse(good + struct.pack("<IiI", 2, 3, 0) + b"\0" * 8, TOKENS)
    with pytest.raises(ValueError, match="streams"):
        ls._parse(good[:8] + struct.pack("<I", 2) + good[12:], TOKENS)
    with pytest.raises(ValueError, match="cells whose records"):
        ls._parse(good[:16 + 12] + struct.pack("<iIi", 7, 1, 0) + good[16 + 24:], TOKENS)
