"""Config schema: defaults, configs/default.yaml, --set overrides, and errors that name file, key, value, allowed."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from ktquest.config import Config, ConfigError, load_config

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def _keys(cls: type, prefix: str = "") -> set[str]:
    """Every leaf key of the schema, dotted."""
    out = set()
    for name, tp in typing.get_type_hints(cls).items():
        out |= _keys(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else {prefix + name}
    return out


def _flatten(d: dict, prefix: str = "") -> set[str]:
    return set().union(*(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
                         for k, v in d.items()))


def test_defaults():
    assert load_config() == Config()
    assert load_config(None, []) == Config()


def test_default_yaml_equals_defaults():
    assert load_config(DEFAULT_YAML) == Config()


def test_default_yaml_lists_every_key_with_a_comment():
    assert _flatten(yaml.safe_load(DEFAULT_YAML.read_text())) == _keys(Config)
    for line in DEFAULT_YAML.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert " # " in line, f"no comment on: {line!r}"


def test_empty_file_is_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == Config()


def test_file_values(tmp_path):
    cfg = load_config(_write(tmp_path, "threads: 2\ngeneration:\n  temperature: 1\nlong_context:\n"
                                       "  anchor_type: block_max\n"))
    assert cfg.threads == 2
    assert cfg.generation.temperature == 1.0 and isinstance(cfg.generation.temperature, float)
    assert cfg.long_context.anchor_type == "BLOCK_MAX"  # enum names are case-insensitive


def test_unknown_key(tmp_path):
    p = _write(tmp_path, "generation:\n  max_tokens: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "generation.max_tokens" in msg and "max_new_tokens" in msg


def test_wrong_type(tmp_path):
    p = _write(tmp_path, "chunk_size: lots\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert all(s in str(e.value) for s in (str(p), "chunk_size", "'lots'", "int"))
    with pytest.raises(ConfigError, match=r"threads=True .*int"):
        load_config(_write(tmp_path, "threads: true\n"))  # a bool is not an int


def test_bad_enum(tmp_path):
    p = _write(tmp_path, "device: tpu\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert all(s in str(e.value) for s in (str(p), "device", "'tpu'", "'cpu'", "'cuda'"))


@pytest.mark.parametrize("text, key, value, allowed", [
    ("chunk_size: 0", "chunk_size", "0", ">= 1"),
    ("generation:\n  top_p: 1.5", "generation.top_p", "1.5", "(0, 1]"),
    ("generation:\n  temperature: -1", "generation.temperature", "-1.0", ">= 0"),
    ("long_context:\n  anchor_num: 3", "long_context.anchor_num", "3", "exactly 2"),
    ("long_context:\n  preselect_pool_kernel: 4", "long_context.preselect_pool_kernel", "4", "odd"),
    ("mode: long_context\nmax_seq_len: 100", "long_context.local_windows_len", "1024", "<= max_seq_len (100)"),
    ("long_context:\n  int8_candidates: true", "long_context.int8_candidates", "True", "unless preselect_block"),
    ("long_context:\n  int8_candidates: true\n  preselect_block: true\n  anchor_type: DYNAMIC\n  anchor_num: 1",
     "long_context.int8_candidates", "True", "anchor_type DYNAMIC"),
])
def test_out_of_range(tmp_path, text, key, value, allowed):
    p = _write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and f"{key}={value}" in msg and allowed in msg


def test_bad_yaml(tmp_path):
    p = _write(tmp_path, "threads: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_config(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("text, where", [("- 1\n- 2\n", "top level"), ("just a string\n", "top level"),
                                         ("generation: 3\n", "generation")])
def test_not_a_mapping(tmp_path, text, where):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError, match="mapping") as e:
        load_config(p)
    assert str(p) in str(e.value) and where in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_set_dotted_and_short_keys(tmp_path):
    cfg = load_config(None, ["generation.temperature=0.7", "block_size=32", "threads=2", "anchor_type=quest",
                             "seed=5", "model=/x/y.gguf"])
    assert cfg.generation.temperature == 0.7 and cfg.long_context.block_size == 32 and cfg.threads == 2
    assert cfg.long_context.anchor_type == "QUEST" and cfg.generation.seed == 5 and cfg.model == "/x/y.gguf"
    # --set wins over the file, and the rest of the file is kept
    p = _write(tmp_path, "threads: 1\nchunk_size: 64\n")
    cfg = load_config(p, ["threads=3"])
    assert (cfg.threads, cfg.chunk_size) == (3, 64)


@pytest.mark.parametrize("item, match", [
    ("threads", "expected key=value"),
    ("=3", "empty key"),
    ("threads.x=1", r"threads=\{'x': 1\} has the wrong type"),
    ("nonsense=1", "unknown key 'nonsense'"),
    ("generation.max_new_tokens=0", r"generation.max_new_tokens=0 .*>= 1"),
    ("temperature=hot", r"generation.temperature='hot' .*float"),
])
def test_set_errors(item, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [item])
    assert "--set" in str(e.value)


def test_set_into_a_value_from_the_file(tmp_path):
    with pytest.raises(ConfigError, match="'threads' is not a section"):
        load_config(_write(tmp_path, "threads: 1\n"), ["threads.x=1"])
