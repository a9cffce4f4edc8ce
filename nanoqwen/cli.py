"""What chat.py, serve.py and bench.py share: the engine's options, and how they speak.

Each engine option maps to one `EngineConfig` field and shows that field's default in
`--help`, so the three tools describe the engine the same way and never disagree about a
default. `describe_engine` is the one line each prints about a loaded engine, and
`quiet_library_noise` keeps another library's start-up chatter, which no user can act on,
off their terminals.

`--config FILE` reads option values from a YAML or JSON file (`examples/serve.yaml`). It
uses click's own layering: a command looks an option up on the command line, then in its
environment variable, then in the context's `default_map`, then takes its default. The
option is eager, so its callback runs before any other option is read, and it fills the
`default_map` from the file; whatever the command line says still wins. Each value is
checked as the flag's text would be (`max_num_seqs: 2.5` fails as `--max-num-seqs 2.5`
does), so a file can't sneak past a check the command line makes, and every mistake in
it is one line that names the file and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml  # PyYAML: a dependency of transformers and huggingface_hub
from rich.filesize import decimal

from nanoqwen.config import (
    ATTENTION_BACKEND_NAMES,
    DTYPES,
    GENERATION_CONFIG_SOURCES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_MODES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from nanoqwen.engine import LLMEngine
from nanoqwen.runner.startup import CPU_KV_CACHE_FRACTION
from nanoqwen.weights.loader import runtime_quantization, weight_form
from nanoqwen.weights.quantization import torchao_import_noise

Command = TypeVar("Command", bound=Callable[..., Any])


MODEL_HELP = "A Hugging Face hub id, a local checkpoint directory or a .gguf file."


def model_option(**settings: Any) -> Callable[[Command], Command]:
    """`--model`, as every command line takes it."""
    return click.option("--model", help=MODEL_HELP, **settings)


def engine_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


ENGINE_OPTIONS = [
    click.option("--device", default=None, help="cpu or cuda. Default: cuda when available."),
    click.option("--dtype", default=None, type=click.Choice(sorted(DTYPES)),
                 help="Weights and KV-cache dtype. Default: bfloat16 on CUDA and on CPUs with bf16 "
                      "arithmetic (AVX512-BF16, AMX), float32 on other CPUs."),
    click.option("--max-num-seqs", default=engine_default("max_num_seqs"),
                 type=click.IntRange(min=1), help="Most sequences in one batch."),
    click.option("--max-model-len", default=None, type=click.IntRange(min=1),
                 help="Longest sequence, prompt plus output. Default: the model's."),
    click.option("--page-size", default=engine_default("page_size"), type=click.IntRange(min=1),
                 help="Tokens per KV-cache page."),
    click.option("--kv-cache-memory", default=None, type=click.FloatRange(min=0, min_open=True),
                 help="KV-cache size: bytes, or a fraction (<= 1) of free memory (GPU or RAM). "
                      "Default: what is left on a GPU; on a CPU, what every sequence at "
                      f"full length needs, at most {CPU_KV_CACHE_FRACTION:.0%} of the RAM."),
    click.option("--num-pages", default=None, type=click.IntRange(min=1),
                 help="KV-cache size in pages (overrides --kv-cache-memory)."),
    click.option("--chunk-size", default=None, type=click.IntRange(min=1),
                 help="Most prompt tokens prefilled per step. Default: 8192 on CUDA, 2048 on CPU."),
    click.option("--prefix-cache/--no-prefix-cache", "enable_prefix_cache",
                 default=engine_default("enable_prefix_cache"),
                 help="Reuse the KV pages of prompt prefixes seen before."),
    click.option("--enforce-eager", is_flag=True, default=engine_default("enforce_eager"),
                 help="Run every step eagerly (no CUDA graphs)."),
    click.option("--attention-backend", default=None,
                 type=click.Choice([name for name in ATTENTION_BACKEND_NAMES if name]),
                 help="Attention implementation. Default: flashinfer on CUDA when it can run "
                      "the model, else torch; reference is the textbook one, for comparison."),
    click.option("--quantization", default=None, type=click.Choice(QUANTIZATION_MODES),
                 help="Keep linear weights as int8 or int4 in memory (none: in --dtype). "
                 "Default: as the checkpoint has them (GPTQ, AWQ, GGUF), else none."),
    click.option("--kv-cache-dtype", default=engine_default("kv_cache_dtype"),
                 type=click.Choice(list(KV_CACHE_DTYPES)),
                 help="KV-cache storage: auto (--dtype), or int8 / fp8_e4m3 in one byte per "
                      "number (about twice the pages of bfloat16; flashinfer reads fp8 only)."),
    click.option("--tensor-parallel-size", "-tp", default=engine_default("tensor_parallel_size"),
                 type=click.IntRange(min=1),
                 help="Split the model across this many GPUs (or CPU processes)."),
    click.option("--scheduling-policy", default=engine_default("scheduling_policy"),
                 type=click.Choice(SCHEDULING_POLICIES),
                 help="Order of admission: fcfs (arrival), priority (each request's "
                      "priority, lower first), deadline (the one due soonest), sjf (the "
                      "shortest remaining prompt) or fair (users take turns); all but fcfs "
                      "and deadline age waiting requests."),
    click.option("--priority-aging-steps", default=engine_default("priority_aging_steps"),
                 type=click.IntRange(min=0),
                 help="Under the priority, sjf and fair policies, a waiting request gains one "
                      "level per this many steps (0: never)."),
    click.option("--default-deadline", default=engine_default("default_deadline"),
                 type=click.FloatRange(min=0, min_open=True),
                 help="Under --scheduling-policy deadline, seconds after arrival a request "
                      "without a deadline counts as due."),
    click.option("--max-seqs-per-user", default=None, type=click.IntRange(min=1),
                 help="Most unfinished sequences one user may have (the server answers 429 "
                      "past it). Default: no cap."),
    click.option("--preemption-mode", default=engine_default("preemption_mode"),
                 type=click.Choice(PREEMPTION_MODES),
                 help="What a preempted request's KV pages become: recompute (dropped, "
                      "computed again) or swap (copied to --swap-space bytes of host memory "
                      "and back)."),
    click.option("--swap-space", default=None, type=click.FloatRange(min=0),
                 help="Bytes of host memory for swapped-out KV pages (--preemption-mode swap)."),
    click.option("--speculative", default=None,
                 type=click.Choice([name for name in SPECULATIVE_METHODS if name]),
                 help="Speculative decoding: ngram guesses tokens from the text so far, draft "
                      "runs --draft-model; the target model verifies the guesses. Default: off."),
    click.option("--num-speculative-tokens", default=engine_default("num_speculative_tokens"),
                 type=click.IntRange(min=1), help="Draft tokens per request and step."),
    click.option("--draft-model", default=None,
                 help="Smaller model with the same tokenizer (hub id or directory) for "
                      "--speculative draft, which it implies."),
    click.option("--ngram-min", default=engine_default("ngram_min"), type=click.IntRange(min=1),
                 help="Shortest n-gram --speculative ngram looks up."),
    click.option("--ngram-max", default=engine_default("ngram_max"), type=click.IntRange(min=1),
                 help="Longest n-gram --speculative ngram looks up (tried first)."),
    click.option("--generation-config", default=engine_default("generation_config"),
                 type=click.Choice(GENERATION_CONFIG_SOURCES),
                 help="Sampling settings a request leaves out: auto takes the model's "
                      "(generation_config.json), none the neutral ones (temperature 1, "
                      "no top-k/top-p/min-p, no repetition penalty)."),
]
SPECULATIVE_OPTION_NAMES = (
    "speculative", "num_speculative_tokens", "draft_model", "ngram_min", "ngram_max",
)
ENGINE_OPTION_NAMES = (
    "device", "dtype", "max_num_seqs", "max_model_len", "page_size", "kv_cache_memory",
    "num_pages", "chunk_size", "enable_prefix_cache", "enforce_eager", "attention_backend",
    "quantization", "kv_cache_dtype", "tensor_parallel_size", "scheduling_policy",
    "priority_aging_steps", "default_deadline", "max_seqs_per_user", "preemption_mode",
    "swap_space", "generation_config", *SPECULATIVE_OPTION_NAMES,
)


def engine_options(command: Command) -> Command:
    """Add every engine option to a click command."""
    for option in reversed(ENGINE_OPTIONS):
        command = option(command)
    return command


def pop_engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take the engine options out of a command's arguments, as `LLM(...)` keywords."""
    engine = {name: options.pop(name) for name in ENGINE_OPTION_NAMES}
    engine = {name: value for name, value in engine.items() if value is not None}
    memory = engine.get("kv_cache_memory")
    if memory is not None and memory > 1:
        engine["kv_cache_memory"] = int(memory)  # a byte count, not a fraction
    if "swap_space" in engine:
        engine["swap_space"] = int(engine["swap_space"])  # 4e9 on a command line
    return engine


