"""`--config FILE`: serve.py, chat.py and bench.py read their options from YAML or JSON.

A file's keys are the options' names, with underscores or dashes; a flag typed on the
command line overrides the file; every mistake in it is one line naming the file and the
key. Parsing is checked with click's `make_context`, which reads the arguments as the
command would and runs nothing; one test starts a real server from a file.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from server_helpers import REPO_ROOT, serve_process

import bench
import chat
import serve
from nanoqwen.cli import engine_options, in_flags

COMMANDS = {"serve": serve.main, "chat": chat.main, "bench": bench.main}
# Options every command shares, spelt both ways.
SHARED_FILE = (
    "model: m\nmax_model_len: 777\nmax-num-seqs: 3\nprefix_cache: false\nkv_cache_memory: 1.5e9\n"
)


def write(tmp_path: Path, text: str, name: str = "options.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(command: str, *args: str) -> dict[str, Any]:
    """The values the command would run with, by parameter name."""
    main = COMMANDS[command]
    return main.make_context(f"{command}.py", list(args)).params


def test_serve_takes_its_options_from_a_file_and_flags_override_it(
    qwen3_dir: str, tmp_path: Path
) -> None:
    """The model, the port and the engine's context come from the file; the served name
    from the command line, over the file's."""
    config = write(tmp_path, f"model: {qwen3_dir}\nport: 0\nmax_model_len: 777\n"
                             "served-model-name: from-file\ndtype: float32\n")
    process, port, _ = serve_process("--config", str(config), "--served-model-name", "from-flag")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
            [card] = json.load(reply)["data"]
        assert (card["id"], card["max_model_len"]) == ("from-flag", 777)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    assert process.returncode == 0


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_reads_the_shared_options_of_one_file(command: str, tmp_path: Path) -> None:
    config = write(tmp_path, SHARED_FILE)
    params = parse(command, "--config", str(config))
    assert params["model"] == "m"
    assert params["max_model_len"] == 777 and params["max_num_seqs"] == 3
    assert params["enable_prefix_cache"] is False  # the flag's name, --prefix-cache
    assert params["kv_cache_memory"] == 1.5e9
    # Flags win, wherever they stand: --config is read first.
    params = parse(command, "--max-model-len", "555", "--config", str(config), "--prefix-cache")
    assert params["max_model_len"] == 555 and params["enable_prefix_cache"] is True
    assert params["max_num_seqs"] == 3


@pytest.mark.parametrize("command, text, expected", [
    ("serve", "model: m\nallowed_origins: [http://a.example, http://b.example]\n",
     {"allowed_origins": ("http://a.example", "http://b.example")}),
    ("serve", "model: m\nallowed-origins: http://a.example\n",
     {"allowed_origins": ("http://a.example",)}),
    ("chat", "temperature: 0\nno_think: true\nsystem: Be terse.\n",
     {"temperature": 0.0, "no_think": True, "system": "Be terse."}),
    ("bench", "num_seqs: 16\nscenario: multi-turn\njson: out.json\nfloor: yes\n",
     {"num_seqs": 16, "scenario": "multi-turn", "json_path": Path("out.json"), "floor": True}),
], ids=["serve-list", "serve-one-of-a-list", "chat", "bench"])
def test_each_command_reads_its_own_options(
    command: str, text: str, expected: dict[str, Any], tmp_path: Path
) -> None:
    params = parse(command, "--config", str(write(tmp_path, text)))
    assert {name: params[name] for name in expected} == expected


def test_json_files_and_null_values(tmp_path: Path) -> None:
    """JSON reads as YAML does; null keeps the option's default."""
    config = write(tmp_path, json.dumps({"max-num-seqs": 5, "page_size": None}), "options.json")
    params = parse("serve", "--config", str(config), "--model", "m")
    assert params["max_num_seqs"] == 5 and params["page_size"] == 16


def test_chat_runs_one_sequence_unless_the_file_says_otherwise(tmp_path: Path) -> None:
    """chat.py's own default (one sequence) stays under a file that doesn't set it."""
    for text, seqs in (("temperature: 0.5\n", 1), ("max_num_seqs: 4\n", 4)):
        assert parse("chat", "--config", str(write(tmp_path, text)))["max_num_seqs"] == seqs


def test_the_example_file_is_one_serve_reads() -> None:
    params = parse("serve", "--config", str(REPO_ROOT / "examples" / "serve.yaml"))
    assert params["model"] == "Qwen/Qwen3-0.6B" and params["max_model_len"] == 8192


@pytest.mark.parametrize("text, message", [
    ("max_num_seq: 2\n", "unknown option 'max_num_seq'; did you mean 'max_num_seqs'?"),
    ("max-num-seq: 2\n", "unknown option 'max-num-seq'; did you mean 'max-num-seqs'?"),
    ("colour: blue\n", "unknown option 'colour' (see --help)"),
    ("max_num_seqs: 2.5\n", "max_num_seqs: '2.5' is not a valid integer range."),
    ("max_num_seqs: true\n", "max_num_seqs: 'true' is not a valid integer range."),
    ("max_num_seqs: 0\n", "max_num_seqs: 0 is not in the range x>=1."),
    ("max_num_seqs: [2]\n", "max_num_seqs: expected one value, got a list"),
    ("dtype: {a: 1}\n", "dtype: expected one value, got a dict"),
    ("allowed_origins: [[a]]\n", "allowed_origins: expected one value, got a list"),
    ("max_num_seqs: 2\nmax-num-seqs: 3\n", "max_num_seqs is set twice"),
    ("page_size: null\npage-size: 8\n", "page_size is set twice"),
    ("- max_num_seqs\n", "expected option names and their values, got a list"),
    ("max_num_seqs: [2\n", "not YAML (line 2): expected ',' or ']', but got '<stream end>'"),
], ids=["misspelt", "misspelt-dashes", "unknown", "fraction", "bool", "range", "list", "dict",
        "nested-list", "twice", "twice-once-null", "not-a-mapping", "bad-yaml"])
def test_a_mistake_in_the_file_is_one_line(text: str, message: str, tmp_path: Path) -> None:
    config = write(tmp_path, text)
    result = CliRunner().invoke(serve.main, ["--config", str(config), "--model", "m"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [f"Error: {config}: {message}"]


def test_bad_json_is_one_line(tmp_path: Path) -> None:
    config = write(tmp_path, '{"max_num_seqs": 2,}', "options.json")
    result = CliRunner().invoke(serve.main, ["--config", str(config), "--model", "m"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"Error: {config}: not JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 20 (char 19)"
    ]


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(click.BadParameter, match="does not exist"):
        parse("serve", "--config", str(tmp_path / "missing.yaml"))


def test_engine_errors_name_the_commands_flags() -> None:
    @click.command()
    @engine_options
    def command(**options: object) -> None:
        said.append(in_flags(
            "max_model_len=5000 is too long; lower max_num_seqs or kv_cache_memory=0.5 "
            "(device 'cuda' was asked for: device='cpu', or --dtype bf16)"
        ))

    said: list[str] = []
    command([], standalone_mode=False)
    assert said == [
        "--max-model-len 5000 is too long; lower --max-num-seqs or --kv-cache-memory 0.5 "
        "(device 'cuda' was asked for: --device 'cpu', or --dtype bf16)"
    ]
