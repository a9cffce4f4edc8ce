"""chat.py: the think splitter and status line in process, the CLI end to end.

End-to-end tests drive `python chat.py` against the tiny Qwen3 fixture, either through a
pseudo-terminal (pexpect: the interactive UI, Ctrl-C, line editing) or with piped stdin (the
scripted mode, whose output is compared with the engine's own replies). Past one piped run
and one refusal as a user starts them, the scripted mode's commands and options run the
same click command in this process, with the lines as its stdin (`chat_in_process`).
Greedy decoding with small `--max-tokens` keeps the replies deterministic and short;
`--page-size 4` makes even a short prompt fill whole pages, so the prefix cache has
something to reuse. Line editing is checked on the screen a terminal emulator (pyte)
draws from the pty's output, the way a user sees it. Every test keeps chat's history file
in a temporary data directory.
"""

import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pexpect
import pyte
import pytest
from click.testing import CliRunner, Result
from rich.console import Console
from rich.filesize import decimal

from nanoqwen import LLM, SamplingParams
from nanoqwen.cli import pop_engine_options
from nanoqwen.runner.cuda_graph import default_buckets
from nanoqwen.text.generation_config import FALLBACK_SAMPLING

ROOT = Path(__file__).resolve().parent.parent
CHAT_SCRIPT = ROOT / "chat.py"
SYSTEM = "You are a helpful assistant."
PROMPT = "you ›"
# The dim line after each reply. Terminals may wrap it, so words are apart by any whitespace;
# it ends with a line break, so a match cannot stop short of the " · interrupted" mark.
STATUS = re.compile(
    r"(\d+)\s+tokens\s+·.*?(\d+)/(\d+)\s+prompt\s+tokens\s+from\s+cache(\s+·\s+interrupted)?\r\n",
    re.DOTALL,
)
# Keys as a terminal sends them.
UP, DOWN, CTRL_U = "\x1b[A", "\x1b[B", "\x15"
SCREEN_ROWS, SCREEN_COLUMNS = 50, 120


