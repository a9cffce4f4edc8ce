"""Chat with a Qwen model in the terminal: `python chat.py --model Qwen/Qwen3-0.6B`.

A thin command line over `nanoqwen.LLM`. Each turn renders the whole conversation through
the model's chat template and streams the reply with `LLM.stream`. Re-sending everything
every turn is cheap because the engine's prefix cache keeps the KV pages of the previous
turn (its prompt and its reply): turn N+1 only computes what is new. The dim status line
after each reply shows it, as "prompt tokens from cache".

Qwen3 reasons inside `<think>…</think>` before it answers. `ThinkSplitter` separates the two
while the text streams in, so the reasoning is shown dimmed above the answer; `--no-think`
asks the chat template to skip reasoning (`enable_thinking=False`). The reply kept in the
conversation is the raw text, tags included: Qwen3's template drops old reasoning itself.

Until the first token a spinner counts the seconds (the prompt's prefill can take a while on
a CPU). The reply then streams, broken into lines between words (`WordWrapper`).

Ctrl-C during a reply stops it. The interrupt is only noted while the engine works and acted
on between steps (an exception in the middle of a step could leave the scheduler half
updated); the tokens of the step it interrupted are dropped, and closing the stream aborts
the request and frees its pages. The interrupted reply stays in the conversation as far as
it was shown, so the model sees what the user saw. The terminal does not echo "^C" into the
reply meanwhile. Ctrl-C or Ctrl-D at the prompt exits.

The prompt belongs to the line editor (readline's `input(prompt)`), so editing a line or
recalling history redraws it instead of wiping it. Typed lines are kept between runs in the
user's data directory.

Only the known commands are commands; any other line, `/usr/bin` included, is a message,
and `//text` sends `/text`. Changing the system prompt starts a new conversation: the
system prompt comes first in the rendered prompt, so nothing cached would be reused anyway,
and the model never sees a conversation it did not start under that prompt.

One conversation runs one request at a time, so the KV cache is sized for one sequence of
`--max-model-len` tokens; on a CPU that defaults to at most `CPU_CONTEXT` tokens rather than
the model's full context (often 32k or more, gigabytes of KV memory).

When stdin is not a terminal (`printf 'hi\\nmore\\n' | python chat.py`), every line is one
user message (or command) and only the answers are printed, one per message, reasoning
left out, so the chat can be scripted.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import click
from rich import box
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.filesize import decimal
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.table import Table

from nanoqwen import LLM, RequestOutput, SamplingParams
from nanoqwen.cli import (
    config_option,
    describe_engine,
    engine_options,
    in_flags,
    model_option,
    pop_engine_options,
    quiet_library_noise,
)
from nanoqwen.config import resolve_device
from nanoqwen.sampling.params import DEFAULTABLE_SETTINGS
from nanoqwen.text.chat_template import default_system_prompt
from nanoqwen.text.generation_config import FALLBACK_SAMPLING
from nanoqwen.text.stop_strings import partial_match_length
from nanoqwen.weights import loader
from nanoqwen.weights.checkpoint import read_checkpoint, resolve_model_path

try:  # not on every platform; where present, input() gets line editing and history
    import readline
except ImportError:
    readline = None
try:  # POSIX terminals: what the terminal echoes
    import termios
except ImportError:
    termios = None

THINK_START, THINK_END = "<think>", "</think>"
PROMPT = "[bold cyan]you ›[/] "
CLEAR_SYSTEM = "--clear"
COMMANDS = ("/reset", "/system", "/stats", "/help", "/exit", "/quit")
SEPARATOR = " · "
HELP = [
    "Commands: /reset (new conversation)", "/system (show the system prompt)",
    f"/system TEXT, /system {CLEAR_SYSTEM} (new conversation with that system prompt, or none)",
    "/stats", "/help", "/exit", "//text sends /text", "Ctrl-C stops a reply",
]
HISTORY_LENGTH = 1000  # lines kept between runs
# chat's longest conversation on a CPU unless --max-model-len says otherwise: a long chat
# fits, and the KV cache stays a fraction of what the model's full context would take.
CPU_CONTEXT = 8192
Message = dict[str, str]


# --------------------------------------------------------------------------- thinking
class Segment(NamedTuple):
    text: str
    thinking: bool


class ThinkSplitter:
    """Splits streamed text into reasoning and answer segments, dropping the tags.

    A tag can arrive cut in two ("<thi" then "nk>"), so a tail that could begin the next
    tag is held back until the following delta settles it. The newlines that follow a tag
    are dropped too, so the reasoning and the answer each start with their first line.
    """

    def __init__(self) -> None:
        self.thinking = False
        self._held_back = ""
        self._strip_newlines = False  # just after a tag

    def feed(self, delta: str) -> list[Segment]:
        text, self._held_back = self._held_back + delta, ""
        segments: list[Segment] = []
        while (index := text.find(self._next_tag)) >= 0:
            self._emit(segments, text[:index])
            text = text[index + len(self._next_tag) :]
            self.thinking = not self.thinking
            self._strip_newlines = True
        keep = partial_match_length(text, [self._next_tag])
        self._emit(segments, text[: len(text) - keep])
        self._held_back = text[len(text) - keep :]
        return segments

    def flush(self) -> list[Segment]:
        """The stream ended: a held-back tail was not a tag after all."""
        segments: list[Segment] = []
        self._emit(segments, self._held_back)
        self._held_back = ""
        return segments

    @property
    def _next_tag(self) -> str:
        return THINK_END if self.thinking else THINK_START

    def _emit(self, segments: list[Segment], text: str) -> None:
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        if text:
            segments.append(Segment(text, self.thinking))


# --------------------------------------------------------------------------- one reply
@dataclass
class ReplyStats:
    """What the status line reports about one reply."""

    prompt_tokens: int
    cached_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token: float | None = None  # seconds from submitting the prompt
    decode_seconds: float = 0.0  # from the first token to the last
    interrupted: bool = False

    def record(self, output: RequestOutput, elapsed: float) -> None:
        self.cached_tokens = output.num_cached_tokens
        if not output.delta_token_ids:
            return
        self.generated_tokens += len(output.delta_token_ids)
        if self.time_to_first_token is None:
            self.time_to_first_token = elapsed
        self.decode_seconds = elapsed - self.time_to_first_token

    def status_line(self) -> str:
        parts = [f"{self.generated_tokens} tokens"]
        if self.generated_tokens > 1 and self.decode_seconds > 0:
            # The first token's time is prefill, reported separately as time to first token.
            parts.append(f"{(self.generated_tokens - 1) / self.decode_seconds:.1f} tok/s")
        if self.time_to_first_token is not None:
            parts.append(f"first token {self.time_to_first_token:.2f} s")
        parts.append(f"{self.cached_tokens}/{self.prompt_tokens} prompt tokens from cache")
        if self.interrupted:
            parts.append("interrupted")
        return " · ".join(parts)


@contextmanager
def deferred_interrupt() -> Iterator[threading.Event]:
    """Within the block Ctrl-C sets the yielded flag instead of raising KeyboardInterrupt."""
    pressed = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def keys_not_echoed(stream: TextIO) -> Iterator[None]:
    """Within the block the terminal on `stream` echoes no keys: not Ctrl-C as "^C" in the
    middle of the reply, nor a line typed ahead (the line editor shows that one once the
    prompt is back)."""
    if termios is None or not stream.isatty():
        yield
        return
    descriptor = stream.fileno()
    saved = termios.tcgetattr(descriptor)
    silent = list(saved)
    silent[3] &= ~termios.ECHO  # the local modes
    termios.tcsetattr(descriptor, termios.TCSANOW, silent)
    try:
        yield
    finally:
        termios.tcsetattr(descriptor, termios.TCSANOW, saved)


class Waiting:
    """A spinner and the seconds since `start`, redrawn by rich's `Live` until the first
    token: a long prompt's prefill can take seconds on a CPU."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.spinner = Spinner("dots", style="dim")

    def __rich__(self) -> RenderableType:
        self.spinner.update(text=f"[dim]thinking… {time.perf_counter() - self.start:.1f} s[/]")
        return self.spinner


