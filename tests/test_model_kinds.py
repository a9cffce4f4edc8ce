"""The newer Qwen kinds end to end: mixture-of-experts (Qwen2-MoE, Qwen3-MoE) and hybrid
linear-attention decoders (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), held to transformers.

Each kind is a layer kind the decoder composes (`model/moe.py`, `model/gated_attention.py`,
`model/gated_deltanet.py`); the hybrid models add a state pool beside the KV pages
(`memory/state_pool.py`). What the dense models' tests check of the engine is checked here
on these: greedy tokens equal transformers' for a batch of mixed lengths, and stay equal
under small prefill chunks, a follow-up turn served from the prefix cache, preemption and
two ranks; the page and slot accounting holds after every step. Weight and KV-cache
quantization apply to them as to dense models, the routing excepted.
"""

from __future__ import annotations

import pytest
import torch
from oracle import greedy, hf_greedy, random_prompts, run_to_completion
from quantized_helpers import largest_greedy_gap
from torch import nn

from nanoqwen import LLM, LLMEngine
from nanoqwen.model.config import HYBRID_ARCHITECTURES, ModelConfig
from nanoqwen.model.moe import ReplicatedLinear, SparseMoeBlock
from nanoqwen.weights.quantization import Int8Linear

VOCAB = 800
MOE = ["qwen2_moe", "qwen3_moe"]
HYBRID = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
LENGTHS = [3, 9, 17, 40]
OPTIONS = dict(device="cpu", dtype="float32", page_size=4)


