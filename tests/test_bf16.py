"""bfloat16 end to end on the CPU: the engine against transformers, both in bfloat16.

A GPU serves in bfloat16 by default, and every other test checks float32. This one runs
the whole engine in bfloat16 (the torch backend's padded path serves its decodes, as it
would on a GPU without flashinfer) on the tiny Qwen2 and Qwen3 checkpoints, with the
tolerance `bf16_oracle.py` states: first-step logits within 4 bfloat16 roundings of the
largest logit, and greedy tokens identical except where transformers' own logits hold a
near-tie that close.
"""

import pytest
import torch
from bf16_oracle import assert_greedy_agrees, hf_bf16, hf_greedy_with_logits, tie_margin
from oracle import check_page_accounting, greedy, random_prompts, run_to_completion

from nanoqwen import LLMEngine

VOCAB = 800
# 504 tokens: one first step (the CPU's chunk is 2048) prefills them all.
PROMPT_LENGTHS = [1, 9, 40, 250, 17, 64, 33, 90]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def engines(qwen2_dir: str, qwen3_dir: str) -> dict[str, LLMEngine]:
    options = dict(device="cpu", dtype="bfloat16", num_pages=200, max_num_seqs=16)
    return {d: LLMEngine(d, **options) for d in (qwen2_dir, qwen3_dir)}


@pytest.mark.native_kernels
def test_first_step_logits_are_within_the_bf16_bound(engines, model_dir: str) -> None:
    engine = engines[model_dir]
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=2)
    for prompt in prompts:
        engine.add_request(prompt, greedy(1))
    batch = engine.scheduler.schedule().rows
    inputs = engine.runner.prepare(batch)
    logits = engine.runner.forward(inputs)
    assert logits.dtype == torch.bfloat16
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_bf16(model_dir)(torch.tensor([prompt])).logits[0, -1].float()
        difference = (logits[row].float() - expected).abs().max().item()
        assert difference <= tie_margin(expected), f"prompt of {len(prompt)} tokens"
    engine.scheduler.advance(batch)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    check_page_accounting(engine)


@pytest.mark.slow
@pytest.mark.native_kernels
def test_greedy_tokens_match_up_to_near_ties(engines, model_dir: str) -> None:
    engine = engines[model_dir]
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=5)
    ids = [engine.add_request(prompt, greedy(NEW_TOKENS)) for prompt in prompts]
    final = run_to_completion(engine)
    compared = 0
    for request_id, prompt in zip(ids, prompts):
        hf_tokens, hf_logits = hf_greedy_with_logits(model_dir, prompt, NEW_TOKENS)
        compared += assert_greedy_agrees(final[request_id].token_ids, hf_tokens, hf_logits)
    # Ties part a few sequences early; most tokens are still compared one for one.
    assert compared >= len(prompts) * NEW_TOKENS // 2