class WordWrapper:
    """Writes streamed text, starting a new line before a word that would not fit on this
    one: left alone, a terminal breaks lines wherever the edge falls, mid-word.

    Text arrives a token at a time, so the word being written is held back until a space
    or a newline ends it (or `flush()`), when its width on screen is known. A word wider
    than the whole line is left to the terminal. Without `wrap` the text passes unchanged.
    """

    def __init__(self, console: Console, wrap: bool) -> None:
        self.console = console
        self.wrap = wrap
        self.column = 0  # cells written on the current line
        self.word = ""
        self.style = ""

    def write(self, text: str, style: str = "") -> None:
        if style != self.style:
            self.flush()
            self.style = style
        for piece in re.split(r"([ \n])", text):
            if piece in (" ", "\n"):
                self.flush()
                self._put(piece)
            else:
                self.word += piece

    def flush(self) -> None:
        """Write the word held back."""
        word, self.word = self.word, ""
        if self.wrap and self.column and self.column + cell_len(word) > self.console.width:
            self._put("\n")
        self._put(word)

    def _put(self, text: str) -> None:
        if not text:
            return
        if self.wrap and text == " " and self.column >= self.console.width:
            text = "\n"  # rather than a space at the start of the next line
        self.console.out(text, style=self.style or None, end="")
        self.column = 0 if text == "\n" else self.column + cell_len(text)


