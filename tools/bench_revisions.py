"""Time two checkouts of nanoqwen against each other on the same model, rounds interleaved.

    git worktree add --detach ../before <commit>
    python -m tools.bench_revisions ../before . --model DIR [--rounds 4] [--threads 1]

A refactoring should not slow the engine down, and a shared machine makes one run of each
side worthless: the load moves between the runs. So the two sides take turns, round after
round, each in a fresh process that imports nanoqwen from its own checkout, and every
figure is reported twice: tokens per wall-clock second, and tokens per CPU second of the
process (which a busy machine disturbs far less, with one thread). Each run decodes greedy
tokens, EOS ignored, for one request alone and for 16 at once, from the same random
token-id prompts, best of a few runs; the medians over rounds are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 16)
PROMPT_TOKENS = 64


def run_one_side(model: str, output_tokens: int, threads: int, repeats: int) -> dict[str, float]:
    """In this process (nanoqwen already importable from the side's checkout); each figure
    is the best of `repeats` runs, the one the machine's other work disturbed least."""
    import torch

    from nanoqwen import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model)
    rng = random.Random(0)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts(2), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    figures: dict[str, float] = {}
    for batch in BATCHES:
        batch_prompts = prompts(batch)
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            outputs = llm.generate(batch_prompts, params)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            tokens = sum(len(output.token_ids) for output in outputs)
            for key, rate in ((f"batch {batch} tok/s", tokens / wall),
                              (f"batch {batch} tok/cpu-s", tokens / cpu)):
                figures[key] = max(figures.get(key, 0.0), rate)
    return figures


def run_in_process(
    checkout: Path, model: str, output_tokens: int, threads: int, repeats: int
) -> dict[str, float]:
    # This file is loaded by its path, so that `nanoqwen` comes from the side's checkout alone.
    code = (
        "import importlib.util, json, sys; sys.path.insert(0, sys.argv[1]); "
        "spec = importlib.util.spec_from_file_location('bench_revisions', sys.argv[2]); "
        "tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool); "
        "print(json.dumps(tool.run_one_side(sys.argv[3], *map(int, sys.argv[4:7]))))"
    )
    command = [sys.executable, "-c", code, str(checkout), __file__, model]
    completed = subprocess.run(
        [*command, str(output_tokens), str(threads), str(repeats)], capture_output=True, text=True, check=True,
        cwd=checkout,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the best counts")
    args = parser.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        for name, checkout in sides.items():
            figures = run_in_process(
                checkout, args.model, args.output_tokens, args.threads, args.repeats
            )
            rounds[name].append(figures)
            print(f"round {round_index + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    print("\nmedian over rounds | before | after | after/before")
    for key in rounds["before"][0]:
        before = statistics.median(r[key] for r in rounds["before"])
        after = statistics.median(r[key] for r in rounds["after"])
        print(f"{key} | {before:.1f} | {after:.1f} | {after / before:.2f}")


if __name__ == "__main__":
    main()
