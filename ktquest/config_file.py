"""Reading a config's text: the presets shipped in the package (``ktquest/presets/*.yaml``, found by name),
YAML as the schema needs it, ``--set key=value`` overrides, and the error every reader raises
(``ConfigError``, its values shown by ``show``). ``ktquest.config`` builds the dataclasses from what these
return."""

from __future__ import annotations

import os
import reprlib
from pathlib import Path
from typing import Any

import yaml

PRESETS = Path(__file__).resolve().parent / "presets"  # configs/ in a source checkout links here
MAX_CONFIG_BYTES = 1 << 20  # a config is a few lines
_MAX_YAML_DEPTH = 8  # the schema nests 2 levels; deeper YAML would only recurse in the parser


class ConfigError(ValueError):
    """A YAML file or override does not fit the schema."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def show(value: Any) -> str:
    """A value as an error message shows it: its repr, at most ~80 characters, computed in bounded time
    (reprlib stops at a few items and levels, so a value built from YAML aliases never expands)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"  # repr of a huge int is slow or refused
    r = _REPR.repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


class _YAMLLoader(yaml.SafeLoader):
    """YAML as a config needs it: plain scalars, lists and mappings. Aliases are refused (a few hundred
    bytes of nested aliases stand for gigabytes of values), so are explicit tags (``!!binary``,
    ``!!timestamp``, ...) and nesting deeper than the schema could use."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not supported",
                                              event.start_mark)
        if getattr(event, "tag", None) not in (None, "!"):
            raise yaml.composer.ComposerError(None, None, f"tags ({event.tag}) are not supported",
                                              event.start_mark)
        if self._depth >= _MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {_MAX_YAML_DEPTH} levels",
                                              event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def parse_yaml(text: str, source: str) -> Any:
    """``text`` as YAML (``_YAMLLoader``); any failure is a one-line ConfigError naming ``source``."""
    try:
        return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        where = f" (line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1})" if e.problem_mark else ""
        what = ", ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{source}: not valid YAML: {what}{where}") from None
    except yaml.YAMLError as e:  # the reader's errors (a control character, ...) carry no mark
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise ConfigError(f"{source}: not valid YAML: {str(e).split(':')[0]}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {show(item)}: expected key=value (for example long_context.block_size=32)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {show(item)}: empty key")
    value = parse_yaml(raw, f"--set {show(item)}") if raw.strip() else ""
    return key.split("."), value


def preset_names() -> list[str]:
    """The packaged presets' names, sorted: ``snapkv`` for ``ktquest/presets/snapkv.yaml``."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_summary(name: str) -> str:
    """What a preset is for: the first line of its top comment."""
    first = (PRESETS / f"{name}.yaml").read_text(encoding="utf-8").split("\n", 1)[0]
    return first.removeprefix("#").strip()


def find_config(path: str | os.PathLike) -> Path:
    """The file ``--config`` means: a bare name (no folder, no suffix) is a packaged preset, anything else a
    path. ConfigError naming the presets for a bare name that is neither a preset nor a file."""
    if isinstance(path, str) and path and Path(path).name == path and not Path(path).suffix:
        if path in preset_names():
            return PRESETS / f"{path}.yaml"
        if not Path(path).is_file():
            raise ConfigError(f"{show(path)}: no such preset or config file; the presets: {', '.join(preset_names())}")
    return Path(path)


def read_config_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    source = str(p)
    if not p.is_file():
        raise ConfigError(f"{source}: no such config file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: {p.stat().st_size} bytes is too large for a config file "
                          f"(at most {MAX_CONFIG_BYTES})")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    loaded = parse_yaml(text, source)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(loaded).__name__}")
    return loaded


def check_utf8(text: str, where: str) -> None:
    """Command-line text that was not UTF-8 reaches Python as lone surrogates (PEP 383)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at character {e.start})") from None
