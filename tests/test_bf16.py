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
import torch.nn.functional as F
from bf16_oracle import assert_greedy_agrees, hf_bf16, hf_greedy_with_logits, tie_margin
from oracle import check_page_accounting, greedy, random_prompts, run_to_completion
from torch import nn

from nanoqwen import LLMEngine
from nanoqwen.model.layers import RowParallelLinear, Split
from nanoqwen.model.packed import pack_linear_weights
from nanoqwen.weights import loader

VOCAB = 800
# 504 tokens: one first step (the CPU's chunk is 512) prefills them all.
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


# The tests run torch's AVX2 kernels, so the engine would not pack by itself: where oneDNN
# can multiply bf16 at all, these tests pack on purpose.
needs_packing = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN cannot multiply bfloat16 on this CPU",
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 128, 512])
@pytest.mark.parametrize("out_features, in_features, bias", [(96, 64, True), (64, 352, False)])
def test_packed_linear_equals_f_linear(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight, layer.bias)
        pack_linear_weights(layer)
        assert layer.weight.is_mkldnn
        assert torch.equal(layer(x), expected)


@needs_packing
def test_a_packed_row_parallel_layer_keeps_its_own_forward() -> None:
    """Packing swaps the matmul, not the layer: a row-parallel layer still runs its own
    forward (the all-reduce, with one rank a no-op) around the packed product."""
    torch.manual_seed(0)
    layer = RowParallelLinear(Split(0, 64), 32).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight)
        pack_linear_weights(layer)
        assert isinstance(layer, RowParallelLinear) and layer.weight.is_mkldnn
        assert torch.equal(layer(x), expected)


@needs_packing
def test_packing_leaves_greedy_tokens_unchanged_and_gives_a_tied_lm_head_its_own_copy(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines = []
    for packs in (True, False):
        form = "onednn_packed" if packs else None
        monkeypatch.setattr(loader, "weight_form", lambda *args, form=form: form)
        engines.append(LLMEngine(model_dir, device="cpu", dtype="bfloat16", num_pages=200, max_num_seqs=16))
    packed, plain = (engine.runner.model for engine in engines)
    assert packed.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert not plain.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert not packed.model.embed_tokens.weight.is_mkldnn  # the lookup keeps its plain rows
    assert packed.lm_head.weight.is_mkldnn
    assert plain.config.tie_word_embeddings == (plain.lm_head.weight is plain.model.embed_tokens.weight)
    assert torch.equal(packed.lm_head.weight.to_dense(), plain.lm_head.weight)  # same bits
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS[:5], seed=7)
    tokens = []
    for engine in engines:
        ids = [engine.add_request(prompt, greedy(8)) for prompt in prompts]
        final = run_to_completion(engine)
        tokens.append([final[request_id].token_ids for request_id in ids])
    assert tokens[0] == tokens[1]
