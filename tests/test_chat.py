"""chat.py: the think splitter and status line in process, the CLI end to end.

End-to-end tests drive `python chat.py` against the tiny Qwen3 fixture, either through a
pseudo-terminal (pexpect: the interactive UI, Ctrl-C) or with piped stdin (the scripted
mode, whose output is compared with the engine's own greedy replies). Greedy decoding with
small `--max-tokens` keeps the replies deterministic and short; `--page-size 4` makes even
a short prompt fill whole pages, so the prefix cache has something to reuse.
"""

import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pexpect
import pytest
from rich.console import Console

from nanoqwen import LLM, SamplingParams

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
# A plain-text terminal: no colours, no cursor movement, no spinner.
TERMINAL_ENV = {**os.environ, "TERM": "dumb"}


def import_chat() -> ModuleType:
    """chat.py is a script at the top level, not part of the package."""
    spec = importlib.util.spec_from_file_location("chat", CHAT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


chat = import_chat()


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
        chat.ReplyPrinter(Console(file=file), show_thinking).print(segments)
        assert file.getvalue() == expected


def fake_output(new_tokens: int) -> SimpleNamespace:
    """The fields of a RequestOutput that the status line reads."""
    return SimpleNamespace(delta_token_ids=[1] * new_tokens, num_cached_tokens=32)


def test_status_line_reports_decode_rate_first_token_and_cache() -> None:
    stats = chat.ReplyStats(prompt_tokens=40)
    stats.record(fake_output(0), elapsed=0.1)  # a prefill chunk: no token yet
    stats.record(fake_output(1), elapsed=0.25)
    stats.record(fake_output(10), elapsed=2.25)
    line = stats.status_line()
    assert line == "11 tokens · 5.0 tok/s · first token 250 ms · 32/40 prompt tokens from cache"
    stats.interrupted = True
    assert stats.status_line().endswith(" · interrupted")


def test_deferred_interrupt_turns_ctrl_c_into_a_flag() -> None:
    before = signal.getsignal(signal.SIGINT)
    with chat.deferred_interrupt() as pressed:
        assert not pressed.is_set()
        signal.raise_signal(signal.SIGINT)  # would raise KeyboardInterrupt outside the block
        assert pressed.is_set()
    assert signal.getsignal(signal.SIGINT) is before


# --------------------------------------------------------------------------- the CLI
def chat_args(model_dir: str, *extra: str) -> list[str]:
    return [str(CHAT_SCRIPT), "--model", model_dir, "--temperature", "0", "--page-size", "4",
            "--system", SYSTEM, *extra]


def run_piped(args: list[str], lines: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], input="".join(f"{line}\n" for line in lines),
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def oracle(model_dir: str, max_tokens: int) -> tuple[LLM, SamplingParams]:
    """An engine set up as chat.py sets it up, for greedy replies to compare with."""
    llm = LLM(model_dir, page_size=4, max_num_seqs=1)
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


def test_piped_commands_system_reset_stats_exit(qwen3_dir: str) -> None:
    lines = ["/system Be terse.", "hi", "/reset", "", "hello again", "/stats", "/exit", "unread"]
    result = run_piped(chat_args(qwen3_dir, "--max-tokens", "6", "--no-think"), lines)
    assert result.returncode == 0, result.stderr
    # /reset forgets "hi" and its reply but keeps the system prompt /system set.
    llm, params = oracle(qwen3_dir, max_tokens=6)
    first = converse(llm, params, [system("Be terse.")], "hi", enable_thinking=False)
    second = converse(llm, params, [system("Be terse.")], "hello again", enable_thinking=False)
    assert result.stdout.startswith(f"{first}\n{second}\n")
    table = result.stdout[len(first) + len(second) + 2 :]
    assert re.search(r"pages_used\s+0\b", table)
    # Nothing after the table: the line after /exit was never answered.
    assert table.rstrip().endswith("abort 0")


def test_unknown_model_is_one_line_with_a_hint(tmp_path: Path) -> None:
    # The default hub model, with the hub offline and an empty cache: it cannot be found.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(CHAT_SCRIPT)], stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=120, env=env,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error_lines = result.stderr.strip().splitlines()
    assert len(error_lines) == 1 and "Qwen/Qwen3-0.6B" in error_lines[0]
    assert "--model /path/to/dir" in error_lines[0]


def spawn_chat(model_dir: str, max_tokens: int) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable, chat_args(model_dir, "--max-tokens", str(max_tokens)), cwd=str(ROOT),
        env=TERMINAL_ENV, encoding="utf-8", timeout=60,
    )
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
    generated, cached, prompt = (int(child.match.group(i)) for i in (1, 2, 3))
    child.expect(PROMPT)
    return generated, cached, prompt


def engine_stats(child: pexpect.spawn) -> dict[str, str]:
    """The /stats table as {name: value}; "finished" is the table's last row."""
    child.sendline("/stats")
    child.expect(r"finished +(.*?) *\r\n")
    stats = dict(re.findall(r"^ *(\w+) +(\S+)", child.before, flags=re.MULTILINE))
    stats["finished"] = child.match.group(1)
    child.expect(PROMPT)
    return stats


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


def test_ctrl_c_stops_the_reply_and_frees_its_pages(qwen3_dir: str) -> None:
    # A reply of up to 1000 tokens is still streaming when Ctrl-C arrives.
    child = spawn_chat(qwen3_dir, max_tokens=1000)
    generated_1, _, prompt_1 = interrupt_turn(child, "hello there friend")
    assert generated_1 < 1000

    stats = engine_stats(child)
    assert stats["pages_used"] == "0" and stats["running"] == "0"
    assert stats["finished"] == "stop 0, length 0, abort 1"

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