def engine_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of `prompts`, the page (and slot) accounting checked after every step."""
    ids = [engine.add_request(prompt, greedy(max_tokens)) for prompt in prompts]
    final = run_to_completion(engine)
    return [final[request_id].token_ids for request_id in ids]


@pytest.mark.parametrize("kind", MOE + HYBRID)
def test_greedy_tokens_equal_transformers(kind: str, newer_kind_dirs: dict[str, str]) -> None:
    model_dir = newer_kind_dirs[kind]
    prompts = random_prompts(VOCAB, LENGTHS, seed=11)
    engine = LLMEngine(model_dir, num_pages=96, **OPTIONS)
    outputs = engine_outputs(engine, prompts, 10)
    assert outputs == [hf_greedy(model_dir, prompt, 10) for prompt in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("kind", MOE + HYBRID)
def test_small_chunks_and_preemption_change_nothing(
    kind: str, newer_kind_dirs: dict[str, str]
) -> None:
    """Prompts prefilled 5 tokens at a time, in a pool too small for the batch: requests
    are preempted and recomputed (hybrid ones from a fresh slot), and every token stays."""
    model_dir = newer_kind_dirs[kind]
    prompts = random_prompts(VOCAB, LENGTHS, seed=12)
    reference = engine_outputs(LLMEngine(model_dir, num_pages=96, **OPTIONS), prompts, 12)
    tight = LLMEngine(model_dir, num_pages=16, chunk_size=5, **OPTIONS)
    assert engine_outputs(tight, prompts, 12) == reference
    assert tight.stats()["requests"]["preemptions"] > 0


@pytest.mark.parametrize("kind", HYBRID)
def test_prefill_chunks_of_32_equal_one_chunk(kind: str, newer_kind_dirs: dict[str, str]) -> None:
    model_dir = newer_kind_dirs[kind]
    prompts = random_prompts(VOCAB, [70, 100, 33], seed=13)
    whole = engine_outputs(LLMEngine(model_dir, num_pages=128, chunk_size=512, **OPTIONS), prompts, 6)
    chunked = LLMEngine(model_dir, num_pages=128, chunk_size=32, **OPTIONS)
    assert engine_outputs(chunked, prompts, 6) == whole == [
        hf_greedy(model_dir, prompt, 6) for prompt in prompts
    ]


@pytest.mark.parametrize("kind", MOE + HYBRID)
def test_a_follow_up_turn_reuses_the_first_and_stays_identical(
    kind: str, newer_kind_dirs: dict[str, str]
) -> None:
    """Prompt, reply, then prompt + reply + a new message: the second turn is served from
    the first one's pages (a hybrid model's state from the snapshot taken where they end)
    and generates what a cold engine does."""
    model_dir = newer_kind_dirs[kind]
    (first,) = random_prompts(VOCAB, [31], seed=14)
    engine = LLMEngine(model_dir, num_pages=128, **OPTIONS)
    (reply,) = engine_outputs(engine, [first], 10)
    follow_up = first + reply + [7, 8, 9, 10, 11]
    request_id = engine.add_request(follow_up, greedy(8))
    final = run_to_completion(engine)[request_id]
    page_size = OPTIONS["page_size"]
    assert final.num_cached_tokens >= len(first) // page_size * page_size
    cold = LLMEngine(model_dir, num_pages=128, enable_prefix_cache=False, **OPTIONS)
    assert final.token_ids == engine_outputs(cold, [follow_up], 8)[0]


def test_a_snapshot_restored_is_copied_never_computed_into(newer_kind_dirs: dict[str, str]) -> None:
    """Two requests restoring the same snapshot each get a private slot: the snapshot's
    bytes are the same after both have run."""
    engine = LLMEngine(newer_kind_dirs["qwen3_5"], num_pages=128, **OPTIONS)
    (prompt,) = random_prompts(VOCAB, [24], seed=15)
    engine_outputs(engine, [prompt], 4)
    snapshots = {key: snapshot.slot for key, snapshot in engine.states.snapshots.items()}
    shared = max(snapshots, key=len)  # the state after the prompt's last full page
    before = engine.runner.states.recurrent[:, snapshots[shared]].clone()
    outputs = engine_outputs(engine, [prompt + [5], prompt + [6]], 4)
    assert len(outputs) == 2
    assert (engine.runner.states.recurrent[:, snapshots[shared]] == before).all()


@pytest.mark.slow
@pytest.mark.parametrize("kind", MOE + HYBRID)
def test_two_ranks_equal_one(kind: str, newer_kind_dirs: dict[str, str]) -> None:
    """Each rank holds half of every expert's width and half of the linear layers' heads."""
    model_dir = newer_kind_dirs[kind]
    prompts = random_prompts(VOCAB, LENGTHS, seed=16)
    one = engine_outputs(LLMEngine(model_dir, num_pages=96, **OPTIONS), prompts, 8)
    with LLM(model_dir, num_pages=96, tensor_parallel_size=2, **OPTIONS) as split:
        two = [output.token_ids for output in split.generate(prompts, greedy(8))]
    assert two == one


def test_quantization_rounds_everything_but_the_routing(newer_kind_dirs: dict[str, str]) -> None:
    """On Qwen3.5-MoE (experts, a shared expert, both kinds of attention): int8 weights: every linear layer but the router and the experts, which keep the
    model's dtype (top-k is discontinuous: a rounded router logit sends a token elsewhere).
    An int8 KV cache: the full-attention layers' pages only, the state pool in the model's
    dtype, and greedy tokens transformers' up to near-ties (test_kv_quant.py's margin)."""
    model_dir = newer_kind_dirs["qwen3_5_moe"]
    model = LLMEngine(model_dir, num_pages=32, quantization="int8", **OPTIONS).runner.model
    layers = model.model.layers
    assert not [name for name, module in layers.named_modules() if type(module) is nn.Linear]
    assert any(isinstance(module, Int8Linear) for module in layers.modules())
    blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(type(block.gate) is ReplicatedLinear for block in blocks)
    assert all(block.experts.gate_up_proj.weight.dtype == torch.float32 for block in blocks)

    engine = LLMEngine(model_dir, num_pages=64, kv_cache_dtype="int8", **OPTIONS)
    full_attention = sum(not hasattr(layer, "linear_attn") for layer in engine.runner.model.model.layers)
    assert engine.runner.kv_cache.kv.dtype == torch.int8
    assert engine.runner.kv_cache.kv.shape[0] == full_attention < len(layers)  # their pages only
    assert engine.runner.states.recurrent.dtype == torch.float32
    (prompt,) = random_prompts(VOCAB, [19], seed=41)
    (output,) = engine_outputs(engine, [prompt], 8)
    assert largest_greedy_gap(model_dir, prompt, output) <= 0.02


@pytest.mark.parametrize("kind", MOE)
def test_speculation_on_experts_changes_nothing(kind: str, newer_kind_dirs: dict[str, str]) -> None:
    model_dir = newer_kind_dirs[kind]
    prompts = [[21, 22, 23] * 8, *random_prompts(VOCAB, [9], seed=17)]
    plain = engine_outputs(LLMEngine(model_dir, num_pages=96, **OPTIONS), prompts, 16)
    speculating = LLMEngine(model_dir, num_pages=96, speculative="ngram", **OPTIONS)
    assert engine_outputs(speculating, prompts, 16) == plain
    assert speculating.stats()["speculative"]["proposed_tokens"] > 0


def test_speculation_on_a_hybrid_model_is_refused(newer_kind_dirs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="recurrent layers"):
        LLMEngine(newer_kind_dirs["qwen3_5"], speculative="ngram", **OPTIONS)


@pytest.mark.parametrize("kind", MOE + HYBRID)
def test_the_layer_plan_follows_the_config(kind: str, newer_kind_dirs: dict[str, str]) -> None:
    """Which layers have experts, linear attention or gated attention, as transformers
    builds them."""
    from transformers import AutoModelForCausalLM

    model_dir = newer_kind_dirs[kind]
    engine = LLMEngine(model_dir, num_pages=32, **OPTIONS)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    config = engine.model_config
    for layer, ours in zip(hf.model.layers, engine.runner.model.model.layers):
        assert hasattr(layer, "linear_attn") == hasattr(ours, "linear_attn")
        assert ("experts" in dict(layer.mlp.named_children())) == hasattr(ours.mlp, "experts")
    assert (config.architecture in HYBRID_ARCHITECTURES) == bool(config.state_layers)
    assert isinstance(config, ModelConfig)