class ReplyPrinter:
    """Prints a reply as it streams: reasoning dimmed (when shown), then the answer, broken
    between words when `wrap`; `finish()` writes what is held back."""

    def __init__(self, console: Console, show_thinking: bool, wrap: bool = False) -> None:
        self.writer = WordWrapper(console, wrap)
        self.show_thinking = show_thinking
        self._after_thinking = False

    def print(self, segments: list[Segment]) -> None:
        for segment in segments:
            if segment.thinking:
                if self.show_thinking:
                    self.writer.write(segment.text, style="dim italic")
                    self._after_thinking = True
                continue
            if self._after_thinking:
                self.writer.write("\n")  # a blank line between reasoning and answer
                self._after_thinking = False
            self.writer.write(segment.text)

    def finish(self) -> None:
        self.writer.flush()


# --------------------------------------------------------------------------- the session
class ChatSession:
    """A conversation with the model and the commands that act on it."""

    def __init__(
        self,
        llm: LLM,
        params: SamplingParams,
        enable_thinking: bool | None,
        system: str | None,
        console: Console,
        interactive: bool,
    ) -> None:
        self.llm = llm
        self.params = params
        self.enable_thinking = enable_thinking
        self.system = system
        self.console = console
        self.interactive = interactive
        self.messages: list[Message] = []

    def conversation(self) -> list[Message]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def handle(self, line: str) -> bool:
        """Act on one line of input; False means the user asked to leave."""
        command, _, argument = line.partition(" ")
        if command not in COMMANDS:  # a message, even one like "/usr/bin"; "//x" sends "/x"
            self.reply(line[1:] if line.startswith("//") else line)
            return True
        if command in ("/exit", "/quit"):
            return False
        if command == "/reset":
            self.messages = []
            self._notice("New conversation.")
        elif command == "/system":
            self._system_command(argument.strip())
        elif command == "/stats":
            self.console.print(stats_table(self.llm.stats()))
        else:
            self.console.print(fit_lines(HELP, self.console.width), markup=False)
        return True

    def _system_command(self, argument: str) -> None:
        """Show the system prompt, or start a new conversation with another one (or none).

        Keeping the history under a new system prompt would recompute all of it (the system
        prompt comes first, so no cached page matches) and show the model a conversation it
        never had; a new conversation says plainly what happens.
        """
        if not argument:
            self.console.print(self._describe_system_prompt(), markup=False)
            return
        self.system = None if argument == CLEAR_SYSTEM else argument
        self.messages = []
        if self.system:
            self._notice(f"New conversation with the system prompt: {self.system}")
        else:
            self._notice("New conversation without a system prompt.")

    def _describe_system_prompt(self) -> str:
        if self.system:
            return f"System prompt: {self.system}"
        default = default_system_prompt(self.llm.engine.tokenizer)
        if default is None:
            return "No system prompt."
        return f"No system prompt of yours; the chat template adds its own: {default}"

    def reply(self, user_text: str) -> None:
        self.messages.append({"role": "user", "content": user_text})
        prompt_ids = self.llm.chat_prompt(self.conversation(), self.enable_thinking)
        try:
            text, stats = self._stream(prompt_ids)
        except ValueError as error:  # the prompt was refused, e.g. longer than max_model_len
            self.messages.pop()
            self.console.print(
                f"error: {error}. /reset starts over; --max-model-len allows longer chats.",
                style="red", markup=False,
            )
            return
        self.messages.append({"role": "assistant", "content": text})
        if self.interactive:
            self.console.print(stats.status_line(), style="dim", markup=False)

    def _stream(self, prompt_ids: list[int]) -> tuple[str, ReplyStats]:
        stats = ReplyStats(prompt_tokens=len(prompt_ids))
        splitter = ThinkSplitter()
        printer = ReplyPrinter(self.console, show_thinking=self.interactive, wrap=self.interactive)
        text = ""
        start = time.perf_counter()
        waiting = Live(Waiting(start), console=self.console, transient=True)
        with deferred_interrupt() as interrupted, keys_not_echoed(sys.stdin), (
            waiting if self.interactive else nullcontext()
        ), closing(self.llm.stream(prompt_ids, self.params)) as stream:
            for output in stream:
                if interrupted.is_set():  # during this step: its tokens are not shown
                    stats.interrupted = True
                    break  # leaving `closing` aborts the request
                if output.delta_token_ids:
                    waiting.stop()
                stats.record(output, time.perf_counter() - start)
                printer.print(splitter.feed(output.delta_text))
                text = output.text
        printer.print(splitter.flush())
        printer.finish()
        self.console.out("")
        return text, stats

    def _notice(self, text: str) -> None:
        if self.interactive:
            self.console.print(text, style="dim", markup=False)