def in_flags(message: str) -> str:
    """An engine error as a command's: the keywords it names (`max_model_len=5000`,
    `lower max_num_seqs`) as the current command's flags (`--max-model-len 5000`, `lower
    --max-num-seqs`)."""
    command = click.get_current_context().command
    for param in command.params:
        if isinstance(param, click.Option) and param.name in ENGINE_OPTION_NAMES:
            keyword = "" if "_" in param.name else "(?==)"  # a bare `device` may be English
            message = re.sub(rf"(?<![\w-]){param.name}\b{keyword}", param.opts[0], message)
    return re.sub(r"(--[\w-]+)=", r"\1 ", message)


def describe_engine(engine: LLMEngine) -> str:
    """Where the model runs, how its weights are kept, how much its KV cache holds and, on
    a CPU, where the process's memory goes, in one line: chat's banner and serve's log."""
    config, stats = engine.config, engine.stats()
    kv, memory = stats["kv_cache"], stats["memory"]
    dtype = str(config.dtype).removeprefix("torch.")
    ranks = f", {config.tensor_parallel_size} ranks" if config.tensor_parallel_size > 1 else ""
    fields = [
        f"{engine.device} ({dtype}{ranks})",
        f"weights {decimal(memory['weight_bytes'])} ({weights_kept_as(engine)})",
        f"context {engine.max_model_len:,} tokens",
        f"KV cache {kv['capacity_tokens']:,} tokens ({decimal(kv['bytes'])})",
    ]
    # One process holds it all only on a CPU, unsplit (ranks are processes of their own).
    if engine.device.type == "cpu" and config.tensor_parallel_size == 1:
        rest = memory["resident_bytes"] - memory["weight_bytes"] - kv["bytes"]
        fields.append(
            f"in RAM {decimal(memory['resident_bytes'])} ({decimal(rest)} besides weights and "
            "KV cache)"
        )
    return " · ".join(fields)


