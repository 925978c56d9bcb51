"""The terminal side of a chat turn: a message read from the prompt (a line, a block between two lines of three
double quotes, or a pasted text), Ctrl-C that stops a reply without ending the chat, the prefill's progress bar, a
reply streamed as it is generated (a thinking model's thinking hidden behind a "thinking..." line, or shown dimmed),
and the speed line and usage table after it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.status import Status
from rich.table import Table
from rich.text import Text

DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # SGR: faint, then back to normal
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # bracketed paste: the terminal wraps a pasted text in these
BASE_MODEL = "none: a base model, chatting as plain text"
BLOCK = '"""'  # a line that is exactly this starts, and another ends, a multi-line message


def enable_bracketed_paste() -> bool:
    """Let GNU readline take a pasted multi-line text as one input (CPython turns its bracketed paste off):
    ``input()`` then returns it whole, newlines included. False without readline or on libedit, which has no
    bracketed paste: a pasted text's lines then arrive as lines."""
    try:
        import readline
    except ImportError:
        return False
    if "libedit" in (readline.__doc__ or ""):
        return False
    readline.parse_and_bind("set enable-bracketed-paste on")
    return True


@dataclass(slots=True)
class Message:
    """What the prompt read: ``text``, and ``block``: it came as a block or a paste (always a message, never a
    /command)."""

    text: str
    block: bool = False


def read_message(read_line: Callable[[str], str], prompt: str, more: str) -> Message:
    """One message from the prompt: a line; the lines between a line that is exactly ``BLOCK`` and the next such
    line, joined by newlines; or a bracketed paste whose escapes reach us (stdin without readline: ESC[200~ to
    ESC[201~, across lines), as one text. ``read_line(prompt)`` reads a line (``input``: EOFError at the end,
    which drops an unfinished block); ``more`` prompts the lines of a block."""
    line = read_line(prompt)
    if line.strip() == BLOCK:
        lines = []
        while (line := read_line(more)).strip() != BLOCK:
            lines.append(line)
        return Message("\n".join(lines), block=True)
    if PASTE_START not in line:
        return Message(line, block="\n" in line)  # (readline's bracketed paste: newlines inside)
    text = line.replace(PASTE_START, "")
    while PASTE_END not in text:
        text += "\n" + read_line("")
    return Message(text.replace(PASTE_END, ""), block=True)


class CtrlC:
    """SIGINT while installed (``with CtrlC() as ctrl_c:``). Inside ``ctrl_c.prompt()`` it raises
    KeyboardInterrupt (the input is interrupted); inside ``ctrl_c.turn()`` the first one asks generation to
    stop at the next token (``requested``) and a second one raises; anywhere else it is ignored. So a
    KeyboardInterrupt only comes from inside those blocks, where the caller catches it: a Ctrl-C landing
    between a reply and the next prompt, or during a command, cannot end the session."""

    def __init__(self) -> None:
        self.requested = False
        self.midline = False  # the reply is on the screen without its final newline
        self._raises = self._in_turn = False

    def __enter__(self) -> CtrlC:  # noqa: PYI034 - never subclassed
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    @contextlib.contextmanager
    def prompt(self) -> Iterator[None]:
        self._raises = True
        try:
            yield
        finally:  # (a Ctrl-C before this line raises inside the block still)
            self._raises = False

    @contextlib.contextmanager
    def turn(self) -> Iterator[CtrlC]:
        self.requested = self.midline = False
        self._in_turn = True
        try:
            yield self
        finally:
            self._in_turn = self._raises = False

    def _handle(self, signum: int, frame: object) -> None:
        if self._raises:
            raise KeyboardInterrupt
        if self._in_turn:
            self.requested = self._raises = True  # the next one raises


class TokensPerSecond(ProgressColumn):
    """The prefill's speed over rich's recent samples ("" until there are two)."""

    def render(self, task) -> Text:
        return Text(f"{task.speed:,.0f} tok/s" if task.speed else "", style="progress.data.speed")