def import_chat() -> ModuleType:
    """chat.py is a script at the top level, not part of the package."""
    spec = importlib.util.spec_from_file_location("chat", CHAT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


chat = import_chat()


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """chat.py keeps its line history under $XDG_DATA_HOME: here, not in the real home."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data"


def model_copy(model_dir: str, directory: Path, **json_updates: dict[str, Any]) -> str:
    """A copy of a checkpoint with some fields of its JSON files changed, e.g.
    `generation_config={"top_k": 1}` updates generation_config.json."""
    shutil.copytree(model_dir, directory)
    for name, updates in json_updates.items():
        path = directory / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **updates}))
    return str(directory)


# --------------------------------------------------------------------------- in process
def split_all(chunks: list[str]) -> tuple[str, str]:
    """Feed `chunks` to a ThinkSplitter; return (reasoning, answer)."""
    splitter = chat.ThinkSplitter()
    segments = [s for chunk in chunks for s in splitter.feed(chunk)] + splitter.flush()
    thinking = "".join(s.text for s in segments if s.thinking)
    answer = "".join(s.text for s in segments if not s.thinking)
    return thinking, answer


REPLY = "<think>\nweigh a < b\n</think>\n\nThe answer <is> 42."


@pytest.mark.parametrize("cut", range(len(REPLY) + 1))
def test_think_splitter_finds_tags_cut_anywhere(cut: int) -> None:
    assert split_all([REPLY[:cut], REPLY[cut:]]) == ("weigh a < b\n", "The answer <is> 42.")


def test_think_splitter_one_character_at_a_time() -> None:
    assert split_all(list(REPLY)) == ("weigh a < b\n", "The answer <is> 42.")


@pytest.mark.parametrize("text", ["no tags at all", "ends in a partial tag <thin", "x </think> y"])
def test_think_splitter_passes_untagged_text_through(text: str) -> None:
    # A closing tag with no opening one is just text: only "<think>" starts reasoning.
    assert split_all(list(text)) == ("", text)


def test_reply_printer_hides_reasoning_unless_asked() -> None:
    segments = [chat.Segment("pondering\n", True), chat.Segment("Answer.", False)]
    for show_thinking, expected in [(False, "Answer."), (True, "pondering\n\nAnswer.")]:
        file = io.StringIO()
        printer = chat.ReplyPrinter(Console(file=file), show_thinking)
        printer.print(segments)
        printer.finish()
        assert file.getvalue() == expected


TEXT = (
    "Streamed text arrives a token at a time, and a terminal left alone breaks lines "
    "wherever its edge falls.\nA new line starts the count again; averyveryverylongword too."
)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_word_wrapper_breaks_lines_between_words(chunk: int) -> None:
    width = 24
    file = io.StringIO()
    writer = chat.WordWrapper(Console(file=file, width=width), wrap=True)
    for start in range(0, len(TEXT), chunk):
        writer.write(TEXT[start : start + chunk])
    writer.flush()
    lines = file.getvalue().split("\n")
    assert all(len(line.rstrip()) <= width for line in lines), lines
    # The same words in the same order, none cut in two, and the text's own break kept.
    assert file.getvalue().split() == TEXT.split()
    assert len(lines) > TEXT.count("\n") + 1  # lines were broken
    assert any(line.rstrip().endswith("falls.") for line in lines)
    assert any(line.startswith("A new line") for line in lines)


def test_word_wrapper_without_wrap_passes_text_unchanged() -> None:
    file = io.StringIO()
    writer = chat.WordWrapper(Console(file=file, width=10), wrap=False)
    for piece in TEXT.split(" "):
        writer.write(piece + " ")
    writer.flush()
    assert file.getvalue() == TEXT + " "


def fake_output(new_tokens: int) -> SimpleNamespace:
    """The fields of a RequestOutput that the status line reads."""
    return SimpleNamespace(delta_token_ids=[1] * new_tokens, num_cached_tokens=32)


def test_status_line_reports_decode_rate_first_token_and_cache() -> None:
    stats = chat.ReplyStats(prompt_tokens=40)
    stats.record(fake_output(0), elapsed=0.1)  # a prefill chunk: no token yet
    stats.record(fake_output(1), elapsed=0.25)
    stats.record(fake_output(10), elapsed=2.25)
    line = stats.status_line()
    assert line == "11 tokens · 5.0 tok/s · first token 0.25 s · 32/40 prompt tokens from cache"
    stats.interrupted = True
    assert stats.status_line().endswith(" · interrupted")


def test_deferred_interrupt_turns_ctrl_c_into_a_flag() -> None:
    before = signal.getsignal(signal.SIGINT)
    with chat.deferred_interrupt() as pressed:
        assert not pressed.is_set()
        signal.raise_signal(signal.SIGINT)  # would raise KeyboardInterrupt outside the block
        assert pressed.is_set()
    assert signal.getsignal(signal.SIGINT) is before


def test_tokens_of_the_step_ctrl_c_interrupts_are_not_shown(qwen3_dir: str) -> None:
    """Ctrl-C pressed while the engine computes a step: that step's token is not printed
    (nor counted, nor kept in the conversation), and the request is aborted."""
    llm, params = oracle(qwen3_dir, max_tokens=50)
    shown = 3

    def pressed_during_step(prompt: list[int], params: SamplingParams) -> Iterator[Any]:
        for index, output in enumerate(real_stream(prompt, params)):
            if index == shown:
                signal.raise_signal(signal.SIGINT)  # as the user's key lands mid-step
            yield output

    real_stream = llm.stream
    llm.stream = pressed_during_step
    file = io.StringIO()
    session = chat.ChatSession(llm, params, None, None, Console(file=file), interactive=False)
    session.reply("hello there friend")
    prompt = llm.chat_prompt([{"role": "user", "content": "hello there friend"}])
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=shown))[0].text
    assert file.getvalue() == expected + "\n"
    assert session.messages[-1] == {"role": "assistant", "content": expected}
    assert llm.stats()["requests"]["finished"]["abort"] == 1


def test_system_command_names_the_templates_own_default(qwen3_dir: str, tmp_path: Path) -> None:
    """A template that writes a system prompt into conversations without one (Qwen2.5's
    does): /system says what it writes instead of "No system prompt."."""
    model = model_copy(qwen3_dir, tmp_path / "model")
    (Path(model) / "chat_template.jinja").write_text(DEFAULT_SYSTEM_TEMPLATE)
    args = ["--model", model, "--device", "cpu", "--max-tokens", "4"]
    result = chat_in_process(args, ["/system"])
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"No system prompt of yours; the chat template adds its own: {QWEN25_DEFAULT}\n"
    )


# The shape of Qwen2.5's chat template, without tools: its own system prompt when the
# conversation brings none.
QWEN25_DEFAULT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DEFAULT_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\n" + QWEN25_DEFAULT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# --------------------------------------------------------------------------- the CLI
def chat_args(model_dir: str, *extra: str, greedy: bool = True) -> list[str]:
    """chat.py's options (after the script's name on a command line)."""
    sampling = ["--temperature", "0"] if greedy else []
    return ["--model", model_dir, "--device", "cpu", *sampling, "--page-size", "4",
            "--system", SYSTEM, *extra]


def run_piped(args: list[str], lines: list[str]) -> subprocess.CompletedProcess:
    """`python chat.py ARGS` with `lines` piped to its stdin."""
    return subprocess.run(
        [sys.executable, str(CHAT_SCRIPT), *args], input="".join(f"{line}\n" for line in lines),
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def chat_in_process(args: list[str], lines: list[str]) -> Result:
    """chat.py's command in this process, `lines` on its stdin (not a terminal, as a pipe)."""
    return CliRunner().invoke(chat.main, args, input="".join(f"{line}\n" for line in lines))


