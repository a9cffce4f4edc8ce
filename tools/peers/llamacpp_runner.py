"""Run one benchmark workload through llama.cpp, in llama-cpp-python's own environment.

`bench.py --compare llamacpp` starts this file with the Python of a virtual environment
where llama-cpp-python is installed (`pip install llama-cpp-python`, which compiles
llama.cpp), writes the workload to its stdin as JSON, and reads the timings back from its
stdout as JSON (the same shapes as `vllm_runner.py`):

    {"model": FILE.gguf, "threads": 2, "max_model_len": N,
     "prompts": [[ids], ...], "max_tokens": [n, ...]}
    → {"engine": "llama.cpp", "version": ..., "wall_s": ..., "ttft_s": [...],
       "tpot_s": [...], "output_token_ids": [[ids], ...]}

llama.cpp's Python API serves one sequence at a time, so requests run one after another,
each greedy (top-k 1) with EOS ignored; a request's time to first token counts from when
all were submitted, as a server queueing them would. Only the standard library and
llama_cpp are imported: nothing of nanoqwen.
"""

import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    results = result_stream()
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=job["model"], n_ctx=job["max_model_len"], n_batch=512,
        n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False,
    )
    generate(llm, job["prompts"][0], 2)  # warm-up
    start = time.perf_counter()
    ttft, tpot, outputs = [], [], []
    for prompt, max_tokens in zip(job["prompts"], job["max_tokens"]):
        first, last, tokens = generate(llm, prompt, max_tokens)
        ttft.append(first - start)
        tpot.append((last - first) / max(1, len(tokens) - 1))
        outputs.append(tokens)
    json.dump({
        "engine": "llama.cpp", "version": llama_cpp.__version__,
        "wall_s": time.perf_counter() - start, "ttft_s": ttft, "tpot_s": tpot,
        "output_token_ids": outputs,
    }, results)


def generate(llm, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """Greedy tokens after `prompt`, EOS ignored; (time of the first, of the last, tokens)."""
    llm.reset()
    llm.eval(prompt)
    tokens, first = [], 0.0
    for _ in range(max_tokens):
        token = llm.sample(top_k=1, temp=0.0)
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
        llm.eval([token])
    return first, time.perf_counter(), tokens



def result_stream():
    """Where the result goes: the original stdout, whose file descriptor is then pointed at
    stderr, so that whatever the engine prints (its logs, its C++ code) stays out of it."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return results


if __name__ == "__main__":
    main()
