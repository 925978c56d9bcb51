"""``ktquest``'s arguments: the parser of every subcommand, llama.cpp's short flags beside the long ones
(``-m -c -t -n -f -p -s --temp``), ``--version``, and the ``Config`` a chat or server command line means
(``command_config``: no model is loaded to build it)."""

from __future__ import annotations

import argparse
import typing

import ktquest
from ktquest.config import CHAT_GENERATION, Config, load_config
from ktquest.formats.bundled import BUNDLED_MODELS, DEFAULT_MODEL
from ktquest.server.guard import GuardConfig


class UsageError(ValueError):
    """A command-line argument that cannot be used (reported as one line, exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line like every other error, not usage + error
        raise UsageError(f"{message} (see {self.prog} --help)")


# flags, their generation key, their type, what they do; defaults: CHAT_GENERATION, then the schema's
_SAMPLING_FLAGS = [
    (("--temperature", "--temp"), "temperature", float, "0 = greedy; the chat's default is 0.3"),
    (("--top-k",), "top_k", int, "sample among the k most likely tokens (0 = off)"),
    (("--top-p",), "top_p", float, "nucleus: the most likely tokens holding this mass (1 = off)"),
    (("--min-p",), "min_p", float, "drop tokens less likely than this times the best (0 = off)"),
    (("--repeat-penalty",), "repeat_penalty", float, "penalize the recent tokens (1 = off)"),
    (("--repeat-last-n",), "repeat_last_n", int, "how many recent tokens the penalties see"),
    (("--presence-penalty",), "presence_penalty", float, "subtract from a recent token's logit (0 = off)"),
    (("--frequency-penalty",), "frequency_penalty", float, "subtract per occurrence in the recent tokens (0 = off)"),
]
# (argument name, config key) of the flags that set a config key; typed values, no round trip through YAML
_CONFIG_FLAGS = [("ctx_size", "max_seq_len"), ("threads", "threads"), ("chat_template", "chat_template"),
                 ("max_new_tokens", "generation.max_new_tokens"),
                 ("seed", "generation.seed")] + [(key, f"generation.{key}") for _, key, _, _ in _SAMPLING_FLAGS]


def version_line() -> str:
    """``ktquest 0.1.0, AVX2/FMA/F16C kernels (and AVX-VNNI)`` (or the scalar kernels and why): what
    ``--version`` prints."""
    try:
        from ktquest.native.cpu import cpu_features, use_avx2, use_avx_vnni
    except ImportError as e:  # the native extension is not built: say so, not a traceback
        return f"ktquest {ktquest.__version__}, native extension not loaded ({e})"
    if use_avx2():
        vnni = " (and AVX-VNNI)" if use_avx_vnni() else ""
        return f"ktquest {ktquest.__version__}, AVX2/FMA/F16C kernels{vnni}"
    missing = [name for name in ("avx2", "fma", "f16c") if not cpu_features()[name]]
    why = f"the CPU lacks {', '.join(missing)}" if missing else "forced: KTQUEST_FORCE_SCALAR"
    return f"ktquest {ktquest.__version__}, scalar kernels ({why})"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version and the kernels in use, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ktquest", description="Local LLM inference from a GGUF file.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description=f"Chat with a GGUF model (default: the bundled {DEFAULT_MODEL}).")
    _model_flags(chat)
    chat.add_argument("-f", "--prompt-file", metavar="FILE",
                      help="a document given as context with the first message")
    chat.add_argument("-p", "--message", metavar="TEXT",
                      help="answer TEXT once and exit (reply on stdout, stats on stderr)")
    chat.add_argument("--system", metavar="TEXT", help="system prompt")
    chat.add_argument("--save-kv", metavar="FILE",
                      help="write the KV cache to FILE: once the --prompt-file document is read (before any "
                           "message), else after --message's answer or when the chat ends")
    chat.add_argument("--load-kv", metavar="FILE",
                      help="start from a KV file's conversation (its document and turns): only new text is read")
    _generation_flags(chat)
    held = chat.add_mutually_exclusive_group()
    held.add_argument("--json", action="store_true",
                      help="hold every reply to a JSON object (structured output, as the server's json_object)")
    held.add_argument("--json-schema", metavar="FILE|JSON",
                      help="hold every reply to this JSON schema (a file, or the schema's text)")
    chat.add_argument("--show-thinking", action="store_true",
                      help="show a thinking model's think block (Qwen3, QwQ, DeepSeek-R1), dimmed; by default it is "
                           "hidden behind a 'thinking...' line")
    chat.add_argument("--parse-special", action="store_true", default=None,
                      help="read special-token text (<|im_end|>) in your messages, --system and "
                           "--prompt-file as control tokens; by default it is plain text (parse_special)")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                           description="Serve a GGUF model over an OpenAI-compatible API (/v1/chat/completions, "
                                       "/v1/completions, /v1/models, /health).")
    _model_flags(serve)
    _generation_flags(serve, " (the default of requests that do not set it)")
    serve.add_argument("--load-kv", metavar="FILE",
                       help="start with a KV file's tokens cached (a document: questions about it read only themselves)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    serve.add_argument("--slots", type=int, default=2, metavar="N",
                       help="conversations whose KV stays cached, each a cache of its own (default: 2)")
    serve.add_argument("--parallel", type=int, default=1, metavar="N",
                       help="replies that run at once, their decode steps batched through the weights once; a slot "
                            "each (default: 1)")
    serve.add_argument("--queue", type=int, default=8, metavar="N",
                       help="requests that may wait behind the running one; more are answered 429 (default: 8)")
    serve.add_argument("--max-body-mb", type=float, default=64, metavar="MB",
                       help="largest request body; a larger one is answered 413 (default: 64)")
    serve.add_argument("--prefix-reuse", choices=("per-key", "shared", "off"), default="per-key",
                       help="whose cached prompts a request reuses: per-key, only those sent with its own API key "
                            "(no key: one anonymous group), so no client learns another's prompts from "
                            "cached_tokens or timing; shared, anyone's; off, none (default: per-key)")
    serve.add_argument("--alias", metavar="NAME",
                       help="the model's name in /v1/models and in replies (default: the --model as given)")
    serve.add_argument("--strict-model-name", action="store_true",
                       help="answer 404 to a request that names another model (default: the loaded model answers "
                            "any name, as clients hard-code theirs)")
    serve.add_argument("--verbose", action="store_true",
                       help="also uvicorn's access log (a line per request is always printed; /metrics has the "
                            "counts)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY", dest="api_keys",
                       help="require 'Authorization: Bearer KEY' with one of these keys, else 401 (repeatable; "
                            "default: $KTQ_API_KEY if set, else no key needed)")
    _guard_flags(serve)
    sub.add_parser("presets", help="list the packaged presets (--config NAME) and what each is for",
                   description="The presets shipped with ktquest: --config NAME loads one, --set changes its keys.")
    pull = sub.add_parser("pull", help="download a GGUF model from a model repository into the local hub cache",
                          description="Download OWNER/NAME[:QUANT|:FILE] (e.g. Qwen/Qwen2.5-7B-Instruct-1M-GGUF:Q4_K_M) "
                                      "into the hub cache ($HF_HOME; resumed, size and checksum checked; split files "
                                      "joined); then --model takes the same name, offline.")
    pull.add_argument("ref", metavar="OWNER/NAME[:QUANT|:FILE]")
    sub.add_parser("list", help="the bundled and downloaded models, and whether this machine holds each",
                   description="Each model --model can take: architecture, parameters, quantization, trained "
                               "context, file size, and whether this machine's RAM holds it at its trained context "
                               "in dense and in long_context (snapkv) mode.")
    _bench_parser(sub)
    return parser


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action=_Version)
    p.add_argument("-m", "--model", metavar="PATH|NAME|REPO",
                   help=f"a GGUF file, a bundled model ({', '.join(BUNDLED_MODELS)}) or a downloaded OWNER/NAME[:QUANT] "
                        f"('ktquest pull'; 'ktquest list' shows them) (default: config 'model', else {DEFAULT_MODEL})")
    p.add_argument("--config", metavar="NAME|FILE",
                   help="a packaged preset by name (snapkv, quest, million, ...: 'ktquest presets' lists them, "
                        "'default' shows every key) or a YAML file")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help="override a config key, e.g. --set threads=2 --set generation.top_k=40 (repeatable)")
    p.add_argument("-c", "--ctx-size", type=int, metavar="N",
                   help="context length, tokens (max_seq_len; 0 = the model's trained context)")
    p.add_argument("-t", "--threads", type=int, metavar="N", help="CPU threads (threads; 0 = all cores)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template used instead of the model's (chat_template; for a base model, or "
                        "one whose own template is broken or fails on your messages)")


def _generation_flags(p: argparse.ArgumentParser, note: str = "") -> None:
    p.add_argument("-n", "--max-new-tokens", type=int, metavar="N",
                   help=f"reply length limit (generation.max_new_tokens){note}")
    for flags, key, kind, what in _SAMPLING_FLAGS:
        p.add_argument(*flags, type=kind, metavar="X", dest=key, help=f"{what} (generation.{key}){note}")
    p.add_argument("-s", "--seed", type=int, metavar="N", help=f"sampling seed (generation.seed){note}")


def _guard_flags(p: argparse.ArgumentParser) -> None:
    """serve's connection limits and allowed hosts/origins (ktquest/server/guard.py says why)."""
    d = GuardConfig()
    p.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="SECONDS",
                   help="a connection that has not sent a whole request head this long after opening (or after "
                        f"its last response) is closed (default: {d.header_timeout:g})")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout, metavar="SECONDS",
                   help=f"an idle keep-alive connection is closed after this long (default: {d.idle_timeout:g})")
    p.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help=f"open connections served at once; a request past them is answered 503 "
                        f"(default: {d.max_connections})")
    p.add_argument("--allow-host", action="append", default=[], metavar="HOST", dest="allow_hosts",
                   help="also accept requests addressed to HOST (the Host header; repeatable, * = any); by "
                        "default only localhost, 127.0.0.1, [::1] and --host (DNS rebinding)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN", dest="allow_origins",
                   help="let web pages from ORIGIN (e.g. http://localhost:3000) call the server (repeatable, "
                        "* = any); by default only the server's own origins")