def oracle(model_dir: str, max_tokens: int) -> tuple[LLM, SamplingParams]:
    """An engine set up as chat.py sets it up, for greedy replies to compare with."""
    llm = LLM(model_dir, device="cpu", page_size=4, max_num_seqs=1)
    return llm, SamplingParams(temperature=0, max_tokens=max_tokens)


def converse(
    llm: LLM, params: SamplingParams, messages: list[dict[str, str]], text: str,
    enable_thinking: bool | None = None,
) -> str:
    """Add a user message and the engine's reply to `messages`; return the reply."""
    messages.append({"role": "user", "content": text})
    reply = llm.generate(llm.chat_prompt(messages, enable_thinking), params)[0].text
    messages.append({"role": "assistant", "content": reply})
    return reply


def system(content: str = SYSTEM) -> dict[str, str]:
    return {"role": "system", "content": content}


def test_piped_stdin_gets_one_plain_reply_per_line(qwen3_dir: str) -> None:
    result = run_piped(chat_args(qwen3_dir, "--max-tokens", "8"), ["hello there", "and then?"])
    assert result.returncode == 0, result.stderr
    llm, params = oracle(qwen3_dir, max_tokens=8)
    messages = [system()]
    first = converse(llm, params, messages, "hello there")
    second = converse(llm, params, messages, "and then?")
    assert result.stdout == f"{first}\n{second}\n"


def test_piped_commands_and_messages_that_start_with_a_slash(qwen3_dir: str) -> None:
    lines = [
        "/system", "/system Be terse.", "hi", "/system", "/reset", "", "hello again",
        "/system Be brief.", "once more", "/system --clear", "/system",
        "/usr/bin is a folder", "//reset", "/stats", "/exit", "unread",
    ]
    result = chat_in_process(chat_args(qwen3_dir, "--max-tokens", "6", "--no-think"), lines)
    assert result.exit_code == 0, result.output
    llm, params = oracle(qwen3_dir, max_tokens=6)

    def answer(messages: list[dict[str, str]], text: str) -> str:
        return converse(llm, params, messages, text, enable_thinking=False)

    expected = [
        f"System prompt: {SYSTEM}",
        answer([system("Be terse.")], "hi"),
        "System prompt: Be terse.",
        answer([system("Be terse.")], "hello again"),  # /reset keeps the system prompt
        answer([system("Be brief.")], "once more"),  # /system TEXT starts a new conversation
        "No system prompt.",
    ]
    # Not commands, so messages: a path, and "//reset" sent as "/reset".
    unknown: list[dict[str, str]] = []
    expected += [answer(unknown, "/usr/bin is a folder"), answer(unknown, "/reset")]
    replies = "".join(f"{line}\n" for line in expected)
    assert result.stdout.startswith(replies)
    table = result.stdout[len(replies) :]
    assert re.search(r"pages_used\s+0\b", table)
    # Nothing after the table (its last row is the engine's last figure): the line after
    # /exit was never answered.
    *_, last_group = llm.stats().values()
    assert table.rstrip().splitlines()[-1].split()[0] == list(last_group)[-1]


