"""What a preempted request costs to bring back: its pages copied out and in, or its prefill.

Preemption by swap (`preemption_mode="swap"`) copies a request's full KV pages to host
memory and back; preemption by recompute computes them again (when the prefix cache has
lost them). For contexts of several lengths this measures, on the engine's own KV cache:
the swap out and the swap in of that many tokens' pages (`memory/swap.py`'s copies), and
the prefill of a prompt that long from an empty cache (what recompute redoes). Each is the
median of `--repeats` runs.

    python -m tools.bench_swap --random-weights qwen3-cpu --context 256 1024 4096
    python -m tools.bench_swap --model Qwen/Qwen3-0.6B --device cuda --json swap.json
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from nanoqwen import LLMEngine, SamplingParams
from nanoqwen.memory.swap import HostKVPool
from tools.checkpoints import random_checkpoint


def timed(function: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `function()`, after one untimed run."""
    function()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def prefill(engine: LLMEngine, prompt: list[int]) -> None:
    """Compute `prompt` from an empty prefix cache, to its first token."""
    engine.reset_prefix_cache()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def measure(engine: LLMEngine, context: int, repeats: int) -> dict[str, float]:
    cache, page_size = engine.runner.kv_cache, engine.config.page_size
    pages = list(range(1, context // page_size + 1))  # any pages: a copy is a copy
    host = HostKVPool(cache, len(pages) * cache.nbytes // cache.num_pages)
    held: list[int] = []

    def swap_out() -> None:
        host.release(held)
        held[:] = host.swap_out(pages)

    swap_out_s = timed(swap_out, engine.device, repeats)
    swap_in_s = timed(lambda: host.swap_in(held, pages), engine.device, repeats)
    prompt = [(7 * i) % 1000 + 100 for i in range(context)]
    prefill_s = timed(lambda: prefill(engine, prompt), engine.device, repeats)
    return {
        "context": context, "kv_bytes": len(pages) * host.page_bytes,
        "swap_out_ms": 1e3 * swap_out_s, "swap_in_ms": 1e3 * swap_in_s,
        "recompute_ms": 1e3 * prefill_s,
        "swap_vs_recompute": (swap_out_s + swap_in_s) / prefill_s,
    }


@click.command()
@click.option("--model", help="A checkpoint (hub id or directory).")
@click.option("--random-weights", help="A random-weights preset of tools/checkpoints.py.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--dtype", default=None, help="The engine's dtype (default: the engine's).")
@click.option("--context", "contexts", type=int, multiple=True, default=(256, 1024, 4096),
              help="Context lengths, in tokens (several: --context 256 --context 1024).")
@click.option("--repeats", default=5, type=click.IntRange(min=1), help="Timed runs each.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the rows here.")
def main(model: str | None, random_weights: str | None, device: str | None, dtype: str | None,
         contexts: tuple[int, ...], repeats: int, json_path: Path | None) -> None:
    if (model is None) == (random_weights is None):
        raise click.UsageError("give one of --model and --random-weights")
    model = model or random_checkpoint(random_weights)
    longest = max(contexts)
    engine = LLMEngine(model, device=device, dtype=dtype, max_num_seqs=1,
                       max_model_len=longest + 16, chunk_size=longest,
                       num_pages=2 * longest // 16 + 8)
    rows = [measure(engine, context, repeats) for context in contexts]
    print(f"{engine.device} {engine.config.dtype}; page {engine.config.page_size} tokens")
    print("| context | KV bytes | swap out | swap in | recompute (prefill) | swap / recompute |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['context']} | {row['kv_bytes'] / 2**20:.1f} MiB | "
              f"{row['swap_out_ms']:.2f} ms | {row['swap_in_ms']:.2f} ms | "
              f"{row['recompute_ms']:.1f} ms | {row['swap_vs_recompute']:.3f} |")
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
