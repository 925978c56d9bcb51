"""``ktquest chat``: a terminal chat with streaming replies, prefill progress and per-reply speed; ``ktquest serve``
and ``ktquest presets`` start here too (their arguments: ``cli_args.py``).

Interactive by default (``/reset``, ``/stats``, ``/exit``, ``/quit`` or EOF quit; a line of three double quotes
starts a multi-line message that another ends, and a pasted text is one message; any other ``/word`` is refused). Nothing ends a conversation but
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
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

import ktquest
from ktquest.cli_args import UsageError, build_parser, command_config
from ktquest.config import find_config, load_config
from ktquest.config_file import PRESETS, preset_names, preset_summary
from ktquest.formats.bundled import BUNDLED_MODELS, DEFAULT_MODEL
from ktquest.server.guard import GuardConfig
from ktquest.terminal import (
    CtrlC,
    PrefillBar,
    enable_bracketed_paste,
    read_message,
    stats_line,
    stats_table,
    stream_reply,
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
HELP = ("/reset forgets the conversation, /stats shows usage, /save FILE and /load FILE keep it in a KV file, "
        '/exit, /quit or Ctrl-D quits; a line """ starts a multi-line message and another ends it; Ctrl-C stops '
        "a reply")
COMMANDS = "/reset /stats /save FILE /load FILE /help /exit /quit"
# What a user can cause and fix, reported as one line: ktquest's own errors are ValueErrors that name the
# problem (ConfigError, GGUFError, TokenizerError, ChatTemplateError, PromptTooLongError, UsageError), OSError
# a file. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code. The one place errors become ``ktquest: error: ...``."""
    # ktquest's kernels run on its own thread pool between torch ops: torch's idle OpenMP workers must not spin
    # for milliseconds on the cores the pool then needs. Here, in ktquest's own process, not on import.
    ktquest.set_openmp_spin()
    err = Console(stderr=True, highlight=False)
    try:
        args = build_parser().parse_args(argv)
        if args.command == "presets":
            return _presets()
        if args.command == "bench": from ktquest import bench; return bench.main(args)  # noqa: I001
        if args.command in ("pull", "list"):
            from ktquest import catalog_cli

            return catalog_cli.pull(args.ref) if args.command == "pull" else catalog_cli.list_models()
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
    cfg = command_config(args)
    if args.load_kv and (args.prompt_file or args.system):
        raise UsageError("--load-kv brings its own conversation (document and system prompt included): drop "
                         "--prompt-file and --system")
    document = _read_text("--prompt-file", args.prompt_file) if args.prompt_file else None
    _check_chat_template(args.chat_template)
    held = _response_format(args)

    from ktquest.engine import load  # torch loads here, after the arguments are known to be good

    with err.status("loading the model...", spinner="dots") if err.is_terminal and args.message is None \
            else contextlib.nullcontext():
        engine = load(args.model, cfg)
        _context_lines(engine)
        engine.config_path = find_config(args.config) if args.config else None  # never written over by a KV file
        if args.save_kv:
            engine.check_kv_path(args.save_kv)  # a path it may not write is refused now, not after the reading
        session = engine.load_session(args.load_kv) if args.load_kv else \
            engine.chat_session(system=args.system, document=document)
    session.response_format = held
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


def _response_format(args: argparse.Namespace):
    """``--json`` / ``--json-schema``: what every reply is held to (UsageError: a schema that cannot be)."""
    if not args.json and args.json_schema is None:
        return None
    from ktquest.structured import FormatError, ResponseFormat

    fmt = {"type": "json_object"}
    if args.json_schema is not None:
        text = args.json_schema if args.json_schema.lstrip().startswith("{") else \
            _read_text("--json-schema", args.json_schema)
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise UsageError(f"--json-schema: not JSON: {e}") from None
        fmt = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    try:
        return ResponseFormat.parse(fmt)
    except FormatError as e:
        raise UsageError(f"--json-schema: {e}") from None


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
    for flag, value, low in (("--port", args.port, 1), ("--slots", args.slots, 1), ("--parallel", args.parallel, 1),
                             ("--queue", args.queue, 0),
                             ("--max-body-mb", args.max_body_mb, 0.001)):
        if value < low or (flag == "--port" and value > 65535):
            raise UsageError(f"{flag} {value}: must be {'1..65535' if flag == '--port' else f'>= {low}'}")
    api_keys = tuple(args.api_keys) or ((os.environ["KTQ_API_KEY"],) if os.environ.get("KTQ_API_KEY") else ())
    if any(not k.strip() or k != k.strip() for k in api_keys):
        raise UsageError("--api-key: a key must be non-empty, without spaces around it")
    guard = GuardConfig(host=args.host, port=args.port, allow_hosts=tuple(args.allow_hosts),
                        allow_origins=tuple(args.allow_origins), header_timeout=args.header_timeout,
                        idle_timeout=args.idle_timeout, max_connections=args.max_connections)
    cfg = command_config(args)  # requests override its generation fields
    _check_chat_template(args.chat_template)

    from ktquest.engine import load
    from ktquest.server import serve

    name = args.model or cfg.model or DEFAULT_MODEL  # what clients name the model: as it was given
    if args.alias is not None and (not args.alias.strip() or args.alias != args.alias.strip()):
        raise UsageError("--alias: a name must be non-empty, without spaces around it")
    model_id = args.alias or served_model_id(name)
    engine = load(args.model, cfg)
    _context_lines(engine)
    serve(engine, args.host, args.port, args.slots, args.queue, model_id,
          int(args.max_body_mb * 2**20), args.load_kv, guard=guard, prefix_reuse=args.prefix_reuse,
          api_keys=api_keys, strict_model_name=args.strict_model_name, verbose=args.verbose,
          parallel=args.parallel)
    return 0