def test_sampling_defaults_come_from_generation_config_and_options_override_them(
    qwen3_dir: str, tmp_path: Path
) -> None:
    # top_k 1 samples greedily whatever the temperature: the model's settings decide alone.
    model = model_copy(
        qwen3_dir, tmp_path / "model",
        generation_config={"do_sample": True, "temperature": 0.2, "top_p": 0.8, "top_k": 1},
    )
    llm, greedy = oracle(model, max_tokens=8)
    by_the_model = chat_in_process(
        chat_args(model, "--max-tokens", "8", greedy=False), ["hello there"]
    )
    assert by_the_model.exit_code == 0, by_the_model.output
    assert by_the_model.stdout == f"{converse(llm, greedy, [system()], 'hello there')}\n"

    # Options given override the model's settings; the ones left out still come from it (the
    # fallback's temperature 0.6 or top_p 0.95 would each sample other tokens with this seed).
    args = chat_args(model, "--max-tokens", "8", "--top-k", "0", "--seed", "7", greedy=False)
    overridden = chat_in_process(args, ["hello there"])
    assert overridden.exit_code == 0, overridden.output
    sampled = SamplingParams(temperature=0.2, top_p=0.8, top_k=0, seed=7, max_tokens=8)
    assert overridden.stdout == f"{converse(llm, sampled, [system()], 'hello there')}\n"


def test_help_says_where_sampling_defaults_come_from() -> None:
    result = CliRunner().invoke(chat.main, ["-h"])
    assert result.exit_code == 0, result.output
    help_text = " ".join(result.stdout.split())  # click wraps lines
    assert "--model TEXT A Hugging Face hub id, a local checkpoint directory or a .gguf file" in (
        help_text
    )
    assert "generation_config.json" in help_text
    for name, value in FALLBACK_SAMPLING.items():
        assert f"{name} {value}" in help_text


