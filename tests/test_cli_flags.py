"""The flags people type: llama.cpp's short flags mean what their long forms do, ``--version``, presets by name
(``--config snapkv``, ``ktquest presets``, ``ktquest.load(config="snapkv")``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ktquest
from ktquest.cli import main, served_model_id
from ktquest.cli_args import UsageError, build_parser, command_config
from ktquest.config import ConfigError, load_config
from ktquest.config_file import PRESETS, preset_names

CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # the source checkout's link to the packaged presets

# (short form, long form) of every short flag, with a value; each pair parsed by chat and, where it applies, serve
SHORT_LONG = [
    (["-m", "gemma3-270m"], ["--model", "gemma3-270m"]),
    (["-c", "4096"], ["--ctx-size", "4096"]),
    (["-t", "3"], ["--threads", "3"]),
    (["-n", "17"], ["--max-new-tokens", "17"]),
    (["-s", "5"], ["--seed", "5"]),
    (["--temp", "0.7"], ["--temperature", "0.7"]),
]
CHAT_ONLY = [
    (["-f", "doc.txt"], ["--prompt-file", "doc.txt"]),
    (["-p", "hello"], ["--message", "hello"]),
]


def _parsed(argv: list[str]):
    args = build_parser().parse_args(argv)
    return args, command_config(args)


@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize("short, long", SHORT_LONG)
def test_short_flag_means_its_long_form(command, short, long):
    s_args, s_cfg = _parsed([command, *short])
    l_args, l_cfg = _parsed([command, *long])
    assert s_cfg == l_cfg and vars(s_args) == vars(l_args)
    assert s_cfg != _parsed([command])[1] or short[0] == "-m"  # the flag did something


@pytest.mark.parametrize("short, long", CHAT_ONLY)
def test_chat_short_flag_means_its_long_form(short, long):
    assert vars(_parsed(["chat", *short])[0]) == vars(_parsed(["chat", *long])[0])


def test_flags_set_their_config_keys():
    args, cfg = _parsed(["chat", "-m", "gemma3-270m", "-c", "4096", "-t", "3", "-n", "17", "-s", "5", "--temp", "0.7"])
    assert args.model == "gemma3-270m"
    assert (cfg.max_seq_len, cfg.threads) == (4096, 3)
    assert (cfg.generation.max_new_tokens, cfg.generation.seed, cfg.generation.temperature) == (17, 5, 0.7)
    # the same keys through --set: the flags are shorthand, not a second path
    assert cfg == _parsed(["chat", "--model", "gemma3-270m", "--set", "max_seq_len=4096", "--set", "threads=3",
                           "--set", "max_new_tokens=17", "--set", "seed=5", "--set", "temperature=0.7"])[1]


def test_flags_override_set():
    assert _parsed(["chat", "--set", "threads=2", "-t", "4"])[1].threads == 4


@pytest.mark.parametrize("argv", [["--version"], ["chat", "--version"], ["serve", "--version"],
                                  ["bench", "--version"]])
def test_version_prints_the_kernels_and_exits_0(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ktquest {ktquest.__version__}, ") and "kernels" in out


@pytest.mark.parametrize("name, served", [("Qwen/Qwen2.5-7B-Instruct-1M-GGUF:Q4_K_M", None),
                                          ("bartowski/Llama-3.2-1B-Instruct-GGUF", None),
                                          ("smollm2-135m", None), ("models/my.model-Q4_K_M.gguf", "my.model-Q4_K_M")])
def test_the_server_names_a_model_as_it_was_given(name, served):
    assert served_model_id(name) == (served or name)


@pytest.mark.parametrize("name", ["snapkv", "quest", "million", "dense"])
def test_preset_by_name_equals_its_file(name):
    assert load_config(name) == load_config(CONFIGS / f"{name}.yaml") == load_config(str(PRESETS / f"{name}.yaml"))
    assert _parsed(["chat", "--config", name])[1] == _parsed(["chat", "--config", f"configs/{name}.yaml"])[1]


def test_presets_ship_inside_the_package():
    assert PRESETS.parent == Path(ktquest.__file__).resolve().parent
    assert {"default", "dense", "quest", "snapkv", "million"} <= set(preset_names())
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(f"{n}.yaml" for n in preset_names())


def test_unknown_preset_name_names_the_known_ones(capsys):
    with pytest.raises(ConfigError, match="no such preset or config file") as e:
        load_config("snapkvv")
    assert all(name in str(e.value) for name in preset_names())
    assert main(["chat", "--config", "snapkvv", "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ktquest: error: 'snapkvv': no such preset") and "quest, snapkv" in err


def test_a_path_still_works_and_a_missing_one_says_so(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("threads: 2\n")
    (tmp_path / "plain").write_text("threads: 3\n")  # a bare name that is a file (not a preset): the file
    monkeypatch.chdir(tmp_path)
    assert load_config("mine.yaml").threads == 2 and load_config("plain").threads == 3
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("nothere.yaml")


def test_presets_lists_every_preset_with_a_line(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in preset_names():
        line = next(x for x in lines if x.split(" ", 1)[0] == name)
        assert len(line.split(None, 1)[1]) > 20  # what it is for, from the file's first comment line


def test_unknown_short_flag_is_one_line():
    with pytest.raises(UsageError, match="-x"):
        build_parser().parse_args(["chat", "-x"])


def test_load_by_preset_name(tiny_llama):
    eng = ktquest.load(tiny_llama.path, config="dense", threads=1)
    assert eng.config == load_config(CONFIGS / "dense.yaml", [("threads", 1)])
    assert eng.config_path == PRESETS / "dense.yaml"  # the file a KV file may never be written over


def test_chat_with_short_flags(tiny_llama, capsys):
    code = main(["chat", "-m", str(tiny_llama.path), "--config", "dense", "-c", "128", "-t", "1", "-n", "4",
                 "--temp", "0", "-s", "1", "-p", "hello"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "new tokens" in captured.err