def stats_table(stats: dict[str, dict[str, Any]]) -> Table:
    """`LLM.stats()` as a table, group by group (nanoqwen/stats.py describes each figure)."""
    table = Table("group", "figure", "value", box=box.SIMPLE, title="Engine stats")
    table.columns[2].justify = "right"
    for group, figures in stats.items():
        table.add_section()  # a line between groups (none before the first)
        for index, (name, value) in enumerate(figures.items()):
            table.add_row(group if index == 0 else "", name, show_figure(name, value))
    return table


def show_figure(name: str, value: Any) -> str:
    """A figure as people read it: sizes in kB/MB/GB, rates in percent, counts by cause."""
    if isinstance(value, dict):  # e.g. finished requests by reason
        return ", ".join(f"{key} {count}" for key, count in value.items())
    if name == "bytes" or name.endswith("_bytes"):
        return decimal(value)
    if name.endswith("rate"):
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return f"{value:,}"


def read_lines(console: Console, interactive: bool) -> Iterator[str]:
    """User input, one stripped non-empty line at a time, until EOF, Ctrl-D or Ctrl-C."""
    lines = _typed_lines(editor_prompt(console, PROMPT)) if interactive else sys.stdin
    try:
        for line in lines:
            if line.strip():
                yield line.strip()
    except (EOFError, KeyboardInterrupt):
        console.out("")


def _typed_lines(prompt: str) -> Iterator[str]:
    while True:
        yield input(prompt)


def editor_prompt(console: Console, markup: str) -> str:
    """`markup` rendered for `input()`, which lets the line editor redraw it with the line.

    Printed by anyone else, the prompt is wiped when the editor redraws the line (Ctrl-U,
    history). readline measures the prompt to place the cursor, so its colour codes, which
    take no room on screen, are wrapped in \\001 and \\002 to be left out of the count.
    """
    with console.capture() as captured:
        console.print(markup, end="")
    return re.sub(r"(\x1b\[[0-9;]*m)", "\001\\1\002", captured.get())


def history_file() -> Path:
    """Where typed lines are kept between runs: the user's data directory (XDG)."""
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "nanoqwen" / "chat_history"


@contextmanager
def line_history(console: Console) -> Iterator[None]:
    """Up-arrow recalls lines of earlier runs too; the last `HISTORY_LENGTH` are saved."""
    if readline is None:
        yield
        return
    path = history_file()
    with suppress(FileNotFoundError):
        readline.read_history_file(path)
    readline.set_history_length(HISTORY_LENGTH)
    try:
        yield
    finally:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError as error:
            console.print(f"history not saved: {error}", style="dim", markup=False)


def load(model: str, console: Console, options: dict[str, Any]) -> LLM:
    """Find (or download) the checkpoint, then build the engine, with a spinner meanwhile."""
    with console.status(f"Finding {model}…"):
        try:
            model_dir = resolve_model_path(model)
        except ValueError as error:  # it already says what to pass instead
            raise click.ClickException(f"--model: {error}") from None
    with console.status("Loading weights and warming up…") as status:
        loader.on_tensor_loaded = lambda done, total: status.update(
            f"Loading weights {done}/{total} tensors…" if done < total else "Warming up…"
        )
        try:
            return LLM(model_dir, **one_conversation(model_dir, options))
        except (ValueError, OSError) as error:
            raise click.ClickException(in_flags(str(error).splitlines()[0])) from None
        finally:
            loader.on_tensor_loaded = None


