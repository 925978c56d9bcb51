"""``ktquest chat``: a terminal chat with streaming replies, prefill progress and per-reply speed.

Interactive by default (``/reset``, ``/stats``, ``/exit`` or EOF quit). Nothing ends a conversation but
quitting: Ctrl-C stops a reply (the partial reply is kept) or a /save or /load (the conversation goes on as it
was) and is otherwise ignored, and a turn that fails (the chat template's error, a prompt too long for the
context, ...) prints one line and the conversation goes on without that message. ``--message TEXT`` answers
once for scripts: the reply on stdout, the stats on stderr. Errors are one line, ``ktquest: error: ...``, on
stderr and exit code 2; Ctrl-C while loading or answering ``--message`` exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import ktquest
from ktquest.config import CHAT_GENERATION, load_config
from ktquest.formats.bundled import BUNDLED_MODELS, DEFAULT_MODEL
from ktquest.server.guard import GuardConfig
from ktquest.terminal import CtrlC, PrefillBar, stats_line, stats_table, stream_reply

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
HELP = ("/reset forgets the conversation, /stats shows usage, /save FILE and /load FILE keep it in a KV file, "
        "/exit or Ctrl-D quits; Ctrl-C stops a reply")
# What a user can cause and fix, reported as one line: ktquest's own errors are ValueErrors that name the
# problem (ConfigError, GGUFError, TokenizerError, ChatTemplateError, PromptTooLongError, UsageError), OSError
# a file. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)


# --flag, its generation key, its type, what it does; defaults: CHAT_GENERATION, then the schema's
_SAMPLING_FLAGS = [
    ("--temperature", "temperature", float, "0 = greedy; the chat's default is 0.3"),
    ("--top-k", "top_k", int, "sample among the k most likely tokens (0 = off)"),
    ("--top-p", "top_p", float, "nucleus: the most likely tokens holding this mass (1 = off)"),
    ("--min-p", "min_p", float, "drop tokens less likely than this times the best (0 = off)"),
    ("--repeat-penalty", "repeat_penalty", float, "penalize the recent tokens (1 = off)"),
    ("--repeat-last-n", "repeat_last_n", int, "how many recent tokens the penalties see"),
    ("--presence-penalty", "presence_penalty", float, "subtract from a recent token's logit (0 = off)"),
    ("--frequency-penalty", "frequency_penalty", float, "subtract per occurrence in the recent tokens (0 = off)"),
]


class UsageError(ValueError):
    """A command-line argument that cannot be used (reported as one line, exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line like every other error, not usage + error
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ktquest", description="Local LLM inference from a GGUF file.")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description=f"Chat with a GGUF model (default: the bundled {DEFAULT_MODEL}).")
    _model_flags(chat)
    chat.add_argument("--prompt-file", metavar="FILE", help="a document given as context with the first message")
    chat.add_argument("--message", metavar="TEXT", help="answer TEXT once and exit (reply on stdout, stats on stderr)")
    chat.add_argument("--system", metavar="TEXT", help="system prompt")
    chat.add_argument("--save-kv", metavar="FILE",
                      help="write the KV cache to FILE: once the --prompt-file document is read (before any "
                           "message), else after --message's answer or when the chat ends")
    chat.add_argument("--load-kv", metavar="FILE",
                      help="start from a KV file's conversation (its document and turns): only new text is read")
    chat.add_argument("--max-new-tokens", type=int, metavar="N", help="reply length limit (generation.max_new_tokens)")
    for flag, key, kind, what in _SAMPLING_FLAGS:
        chat.add_argument(flag, type=kind, metavar="X", dest=key, help=f"{what} (generation.{key})")
    chat.add_argument("--seed", type=int, metavar="N", help="sampling seed (generation.seed)")
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
    serve.add_argument("--load-kv", metavar="FILE",
                       help="start with a KV file's tokens cached (a document: questions about it read only themselves)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    serve.add_argument("--slots", type=int, default=2, metavar="N",
                       help="conversations whose KV stays cached, each a cache of its own (default: 2)")
    serve.add_argument("--queue", type=int, default=8, metavar="N",
                       help="requests that may wait behind the running one; more are answered 429 (default: 8)")
    serve.add_argument("--max-body-mb", type=float, default=64, metavar="MB",
                       help="largest request body; a larger one is answered 413 (default: 64)")
    serve.add_argument("--prefix-reuse", choices=("per-key", "shared", "off"), default="per-key",
                       help="whose cached prompts a request reuses: per-key, only those sent with its own API key "
                            "(no key: one anonymous group), so no client learns another's prompts from "
                            "cached_tokens or timing; shared, anyone's; off, none (default: per-key)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY", dest="api_keys",
                       help="require 'Authorization: Bearer KEY' with one of these keys, else 401 (repeatable; "
                            "default: $KTQ_API_KEY if set, else no key needed)")
    _guard_flags(serve)
    return parser


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


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH|NAME",
                   help=f"a GGUF file or a bundled model: {', '.join(BUNDLED_MODELS)} (default: config "
                        f"'model', else {DEFAULT_MODEL})")
    p.add_argument("--config", metavar="FILE", help="YAML config (see configs/default.yaml)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help="override a config key, e.g. --set threads=2 --set generation.top_k=40 (repeatable)")


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code. The one place errors become ``ktquest: error: ...``."""
    # ktquest's kernels run on its own thread pool between torch ops: torch's idle OpenMP workers must not spin
    # for milliseconds on the cores the pool then needs. Here, in ktquest's own process, not on import.
    ktquest.set_openmp_spin()
    err = Console(stderr=True, highlight=False)
    try:
        args = build_parser().parse_args(argv)
        return _serve(args) if args.command == "serve" else _chat(args, err)
    except KeyboardInterrupt:  # while loading, or answering --message
        err.print()
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        print(f"ktquest: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _chat(args: argparse.Namespace, err: Console) -> int:
    flags = [("max_new_tokens", args.max_new_tokens), ("seed", args.seed)] + \
        [(key, getattr(args, key)) for _, key, _, _ in _SAMPLING_FLAGS]
    sets = [(f"generation.{k}", v) for k, v in flags if v is not None]  # typed: no YAML round trip
    if args.parse_special:
        sets.append(("parse_special", True))
    # the chat samples (CHAT_GENERATION) unless the config or these flags say otherwise
    cfg = load_config(args.config, args.sets + sets, base={"generation": CHAT_GENERATION})
    if args.load_kv and (args.prompt_file or args.system):
        raise UsageError("--load-kv brings its own conversation (document and system prompt included): drop "
                         "--prompt-file and --system")
    document = _read_document(args.prompt_file) if args.prompt_file else None

    from ktquest.engine import load  # torch loads here, after the arguments are known to be good

    with err.status("loading the model...", spinner="dots") if err.is_terminal and args.message is None \
            else contextlib.nullcontext():
        engine = load(args.model, cfg)
        engine.config_path = Path(args.config) if args.config else None  # never written over by a KV file
        if args.save_kv:
            engine.check_kv_path(args.save_kv)  # a path it may not write is refused now, not after the reading
        session = engine.load_session(args.load_kv) if args.load_kv else \
            engine.chat_session(system=args.system, document=document)
    if document is not None:  # one that leaves no room is refused now, not with every message
        _check_document_fits(engine, session, args.prompt_file)
    save_at_end = args.save_kv
    if args.save_kv and document is not None:
        _read_and_save(session, args.save_kv, err)
        save_at_end = None
    if args.message is not None:
        code = _answer_once(session, args.message, err, args.show_thinking)
        if save_at_end:
            _save(session, save_at_end, err)
        return code
    return _interactive(engine, session, err, save_at_end, args.show_thinking)


def _read_and_save(session, path: str, err: Console) -> None:
    """Read the session's document into the cache and save it (Ctrl-C: exit 130, nothing written)."""
    bar = PrefillBar(err, session.engine.config.chunk_size, "reading the document")
    try:
        stats = session.read_document(on_progress=bar.update if err.is_terminal else None)
    finally:
        bar.stop()
    if stats.stopped_by == "interrupted":
        raise KeyboardInterrupt
    _save(session, path, err)


def _save(session, path: str, err: Console) -> None:
    t0 = time.perf_counter()
    n = session.save(path)
    err.print(f"[dim]saved {len(session.engine.sequence):,} tokens of KV to {escape(path)} ({n / 2**20:,.1f} MiB, "
              f"{time.perf_counter() - t0:.2f} s)[/]")


def _serve(args: argparse.Namespace) -> int:
    for flag, value, low in (("--port", args.port, 1), ("--slots", args.slots, 1), ("--queue", args.queue, 0),
                             ("--max-body-mb", args.max_body_mb, 0.001)):
        if value < low or (flag == "--port" and value > 65535):
            raise UsageError(f"{flag} {value}: must be {'1..65535' if flag == '--port' else f'>= {low}'}")
    api_keys = tuple(args.api_keys) or ((os.environ["KTQ_API_KEY"],) if os.environ.get("KTQ_API_KEY") else ())
    if any(not k.strip() or k != k.strip() for k in api_keys):
        raise UsageError("--api-key: a key must be non-empty, without spaces around it")
    guard = GuardConfig(host=args.host, port=args.port, allow_hosts=tuple(args.allow_hosts),
                        allow_origins=tuple(args.allow_origins), header_timeout=args.header_timeout,
                        idle_timeout=args.idle_timeout, max_connections=args.max_connections)
    # the server samples as the chat does (CHAT_GENERATION) under the config; requests override their fields
    cfg = load_config(args.config, args.sets, base={"generation": CHAT_GENERATION})

    from ktquest.engine import load
    from ktquest.server import serve

    name = args.model or cfg.model or DEFAULT_MODEL  # what clients name the model: as it was given
    model_id = name if name in BUNDLED_MODELS else Path(name).stem
    serve(load(args.model, cfg), args.host, args.port, args.slots, args.queue, model_id,
          int(args.max_body_mb * 2**20), args.load_kv, guard=guard, prefix_reuse=args.prefix_reuse,
          api_keys=api_keys)
    return 0


PRESETS = Path(__file__).resolve().parents[1] / "configs"  # in a source checkout (a wheel has none)


def _check_document_fits(engine, session, path: str) -> None:
    """UsageError unless the --prompt-file document leaves room in the context for a reply (else every message
    is refused): its tokens as the first message wraps them, the context, and what would hold it."""
    from ktquest.turn import PromptTooLongError

    n = session.next_prompt_tokens()
    try:
        engine.check_fits(n)
    except PromptTooLongError:
        raise UsageError(f"--prompt-file {path}: {n:,} tokens as the first message wraps it, but the context holds "
                         f"{engine.max_seq_len:,} (max_seq_len) and a reply needs room too; "
                         f"{_what_holds(engine, n)}") from None


def _what_holds(engine, n_tokens: int) -> str:
    """The preset of the smallest context that holds ``n_tokens`` on this model (of the engine's mode on a tie),
    or the key that raises the limit."""
    from ktquest.config import ConfigError
    from ktquest.models.args import resolve_max_seq_len

    holding = []
    for preset in sorted(PRESETS.glob("*.yaml")) if PRESETS.is_dir() else []:
        try:
            cfg = load_config(preset)
        except ConfigError:
            continue
        n = resolve_max_seq_len(engine.args, cfg.max_seq_len)
        if n > n_tokens and preset.name != "default.yaml":  # (every key at its default: not a preset)
            holding.append((n, cfg.mode != engine.config.mode, preset.name, preset))
    if not holding:
        return f"no preset holds it: --set max_seq_len=N raises the limit (N > {n_tokens:,})"
    n, _, _, preset = min(holding)
    shown = preset.relative_to(Path.cwd()) if preset.is_relative_to(Path.cwd()) else preset
    trained = engine.args.context_length
    past = f", past the {trained:,} tokens the model was trained on" if n_tokens > trained else ""
    return f"--config {shown} holds it (max_seq_len {n:,} on this model{past})"


def _read_document(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--prompt-file {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# ---- one reply ----


def _answer_once(session, message: str, err: Console, show_thinking: bool = False) -> int:
    with CtrlC() as ctrl_c, ctrl_c.turn():
        reply = stream_reply(session, message, sys.stdout, err, ctrl_c, show_progress=err.is_terminal,
                             show_thinking=show_thinking)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats_line(reply.stats), file=sys.stderr)
    return EXIT_INTERRUPTED if reply.stats.stopped_by == "interrupted" else 0


# ---- interactive ----


def _interactive(engine, session, err: Console, save_at_end: str | None = None, show_thinking: bool = False) -> int:
    from ktquest.formats.tokenizer import valid_text

    console = Console(highlight=False, soft_wrap=True)  # long lines wrap in the terminal, not at 80 columns
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")  # a typed byte that is not UTF-8 reads as U+FFFD
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    console.print(f"[bold]ktquest chat[/] - {escape(engine.model_name)} on {engine.device.type} "
                  f"({str(engine.dtype).removeprefix('torch.')}, {engine.config.resolved_threads()} threads, "
                  f"context {engine.max_seq_len} tokens)")
    if engine.config.prefill.order == "layer":
        console.print(f"[dim]layer-major prefill: at most {engine.prefill_device_bytes() / 2**20:.1f} MiB of "
                      f"{engine.device.type} memory beside the weights and the KV cache[/]")
    if session.document is not None:
        n = len(engine.tokenizer.encode(session.document, add_bos=False,
                                        parse_special=engine.config.parse_special))
        console.print(f"[dim]document: {n} tokens, given with your first message[/]")
    console.print(f"[dim]{HELP}[/]")
    commands: dict[str, Callable[[], None]] = {
        "/reset": lambda: (session.reset(), console.print("[dim]conversation reset[/]")),
        "/stats": lambda: console.print(stats_table(session)),
        "/help": lambda: console.print(f"[dim]{HELP}[/]"),
    }
    with CtrlC() as ctrl_c:
        while True:
            try:
                with ctrl_c.prompt():
                    line = console.input("[bold green]>>> [/]")
            except EOFError:
                console.print()
                return _save_at_end(session, save_at_end, err, ctrl_c)
            except KeyboardInterrupt:
                console.print("\n[dim]/exit or Ctrl-D quits[/]")
                continue
            text = valid_text(line).strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return _save_at_end(session, save_at_end, err, ctrl_c)
            if text.startswith(("/save ", "/load ")):
                session = _kv_command(engine, session, text, console, ctrl_c)
                continue
            if text.startswith("/") and " " not in text:
                if text in commands:
                    commands[text]()
                else:
                    console.print(f"[red]unknown command {escape(text)}[/]; {HELP}")
                continue
            turns = len(session.messages)
            # one turn: whatever fails, one line, and the conversation goes on (ChatSession keeps it whole)
            try:
                with ctrl_c.turn():
                    _turn(session, text, console, err, ctrl_c, show_thinking)
            except KeyboardInterrupt:  # a second Ctrl-C
                dropped = "" if len(session.messages) > turns else "; that message was dropped"
                console.print(("\n" if ctrl_c.midline else "") + f"[yellow]interrupted{dropped}[/]")
            except USER_ERRORS as e:
                console.print(("\n" if ctrl_c.midline else "") + f"[red]{escape(_one_line(e))}[/]; that "
                              "message was dropped")


def _kv_command(engine, session, text: str, console: Console, ctrl_c: CtrlC):
    """``/save FILE`` or ``/load FILE``; returns the session the chat goes on with. A failure is one line and
    Ctrl-C stops the command: either way the conversation goes on as it was (a file is loaded whole before
    it replaces anything; a Ctrl-C landing as the cache is filled leaves the conversation's messages, read
    again with the next one)."""
    path, held = text[6:].strip(), engine.sequence.owner is session
    try:
        with ctrl_c.prompt():  # Ctrl-C raises in here, as at the prompt
            if text.startswith("/save"):
                _save(session, path, console)
                return session
            loaded = engine.load_session(path)
    except KeyboardInterrupt:
        again = "; its KV cache is read again with the next message" if held and engine.sequence.owner is not session \
            else ""
        console.print(f"\n[yellow]interrupted: {text[1:5]} stopped, the conversation goes on as it was{again}[/]")
        return session
    except USER_ERRORS as e:
        console.print(f"[red]{escape(_one_line(e))}[/]")
        return session
    console.print(f"[dim]loaded {escape(path)}: {len(engine.sequence):,} tokens, {len(loaded.messages)} messages[/]")
    return loaded


def _save_at_end(session, path: str | None, err: Console, ctrl_c: CtrlC) -> int:
    if path is None:
        return 0
    try:
        with ctrl_c.prompt():  # Ctrl-C: not saved, exit 130
            _save(session, path, err)
    except KeyboardInterrupt:
        print(f"ktquest: interrupted: the KV cache was not saved to {path}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        print(f"ktquest: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _turn(session, text: str, console: Console, err: Console, ctrl_c: CtrlC, show_thinking: bool = False) -> None:
    reply = stream_reply(session, text, sys.stdout, err, ctrl_c, show_progress=True, show_thinking=show_thinking)
    s = reply.stats
    if s.stopped_by == "interrupted" and s.new_tokens == 0:
        kept = (f"; the {s.prompt_tokens:,} tokens of it read stay in the cache: send it again to go on from "
                "there") if s.prompt_tokens else ""
        console.print(f"[yellow]stopped before the reply began; that message was dropped{kept}[/]")
        return
    sys.stdout.write("\n")
    ctrl_c.midline = False
    note = " (stopped)" if s.stopped_by == "interrupted" else " (length limit)" \
        if s.stopped_by in ("max_new_tokens", "max_seq_len") else ""
    console.print(f"[dim]{stats_line(s)}{note}[/]")


if __name__ == "__main__":
    sys.exit(main())