def weights_kept_as(engine: LLMEngine) -> str:
    """The form the loader gave the linear weights (`loader.weight_form`), as users call it."""
    config, checkpoint = engine.config, engine.checkpoint
    scheme = runtime_quantization(config.quantization, checkpoint, engine.device)
    form = weight_form(scheme, checkpoint, config.dtype, engine.device)
    if form == "gguf_codes":
        return "the file's 4-bit codes, int8 for its other types and the embedding"
    if form in ("int8", "int4"):
        source = checkpoint.format_name
        return f"{form} codes" + (f" from {source}" if source else "")
    return str(config.dtype).removeprefix("torch.")


def quiet_library_noise() -> None:
    """Keep torchao's import noise (`TORCHAO_IMPORT_NOISE`) off the terminal for good: the
    model loaders of transformers import torchao too. Their other messages still show."""
    for each, drop in torchao_import_noise():
        each.addFilter(drop)


# --------------------------------------------------------------------------- config files
def config_option(command: Command) -> Command:
    """`--config FILE`: option values from a YAML or JSON file (see the module docstring)."""
    return click.option(
        "--config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        is_eager=True, expose_value=False, callback=read_config_file, metavar="FILE",
        help="Option values from a YAML or JSON file, keys named like the options "
             "(max_num_seqs or max-num-seqs); options on the command line override it.",
    )(command)


def read_config_file(ctx: click.Context, param: click.Parameter, path: Path | None) -> None:
    """Put a config file's values into `ctx.default_map`, under the options' names."""
    if path is None:
        return
    options = options_by_key(ctx.command)
    defaults: dict[str, Any] = {}
    seen: set[str] = set()
    for key, value in load_config(path).items():
        option = options.get(str(key).replace("-", "_"))
        if option is None:
            raise click.ClickException(f"{path}: {unknown_key(str(key), options)}")
        if option.name in seen:  # under two spellings
            raise click.ClickException(f"{path}: {option.name} is set twice")
        seen.add(option.name)
        if value is not None:  # null: the option's own default
            defaults[option.name] = checked_value(ctx, option, value, f"{path}: {key}")
    # Merged over the command's own default_map (chat's max_num_seqs of 1).
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def load_config(path: Path) -> dict[Any, Any]:
    """The file's mapping: JSON for a .json file, YAML otherwise; empty for an empty file."""
    text = path.read_text()
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise click.ClickException(f"{path}: not JSON: {error}") from None
    except yaml.YAMLError as error:  # its message spans lines: problem, then a quote
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise click.ClickException(f"{path}: not YAML{where}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise click.ClickException(f"{path}: expected option names and their values, "
                                   f"got a {type(values).__name__}")
    return values


def options_by_key(command: click.Command) -> dict[str, click.Option]:
    """Each option under every name a file may give it, with underscores for dashes: its
    parameter name (`enable_prefix_cache`) and its long flags (`prefix_cache`)."""
    options: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.expose_value:  # not --help, --config
            for name in (param.name, *param.opts):
                if name == param.name or name.startswith("--"):
                    options[name.removeprefix("--").replace("-", "_")] = param
    return options


def unknown_key(key: str, options: dict[str, click.Option]) -> str:
    """The error for a key no option has, with the closest name spelt as the key is."""
    close = difflib.get_close_matches(key.replace("-", "_"), list(options), n=1)
    if not close:
        return f"unknown option {key!r} (see --help)"
    suggestion = close[0].replace("_", "-") if "-" in key else close[0]
    return f"unknown option {key!r}; did you mean {suggestion!r}?"


def checked_value(ctx: click.Context, option: click.Option, value: Any, where: str) -> Any:
    """A file's value as the option's type, checked as the same text on the command line
    (a repeatable option takes a list, or one value)."""
    if option.multiple and not isinstance(value, list):
        value = [value]
    try:
        text = [as_text(item) for item in value] if option.multiple else as_text(value)
        return option.type_cast_value(ctx, text)
    except click.BadParameter as error:
        raise click.ClickException(f"{where}: {error.message}") from None


def as_text(value: Any) -> str:
    """A scalar as the text a flag would take: 2.5 for an integer option fails as
    `--max-num-seqs 2.5` does, instead of being cut to 2."""
    if isinstance(value, (dict, list)):
        raise click.BadParameter(f"expected one value, got a {type(value).__name__}")
    return str(value).lower() if isinstance(value, bool) else str(value)