def command_config(args: argparse.Namespace) -> Config:
    """The config a ``chat`` or ``serve`` command line means: ``--config`` (a preset's name or a file), then
    ``--set``, then the flags that set a key (``-c``, ``-t``, ``-n``, ``-s``, sampling); both sample as the
    chat does (CHAT_GENERATION) unless these say otherwise."""
    sets = [(key, getattr(args, name)) for name, key in _CONFIG_FLAGS if getattr(args, name) is not None]
    if getattr(args, "parse_special", None):
        sets.append(("parse_special", True))
    return load_config(args.config, args.sets + sets, base={"generation": CHAT_GENERATION})


def _bench_parser(sub) -> None:
    """``ktquest bench``'s arguments (llama-bench's habit: -m -c -t -n, comma-separated lists)."""
    b = sub.add_parser("bench", help="prompt processing, first token and generation speed per preset and context",
                       description="Measure prefill tok/s, time to first token and steady greedy generation tok/s "
                                   "for each (preset, context), each in a fresh KV cache, on natural text (Python "
                                   "standard-library sources); a markdown table on stdout.")
    b.add_argument("--version", action=_Version)
    b.add_argument("-m", "--model", metavar="PATH|NAME|REPO", help=f"a GGUF file, a bundled or downloaded model "
                                                                    f"(default: {DEFAULT_MODEL})")
    b.add_argument("-c", "--contexts", default="1024,8192", metavar="N[,N...]",
                   help="context lengths, tokens (default: 1024,8192)")
    b.add_argument("--config", default="dense,snapkv", dest="presets", metavar="NAME|FILE[,...]",
                   help="presets (or YAML files) to compare, comma-separated (default: dense,snapkv)")
    b.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help="override a config key in every preset (repeatable)")
    b.add_argument("-t", "--threads", type=int, default=0, metavar="N", help="CPU threads (default: 0 = all cores)")
    b.add_argument("-n", "--n-gen", type=int, default=32, metavar="N",
                   help="greedy tokens generated after the first (default: 32)")
    b.add_argument("-r", "--repetitions", type=int, default=1, metavar="N",
                   help="runs of each measurement, each in a fresh cache: the table shows median ± standard "
                        "deviation (default: 1)")
    b.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python) on the same GGUF and tokens")
    b.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