def _presets() -> int:
    """``ktquest presets``: each packaged preset's name and what it is for."""
    names = preset_names()
    width = max(map(len, names))
    for name in names:
        print(f"{name:<{width}}  {preset_summary(name)}")
    print(f"\n--config NAME loads one (files in {PRESETS}); --set KEY=VALUE changes a key")
    return 0


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


def _context_lines(engine) -> None:
    """The context the engine took, where RAM cut the default, a context past the trained one (``ktquest.context``),
    a hybrid model's recurrent state with its checkpoints, and the weights' form and size where they are not the
    file mapped in place (a GPU's fp16 or int8 rows): a line each on stderr, unwrapped."""
    weights = engine.weights_note if engine.weights != "gguf" else None
    for line in (engine.context_note, engine.context_warning, engine.state_note, weights):
        if line:
            print(f"ktquest: {line}", file=sys.stderr)


def _what_holds(engine, n_tokens: int) -> str:
    """The preset of the smallest context that holds ``n_tokens`` on this model on this machine (of the engine's
    mode, then the README's order, on a tie), or the key that raises the limit."""
    from ktquest.config import ConfigError
    from ktquest.context import preset_context, presets_by_preference

    holding = []
    for rank, preset in enumerate(presets_by_preference()):
        try:
            cfg = load_config(preset)
        except ConfigError:
            continue
        n = preset_context(cfg, engine.args, engine.device, engine.dtype, engine.weights_bytes)
        if n is not None and n > n_tokens:
            holding.append((n, cfg.mode != engine.config.mode, rank, preset))
    if not holding:
        return f"no preset holds it: --set max_seq_len=N raises the limit (N > {n_tokens:,})"
    n, _, _, preset = min(holding)
    trained = engine.args.context_length
    past = f", past the {trained:,} tokens the model was trained on" if n_tokens > trained else ""
    return f"--config {preset.stem} holds it (max_seq_len {n:,} on this model{past})"


def _read_text(flag: str, path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def served_model_id(name: str) -> str:
    """What clients name the model the server was started with: a bundled model's name, a downloaded model's
    OWNER/NAME[:QUANT] as given, a file's stem."""
    from ktquest.hub import parse_ref

    if name in BUNDLED_MODELS or parse_ref(name) is not None:
        return name
    return Path(name).stem


def _check_chat_template(path: str | None) -> None:
    """``--chat-template FILE`` refused before the model loads (one line naming the file) unless it is UTF-8 text
    whose template compiles and renders one user message (the engine reads it again: ``chat_template``)."""
    if not path:
        return
    from ktquest.formats.chat_template import ChatTemplateError, read_template_file

    try:
        read_template_file(path)
    except ChatTemplateError as e:
        raise UsageError(f"--chat-template {e}") from None


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
    enable_bracketed_paste()  # (and readline's line editing and history for input())
    base = " (base model: no chat template, it continues the text)" if engine.tokenizer.chat_template is None \
        else ""
    console.print(f"[bold]ktquest chat[/] - {escape(engine.model_name)}{base} on {engine.device.type} "
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
                    message = read_message(console.input, "[bold green]>>> [/]", "[bold green]... [/]")
            except EOFError:
                console.print()
                return _save_at_end(session, save_at_end, err, ctrl_c)
            except KeyboardInterrupt:
                console.print("\n[dim]/exit or Ctrl-D quits[/]")
                continue
            text = valid_text(message.text).strip()
            if not text:
                continue
            if text.startswith("/") and not message.block:  # a command, never sent to the model
                word = text.split()[0]
                if text in ("/exit", "/quit"):
                    return _save_at_end(session, save_at_end, err, ctrl_c)
                if word in ("/save", "/load") and word != text:
                    session = _kv_command(engine, session, text, console, ctrl_c)
                elif text in commands:
                    commands[text]()
                elif text in ("/save", "/load"):
                    console.print(f"[red]usage: {text} FILE[/]")
                else:
                    console.print(f"[red]unknown command {escape(text)}[/]; commands: {COMMANDS} (a message "
                                  f'that starts with / goes in a """ block)')
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