def test_chat_sizes_its_engine_for_one_conversation(qwen3_dir: str) -> None:
    """One conversation runs one request at a time: one sequence (on a GPU: one decode
    graph, and a memory profile of one sequence), and a KV cache for its length."""
    context = chat.main.make_context("chat.py", ["--model", qwen3_dir, "--device", "cpu"])
    options = pop_engine_options(dict(context.params))
    assert options["max_num_seqs"] == 1
    assert default_buckets(options["max_num_seqs"]) == [1]
    sized = chat.one_conversation(qwen3_dir, options)
    assert sized["num_pages"] == 1 + -(-sized["max_model_len"] // sized["page_size"])


def test_kv_cache_holds_one_conversation_of_max_model_len(qwen3_dir: str) -> None:
    options = chat.one_conversation(qwen3_dir, {"device": "cpu", "page_size": 4, "max_model_len": 101})
    llm = LLM(qwen3_dir, **options)
    assert llm.stats()["kv_cache"]["pages_total"] == 26  # 101 tokens in pages of 4
    # A conversation of exactly max_model_len tokens fits, with no preemption.
    prompt = list(range(10, 110))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    output = llm.generate([prompt], params)[0]
    assert len(prompt) + len(output.token_ids) == 101 and output.finish_reason == "length"
    assert llm.stats()["requests"]["preemptions"] == 0
    # A cache size given in bytes or pages is left to the engine.
    given = chat.one_conversation(qwen3_dir, {"page_size": 4, "kv_cache_memory": 10**6})
    assert "num_pages" not in given


def test_unknown_model_is_one_line_that_names_the_option(tmp_path: Path) -> None:
    # The default hub model, with the hub offline and an empty cache: it cannot be found.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(CHAT_SCRIPT)], stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=120, env=env,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    # The loader's own message, which already says what to pass instead, said once.
    loader = subprocess.run(
        [sys.executable, "-c", "from nanoqwen.weights.checkpoint import resolve_model_path\n"
         "try:\n    resolve_model_path('Qwen/Qwen3-0.6B')\n"
         "except ValueError as error:\n    print(error)"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert "Qwen/Qwen3-0.6B" in loader.stdout
    assert result.stderr == f"Error: --model: {loader.stdout}"


def test_fields_are_broken_into_lines_between_them() -> None:
    fields = ["a" * 10, "b" * 10, "c" * 30, "d" * 3]
    assert chat.fit_lines(fields, 23) == f"{'a' * 10} · {'b' * 10}\n{'c' * 30}\n{'d' * 3}"
    assert chat.fit_lines(fields, 100) == " · ".join(fields)


def test_an_engine_error_names_the_flag_not_the_keyword(qwen3_dir: str) -> None:
    trained = LLM(qwen3_dir, device="cpu").engine.max_model_len
    result = run_piped(chat_args(qwen3_dir, "--max-model-len", str(trained + 1)), [])
    assert result.returncode == 1
    assert result.stderr == (
        f"Error: --max-model-len {trained + 1} exceeds the model's "
        f"max_position_embeddings={trained}\n"
    )


class Screen:
    """What the terminal shows: everything chat.py writes, drawn by a terminal emulator."""

    def __init__(self) -> None:
        self.screen = pyte.Screen(SCREEN_COLUMNS, SCREEN_ROWS)
        self.stream = pyte.Stream(self.screen)
        self.transcript = ""  # everything written, what was drawn and erased too

    def write(self, text: str) -> None:
        self.stream.feed(text)
        self.transcript += text

    def flush(self) -> None:
        pass

    def edited_line(self) -> str:
        """The line being edited as shown, from the prompt to the cursor: the screen rows
        from the last one that starts with the prompt down to the cursor's, joined (a long
        line wraps onto several). Whatever follows the cursor is kept, so a cursor out of
        place shows."""
        cursor, rows = self.screen.cursor, self.screen.display
        start = next((y for y in range(cursor.y, -1, -1) if rows[y].startswith(PROMPT)), None)
        if start is None:
            return ""
        after_cursor = rows[cursor.y][cursor.x :]
        return "".join(rows[start : cursor.y]) + rows[cursor.y][: cursor.x] + after_cursor.rstrip()

    def wait_for_edited_line(self, child: pexpect.spawn, expected: str) -> None:
        """Read the child's output until the line being edited reads `expected`, with the
        cursor at its end."""
        deadline = time.monotonic() + child.timeout
        while self.edited_line() != expected:
            on_screen = self.edited_line()
            assert time.monotonic() < deadline, f"{on_screen!r} on screen, not {expected!r}"
            with suppress(pexpect.TIMEOUT):
                child.read_nonblocking(4096, timeout=0.1)


def spawn_chat(
    model_dir: str, max_tokens: int, term: str = "dumb", screen: Screen | None = None
) -> pexpect.spawn:
    """chat.py in a pseudo-terminal, at its first prompt, its output drawn on `screen` if
    one is given. TERM=dumb is plain text: no colours, no cursor movement, no spinner."""
    child = pexpect.spawn(
        sys.executable, [str(CHAT_SCRIPT), *chat_args(model_dir, "--max-tokens", str(max_tokens))],
        cwd=str(ROOT),
        env={**os.environ, "TERM": term}, encoding="utf-8", timeout=60,
        dimensions=(SCREEN_ROWS, SCREEN_COLUMNS),
    )
    child.logfile_read = screen  # pexpect copies everything it reads there
    child.expect(PROMPT)
    return child


def send_turn(child: pexpect.spawn, message: str) -> tuple[int, int, int]:
    """Send a message, wait for the reply's status line: (generated, cached, prompt tokens)."""
    child.sendline(message)
    child.expect(STATUS)
    generated, cached, prompt = (int(child.match.group(i)) for i in (1, 2, 3))
    child.expect(PROMPT)
    return generated, cached, prompt


def interrupt_turn(child: pexpect.spawn, message: str) -> tuple[int, int, int]:
    """Send a message, press Ctrl-C once the reply is streaming; return its status numbers."""
    child.sendline(message)
    child.expect_exact(f"{message}\r\n")  # the terminal's echo of the line
    child.read_nonblocking(1)  # the reply's first character
    child.sendintr()
    child.expect(STATUS)
    assert child.match.group(4), "the reply finished before Ctrl-C reached it"
    assert "^C" not in child.before and "\x03" not in child.before  # no echo in the reply
    generated, cached, prompt = (int(child.match.group(i)) for i in (1, 2, 3))
    child.expect(PROMPT)
    return generated, cached, prompt


def engine_stats(child: pexpect.spawn) -> dict[str, str]:
    """The /stats table as {figure: value as shown}. A row is a group's name (on its first
    row only), the figure's, and the value, each apart by two spaces or more."""
    child.sendline("/stats")
    child.expect(PROMPT)
    row = re.compile(r"^ *(?:\w+ {2,})?(\w+) {2,}(\S.*?) *\r?$", flags=re.MULTILINE)
    return dict(row.findall(child.before))


def test_terminal_session_reuses_the_previous_turn_from_the_cache(qwen3_dir: str) -> None:
    child = spawn_chat(qwen3_dir, max_tokens=8)
    _, cached_1, prompt_1 = send_turn(child, "hello there friend")
    assert cached_1 == 0  # nothing cached yet
    _, cached_2, prompt_2 = send_turn(child, "tell me more")
    assert prompt_2 > prompt_1
    assert cached_2 >= prompt_1 - 4  # at least turn 1's prompt, in whole pages of 4

    stats = engine_stats(child)
    assert stats["pages_used"] == "0" and int(stats["pages_cached"]) > 0

    child.sendline("/reset")
    child.expect("New conversation")
    child.expect(PROMPT)
    _, cached_3, prompt_3 = send_turn(child, "hello there friend")
    assert prompt_3 == prompt_1  # the history is gone: the same prompt as turn 1...
    assert cached_3 > 0  # ...and it is still in the cache

    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_terminal_commands_say_what_they_do(qwen3_dir: str) -> None:
    child = spawn_chat(qwen3_dir, max_tokens=4)
    child.sendline("/system")
    child.expect_exact(f"System prompt: {SYSTEM}")
    child.expect(PROMPT)
    send_turn(child, "hello there friend")

    child.sendline("/system Be terse.")
    child.expect_exact("New conversation with the system prompt: Be terse.")
    child.expect(PROMPT)
    # A path is a message, and the conversation it goes to starts afresh under "Be terse.".
    _, _, prompt_tokens = send_turn(child, "/usr/bin")
    llm = LLM(qwen3_dir, device="cpu")
    expected = llm.chat_prompt([system("Be terse."), {"role": "user", "content": "/usr/bin"}])
    assert prompt_tokens == len(expected)

    child.sendline("/system --clear")
    child.expect_exact("New conversation without a system prompt.")
    child.sendline("/system")
    child.expect_exact("No system prompt.")
    child.sendline("/help")
    child.expect_exact("Ctrl-C stops a reply")
    child.expect(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)


def test_terminal_banner_shows_a_kv_cache_for_one_conversation(
    qwen3_dir: str, tmp_path: Path
) -> None:
    # A model with a long context: on a CPU, chat keeps CPU_CONTEXT tokens of it.
    model = model_copy(qwen3_dir, tmp_path / "model", config={"max_position_embeddings": 40960})
    screen = Screen()
    child = spawn_chat(model, max_tokens=4, screen=screen)
    banner = " ".join(child.before.split())
    # K and V, per layer and KV head, float32, for the CPU_CONTEXT tokens and the scratch page.
    layers, kv_heads, head_dim, page_size = 2, 2, 32, 4
    kv_bytes = 2 * layers * kv_heads * head_dim * 4 * (chat.CPU_CONTEXT + page_size)
    context = f"{chat.CPU_CONTEXT:,} tokens"
    fields = [f"{model} on cpu (float32)", f"context {context}",
              f"KV cache {context} ({decimal(kv_bytes)})", "loaded in"]
    assert all(field in banner for field in fields)
    # Broken between fields, in lines that fit the terminal: no "·" left dangling.
    lines = [row.strip() for row in screen.screen.display if row.strip()]
    assert not [line for line in lines if line.startswith("·") or line.endswith("·")], lines
    assert "Ctrl-C stops a reply" in banner
    assert "sampling: temperature 0.0" in banner  # --temperature 0 overrides the fallback
    stats = engine_stats(child)
    assert stats["pages_total"] == f"{chat.CPU_CONTEXT // page_size:,}"
    assert stats["bytes"] == decimal(kv_bytes)  # sizes as people read them
    # The memory group: the KV pages' bytes (the scratch page aside), the process's memory.
    kv_total = kv_bytes // (chat.CPU_CONTEXT + page_size) * chat.CPU_CONTEXT
    assert stats["kv_total_bytes"] == decimal(kv_total)
    assert stats["kv_used_bytes"] == "0 bytes"
    assert re.fullmatch(r"\d+\.\d [MG]B", stats["resident_bytes"])
    # Where the memory goes: the weights as loaded, the KV cache, and what else is resident.
    assert f"weights {stats['weight_bytes']} (float32)" in banner
    assert re.search(r"in RAM \d+\.\d [MG]B \(\d+\.\d [MG]B besides weights and KV cache\)", banner)
    assert "hit_rate" in stats and "proposed_tokens" not in stats  # no speculation, no row
    child.sendeof()
    child.expect(pexpect.EOF)


def test_ctrl_c_stops_the_reply_and_frees_its_pages(qwen3_dir: str) -> None:
    # A reply of up to 1000 tokens is still streaming when Ctrl-C arrives.
    child = spawn_chat(qwen3_dir, max_tokens=1000)
    generated_1, _, prompt_1 = interrupt_turn(child, "hello there friend")
    assert generated_1 < 1000

    stats = engine_stats(child)
    assert stats["pages_used"] == "0" and stats["running"] == "0"
    assert stats["finished"] == "stop 0, length 0, abort 1, error 0"

    # The prompt still works, and the interrupted turn is in the history and in the cache.
    _, cached_2, prompt_2 = interrupt_turn(child, "and then?")
    assert prompt_2 > prompt_1 and cached_2 > 0

    child.sendintr()  # at the empty prompt: leave
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_d_at_the_prompt_exits(qwen3_dir: str) -> None:
    child = spawn_chat(qwen3_dir, max_tokens=8)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


# --------------------------------------------------------------------------- on screen
def test_line_editing_redraws_the_prompt_and_history_outlives_the_session(
    qwen3_dir: str, data_home: Path
) -> None:
    # A colour terminal, and a line longer than the screen is wide: the prompt's colour
    # codes must not throw readline's count of columns off.
    long_line = "hello there friend, " * 8
    assert len(long_line) > SCREEN_COLUMNS
    screen = Screen()
    child = spawn_chat(qwen3_dir, max_tokens=4, term="xterm", screen=screen)
    for message in [long_line, "hi"]:
        child.sendline(message)
        child.expect("from cache")
        screen.wait_for_edited_line(child, "you › ")
    # Up, Up, Down: the long line, then the short one over it; the prompt stays.
    child.send(UP + UP)
    screen.wait_for_edited_line(child, f"you › {long_line}")
    child.send(DOWN)
    screen.wait_for_edited_line(child, "you › hi")
    child.send(CTRL_U)  # erase the line, not the prompt
    screen.wait_for_edited_line(child, "you › ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = data_home / "nanoqwen" / "chat_history"
    assert history.read_text().splitlines() == [long_line, "hi", "/exit"]

    # The next run recalls the last one's lines.
    screen = Screen()
    child = spawn_chat(qwen3_dir, max_tokens=4, term="xterm", screen=screen)
    child.send(UP + UP)
    screen.wait_for_edited_line(child, "you › hi")
    child.send(CTRL_U)  # Ctrl-D leaves only from an empty line
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_spinner_counts_the_seconds_until_the_first_token(qwen3_dir: str) -> None:
    screen = Screen()
    child = spawn_chat(qwen3_dir, max_tokens=4, term="xterm", screen=screen)
    child.sendline("hello there friend")
    child.expect("from cache")
    screen.wait_for_edited_line(child, "you › ")
    assert re.search(r"thinking… \d+\.\d s", screen.transcript)  # drawn while waiting...
    assert not any("thinking" in row for row in screen.screen.display)  # ...then erased
    child.sendline("/exit")
    child.expect(pexpect.EOF)