class PrefillBar:
    """A progress bar on ``err`` while a prompt of more than one chunk is read: tokens, tok/s, time left."""

    def __init__(self, err: Console, chunk: int, what: str = "reading the prompt"):
        self.err, self.chunk, self.what = err, chunk, what
        self.progress: Progress | None = None

    def update(self, done: int, total: int) -> None:
        if total <= self.chunk or done >= total:
            return
        if self.progress is None:
            self.progress = Progress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                                     TokensPerSecond(), TimeRemainingColumn(), console=self.err, transient=True)
            self.progress.start()
            self.progress.add_task("prefill", total=total)
        self.progress.update(self.progress.task_ids[0], completed=done)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class Thinking:
    """A thinking model's think block on the terminal: hidden behind a dim "thinking..." line on ``err`` (a
    terminal) while it streams, or with ``show`` written to ``out`` dimmed (where ``out`` is a terminal), a
    blank line between it and the answer."""

    def __init__(self, out: TextIO, err: Console, show: bool):
        self.out, self.err, self.show = out, err, show
        self.dim = show and out.isatty()
        self.status: Status | None = None
        self.open = False  # thinking is on the screen, the answer not yet

    def piece(self, text: str) -> str:
        """What to write to ``out`` for a piece of thinking."""
        if not self.show:
            if self.status is None and self.err.is_terminal:
                self.status = Status("[dim]thinking...[/]", console=self.err, spinner="dots")
                self.status.start()
            return ""
        first, self.open = not self.open, True
        return (DIM if self.dim and first else "") + text

    def end(self) -> str:
        """What to write before the answer (or at the reply's end): the thinking closed."""
        self.stop()
        if not self.open:
            return ""
        self.open = False
        return (PLAIN if self.dim else "") + "\n\n"

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def stream_reply(session, text: str, out: TextIO, err: Console, ctrl_c: CtrlC, show_progress: bool,
                 show_thinking: bool = False):
    """Send ``text``, streaming the reply to ``out``; a progress bar on ``err`` while a long prompt is read;
    a think block hidden (a "thinking..." line on ``err``) or, with ``show_thinking``, shown dimmed."""
    bar = PrefillBar(err, session.engine.config.chunk_size)
    thinking = Thinking(out, err, show_thinking)

    def on_progress(done: int, total: int) -> None:
        if ctrl_c.requested:
            raise KeyboardInterrupt  # between prefill chunks: the turn is dropped, the cache stays valid
        if show_progress:
            bar.update(done, total)

    def write(piece: str) -> None:
        if piece:
            out.write(piece)
            out.flush()
            ctrl_c.midline = not piece.endswith("\n")

    def on_thinking(piece: str) -> None:
        bar.stop()  # (before the "thinking..." line: one live display at a time)
        write(thinking.piece(piece))

    def on_text(piece: str) -> None:
        bar.stop()
        write(thinking.end() + piece)

    try:
        return session.send(text, on_text=on_text, on_progress=on_progress, should_stop=lambda: ctrl_c.requested,
                            on_thinking=on_thinking)
    finally:
        bar.stop()
        if thinking.open:  # the reply ended while thinking: the terminal's colour back to normal
            out.write(PLAIN if thinking.dim else "")
            out.flush()
        thinking.stop()


def stats_line(s) -> str:
    """A turn's stats (``TurnStats``) in a line: the first token's wait (from the end of the prefill, its
    decode step included) apart from the steady decode speed after it; "-" where there is none (no token, or
    one token)."""
    first = f"{s.first_token_s:.2f} s" if s.new_tokens else "-"
    decode = f"{s.decode_tok_s:.1f} tok/s" if s.new_tokens > 1 else "-"
    return (f"{s.prompt_tokens} prompt tokens, prefill {s.prefill_tok_s:.1f} tok/s, "
            f"{s.new_tokens} new tokens, first token {first}, decode {decode}, "
            f"context {s.context_tokens}/{s.max_seq_len}")


def stats_table(session) -> Table:
    s = session.stats()
    t = Table(show_header=False, box=None, padding=(0, 2))
    t.add_row("turns", str(s.turns))
    t.add_row("chat template", "yes" if session.engine.tokenizer.chat_template else BASE_MODEL)
    t.add_row("context", f"{s.context_tokens} / {s.max_seq_len} tokens")
    t.add_row("KV cache", f"{s.kv_cache_bytes / 2**20:.1f} MiB")
    if s.state_bytes:
        t.add_row("recurrent state", f"{s.state_bytes / 2**20:.1f} MiB (with its checkpoints)")
    t.add_row("model load", f"{s.load_s:.2f} s")
    t.add_row("prefilled", f"{s.prompt_tokens} tokens in {s.prefill_s:.2f} s")
    t.add_row("generated", f"{s.new_tokens} tokens in {s.decode_s:.2f} s (first tokens "
                           f"{s.first_token_s:.2f} s, then {s.decode_tok_s:.1f} tok/s)")
    if s.last is not None:
        t.add_row("last reply", stats_line(s.last))
    return t