def one_conversation(model_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """Engine options with a KV cache for one sequence of `max_model_len` tokens.

    The engine's own default makes room for many sequences; a chat runs one. Without
    `--max-model-len` that is the model's context, capped at `CPU_CONTEXT` on a CPU.
    `--num-pages` or `--kv-cache-memory` size the cache themselves.
    """
    options = dict(options)
    if "max_model_len" not in options:
        context = read_checkpoint(model_dir).model_config.max_position_embeddings
        if resolve_device(options.get("device")).type == "cpu":
            context = min(context, CPU_CONTEXT)
        options["max_model_len"] = context
    if "num_pages" not in options and "kv_cache_memory" not in options:
        pages = -(-options["max_model_len"] // options["page_size"])
        options["num_pages"] = pages + 1  # the pool keeps one page as scratch
    return options


def sampling_params(llm: LLM, options: dict[str, Any]) -> SamplingParams:
    """The options given on the command line; the engine fills in the rest from the
    model's recommended settings, as for any request. Applied here too, to show them."""
    given = {name: value for name, value in options.items() if value is not None}
    return SamplingParams(**given).with_defaults(llm.engine.sampling_defaults)


def banner(
    llm: LLM, model: str, params: SamplingParams, load_seconds: float, width: int
) -> str:
    """What runs where, how much conversation the KV cache holds, and how replies sample,
    in lines of at most `width` cells."""
    engine = describe_engine(llm.engine).split(SEPARATOR)
    fields = [f"{model} on {engine[0]}", *engine[1:], f"loaded in {load_seconds:.1f} s"]
    text = escape(fit_lines(fields, width)).replace(escape(model), f"[bold]{escape(model)}[/]", 1)
    settings = ", ".join(f"{name} {getattr(params, name)}" for name in DEFAULTABLE_SETTINGS)
    return f"{text}\n[dim]sampling: {escape(settings)}[/]"


def fit_lines(fields: list[str], width: int) -> str:
    """`fields` joined by " · " in lines of at most `width` cells, broken between fields
    only (a field wider than a line gets one of its own), so no line starts or ends with
    the separator."""
    lines = [fields[0]]
    for field in fields[1:]:
        joined = lines[-1] + SEPARATOR + field
        if cell_len(joined) <= width:
            lines[-1] = joined
        else:
            lines.append(field)
    return "\n".join(lines)


SAMPLING_HELP = (
    "Sampling options left out take the model's settings from its generation_config.json "
    "or, when it has none, "
    + ", ".join(f"{name} {value}" for name, value in FALLBACK_SAMPLING.items())
    + " (and min_p, repetition_penalty off)."
)
MAX_MODEL_LEN_HELP = (
    "Longest conversation, prompt plus reply, in tokens; the KV cache holds that much. "
    f"Default: the model's context, at most {CPU_CONTEXT} on a CPU."
)


# One conversation runs one request at a time: no KV memory or graphs for a bigger batch.
@click.command(
    epilog=SAMPLING_HELP,
    context_settings={
        "show_default": True,
        "help_option_names": ["-h", "--help"],
        "default_map": {"max_num_seqs": 1},
    },
)
@config_option
@model_option(default="Qwen/Qwen3-0.6B")
@click.option("--system", default=None, help="System prompt.")
@click.option("--temperature", type=click.FloatRange(min=0),
              help="0 is greedy. Default: the model's.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Default: the model's.")
@click.option("--top-k", type=click.IntRange(min=0), help="0 turns it off. Default: the model's.")
@click.option("--min-p", type=click.FloatRange(0, 1), help="0 turns it off. Default: the model's.")
@click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True),
              help="1 turns it off. Default: the model's.")
@click.option("--max-tokens", default=2048, type=click.IntRange(min=1),
              help="Most tokens in one reply.")
@click.option("--seed", default=None, type=int, help="Sampling seed, for repeatable replies.")
@click.option("--no-think", is_flag=True, help="Ask Qwen3 to answer without reasoning first.")
@engine_options
def main(model: str, system: str | None, no_think: bool, **options: Any) -> None:
    """Chat with a Qwen2/Qwen3 model in the terminal; replies stream as they are generated."""
    quiet_library_noise()
    interactive = sys.stdin.isatty()
    # Scripted output keeps each line whole, however long; a terminal's is wrapped to fit.
    console = Console(highlight=False, soft_wrap=not interactive)
    engine = pop_engine_options(options)
    started = time.perf_counter()
    llm = load(model, console, engine)
    try:
        params = sampling_params(llm, options)
    except ValueError as error:  # a bad value in generation_config.json
        raise click.ClickException(str(error)) from None
    if interactive:
        console.print(banner(llm, model, params, time.perf_counter() - started, console.width))
        console.print(fit_lines(HELP, console.width), style="dim", markup=False)
    session = ChatSession(llm, params, False if no_think else None, system, console, interactive)
    with line_history(console) if interactive else nullcontext():
        for line in read_lines(console, interactive):
            if not session.handle(line):
                break


# The engine's --max-model-len defaults to the model's context; chat's is capped on a CPU.
next(option for option in main.params if option.name == "max_model_len").help = MAX_MODEL_LEN_HELP


if __name__ == "__main__":
    main()
