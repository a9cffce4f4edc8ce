"""The transformers baseline of `bench.py --compare hf`: the same prompts through `generate`.

Static batching, the way a script without a serving engine runs a model: the prompts go in
batches of `max_num_seqs`, left-padded to the batch's longest prompt, and each batch
generates greedily until its longest requested output, EOS ignored. Only the requested
tokens are counted, so what a batch spends on padding and on waiting for its longest
member is the cost of static batching the comparison measures.

It runs in a separate, freshly spawned process, after the engine has been freed, so the two
never share memory or threads; the worker loads the model once and times each batch.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as transformers_logging

from nanoqwen.cli import quiet_library_noise
from nanoqwen.weights.gguf import from_pretrained_arguments, read_gguf_config

# Left padding fills a batch's shorter prompts; any id will do, the attention mask hides it.
LEFT_PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class BaselineRun:
    wall_s: float  # summed over the batches: generation only, not loading
    batches: int


def run_transformers(
    model_dir: str,
    dtype: str,
    device: str,
    threads: int,
    batch_size: int,
    requests: Sequence[tuple[list[int], int]],
    on_batch: Callable[[int, float], None],
) -> BaselineRun:
    """`requests` (prompt, output length) in static batches, in a fresh worker process.

    `on_batch(requests_done, seconds_so_far)` is called after every batch.
    """
    batch_seconds = functools.partial(_worker_batch_seconds, model_dir, dtype, device)
    wall, done = 0.0, 0
    # "spawn": a fresh interpreter, not a fork of this one with the engine's memory mapped.
    with ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(threads,),
    ) as worker:
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            prompts = [prompt for prompt, _ in batch]
            num_tokens = max(output_len for _, output_len in batch)
            wall += worker.submit(batch_seconds, prompts, num_tokens).result()
            done += len(batch)
            on_batch(done, wall)
    return BaselineRun(wall, -(-len(requests) // batch_size))


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    transformers_logging.disable_progress_bar()  # its weight-loading bars would cut into ours
    quiet_library_noise()  # transformers' loader imports torchao


def _worker_batch_seconds(
    model_dir: str, dtype: str, device: str, prompts: list[list[int]], num_tokens: int
) -> float:
    """Runs in the worker process: load (first call only), then time one batch."""
    return _generate_seconds(_load(model_dir, dtype, device), prompts, num_tokens)


@functools.cache
def _load(model_dir: str, dtype: str, device: str) -> torch.nn.Module:
    """Loaded once per worker process, then reused by every batch."""
    location, gguf_file = from_pretrained_arguments(model_dir)
    # A GGUF file is dequantized, with the config nanoqwen reads from it: transformers' own
    # reading of a Qwen3 file misses its head_dim.
    config = {"config": read_gguf_config(model_dir)[0]} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        location, **gguf_file, **config, dtype=getattr(torch, dtype)
    )
    model = model.to(device).eval()
    _generate_seconds(model, [list(range(1, 9))], 2)  # warm-up
    return model


def _generate_seconds(model: torch.nn.Module, prompts: list[list[int]], num_tokens: int) -> float:
    """Seconds for one left-padded greedy batch generating exactly `num_tokens` tokens."""
    width = max(len(p) for p in prompts)
    device = model.device
    input_ids = torch.tensor(
        [[LEFT_PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts], device=device
    )
    attention_mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
    )
    # min = max new tokens: EOS cannot end a row early, as with ignore_eos in the engine.
    config = GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=LEFT_PAD_TOKEN_ID,
    )
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
    synchronize(device)
    elapsed = time.perf_counter() - start
    if output.shape[1] != width + num_tokens:
        raise RuntimeError(
            f"transformers generated {output.shape[1] - width} tokens, not {num_tokens}"
        )
    return elapsed


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a clock read afterwards covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
