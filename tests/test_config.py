"""Config schema: defaults, configs/default.yaml, --set overrides, and errors that name file, key, value, allowed."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

import pytest
import yaml

from ktquest.config import Config, ConfigError, GenerationConfig, LongContextConfig, load_config

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


def test_on_and_off_read_as_yaml_booleans_are_the_modes(tmp_path):
    """YAML 1.1 reads on / off as true / false: where a key's values are "on" and "off" they mean those (a file
    and --set alike); elsewhere a boolean is still refused."""
    assert load_config(_write(tmp_path, "dual_chunk:\n  mode: off\n")).dual_chunk.mode == "off"
    assert load_config(None, ["dual_chunk.mode=on"]).dual_chunk.mode == "on"
    with pytest.raises(ConfigError, match="mode=False is not allowed"):
        load_config(None, ["mode=off"])


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
    ("chunk_size: 0", "chunk_size", "0", "[1, 16384]"),
    ("generation:\n  top_p: 1.5", "generation.top_p", "1.5", "(0, 1]"),
    ("generation:\n  temperature: -1", "generation.temperature", "-1.0", "0 (greedy) or a number >= 1e-06"),
    ("long_context:\n  anchor_num: 3", "long_context.anchor_num", "3", "exactly 2"),
    ("long_context:\n  preselect_pool_kernel: 4", "long_context.preselect_pool_kernel", "4", "odd"),
    ("long_context:\n  preselect_pool_kernel: 257", "long_context.preselect_pool_kernel", "257", "[1, 255]"),
    ("long_context:\n  preselect_window: 1025", "long_context.preselect_window", "1025", "[1, 1024]"),
    ("mode: long_context\nmax_seq_len: 100", "long_context.local_windows_len", "1024", "<= max_seq_len (100)"),
    ("long_context:\n  int8_candidates: true", "long_context.int8_candidates", "True", "unless preselect_block"),
    ("long_context:\n  index_group: -1", "long_context.index_group", "-1", "an integer >= 0 (0 = no index)"),
    ("long_context:\n  quest_centre: 1.5", "long_context.quest_centre", "1.5", "a number in [0, 1]"),
    ("long_context:\n  quest_centre: 0.5\n  anchor_type: DYNAMIC\n  anchor_num: 1", "long_context.quest_centre",
     "0.5", "0 with anchor_type DYNAMIC"),
    ("long_context:\n  int8_candidates: true\n  preselect_block: true\n  anchor_type: DYNAMIC\n  anchor_num: 1",
     "long_context.int8_candidates", "True", "anchor_type DYNAMIC"),
    ("rope_scaling: dynamic", "rope_scaling_factor", "0.0", "a number >= 1 with rope_scaling: dynamic"),
    ("rope_scaling: dynamic\nrope_scaling_factor: 0.5", "rope_scaling_factor", "0.5", ">= 1"),
    ("rope_scaling_factor: 2", "rope_scaling_factor", "2.0", "0 (unset) unless rope_scaling is dynamic"),
    ("rope_scaling: ntk", "rope_scaling", "'ntk'", "'gguf', 'dynamic'"),
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


# ---- hostile input: bounded work, one-line errors ----


def _one_line_error(fn, *needles: str) -> str:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert all(n in msg for n in needles), msg
    return msg


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    # levels of 9 aliases each: ~250 bytes that stand for 9**5 strings (each further level: 9 times more)
    lines = ['- &a0 ["xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"]'] + \
        [f"- &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 6)]
    p = _write(tmp_path, "threads:\n" + "\n".join(lines) + "\n")
    _one_line_error(lambda: load_config(p), str(p), "aliases (*a0) are not supported", "line 3")
    _one_line_error(lambda: load_config(None, ["threads=[&a 1, *a]"]), "aliases")


@pytest.mark.parametrize("value, needle", [("!!binary aGk=", "tags"), ("!!python/object:os.system x", "tags"),
                                           ("[" * 100 + "]" * 100, "nested deeper"), ("[1", "expected ','"),
                                           ("1" * 5000, "4300 digits"), ("'a\x07b'", "not valid YAML")])
def test_set_values_that_are_not_plain_yaml(value, needle):
    _one_line_error(lambda: load_config(None, [f"threads={value}"]), "--set", needle)


def test_a_huge_wrong_value_is_shown_short():
    msg = _one_line_error(lambda: load_config(None, [("threads", ["x" * 1000] * 1000)]), "threads=",
                          "wrong type")
    assert len(msg) < 200, msg


def test_config_file_must_be_utf8(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_bytes(b"threads: 1\nmodel: caf\xe9\n")
    _one_line_error(lambda: load_config(p), str(p), "not UTF-8", "byte 21")


def test_set_must_be_utf8():
    bad = b"model=caf\xe9".decode("utf-8", "surrogateescape")  # how argv holds bytes that are not UTF-8
    _one_line_error(lambda: load_config(None, [bad]), "--set", "not UTF-8")
    _one_line_error(lambda: load_config(None, [(bad.split("=")[0] + "\udcff", 1)]), "not UTF-8")


@pytest.mark.parametrize("item, needles", [
    ("threads=100000", ("threads=100000", ">= 0 (0 = all cores) and at most", "per CPU core")),
    ("threads=3000000000", ("threads=3000000000", "<= 2147483647")),
    ("threads=-1", ("threads=-1", ">= 0")),
    ("threads_num=100000", ("long_context.threads_num=100000", "per CPU core")),
    ("seed=18446744073709551616", ("generation.seed=18446744073709551616", "<= 9223372036854775807")),
    ("chunk_size=1000000000", ("chunk_size=1000000000", "[1, 16384]")),
    ("max_seq_len=9223372036854775808", ("max_seq_len=9223372036854775808", "<= 9223372036854775807")),
    ("temperature=1.0e-300", ("generation.temperature=1e-300", "0 (greedy) or a number >= 1e-06")),
    ("temperature=.inf", ("generation.temperature=inf", "finite")),
    ("repeat_penalty=.inf", ("generation.repeat_penalty=inf", "finite")),
    ("top_p=.nan", ("generation.top_p=nan", "finite")),
    ("block_size=99999999999", ("long_context.block_size=99999999999", "<= 2147483647")),
])
def test_limits(item, needles):
    _one_line_error(lambda: load_config(None, [item]), *needles)


def test_seed_and_temperature_limits_are_inclusive():
    cfg = load_config(None, [("seed", 2**63 - 1), ("temperature", 1e-6), ("threads", 4 * (os.cpu_count() or 1))])
    assert cfg.generation.seed == 2**63 - 1 and cfg.generation.temperature == 1e-6


@pytest.mark.parametrize("make, needles", [
    (lambda: Config(threads="2"), ("threads='2'", "wrong type", "int")),
    (lambda: Config(max_seq_len=None), ("max_seq_len=None", "wrong type")),
    (lambda: Config(generation={"seed": 1}), ("generation=", "wrong type")),
    (lambda: GenerationConfig(max_new_tokens=2.0), ("generation.max_new_tokens=2.0", "int")),
    (lambda: GenerationConfig(temperature=True), ("generation.temperature=True", "float")),
    (lambda: LongContextConfig(kv_type="fp64"), ("long_context.kv_type='fp64'", "'FP16'")),
    (lambda: GenerationConfig(seed=10**100), ("<an integer of 333 bits>", "<= 9223372036854775807")),
])
def test_python_api_values_are_checked_as_the_yaml_is(make, needles):
    _one_line_error(make, *needles)


def test_python_api_values_are_stored_typed():
    assert GenerationConfig(temperature=1).temperature == 1.0 and isinstance(GenerationConfig(temperature=1)
                                                                             .temperature, float)
    assert LongContextConfig(kv_type="q8_0").kv_type == "Q8_0"


def test_overrides_of_other_types_are_refused():
    _one_line_error(lambda: load_config(None, [3]), "expected 'key=value' or a (key, value) pair")
