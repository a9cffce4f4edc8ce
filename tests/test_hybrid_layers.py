"""The layers of the hybrid models (Qwen3-Next, Qwen3.5) against transformers' own.

A tiny random checkpoint of each architecture is saved with transformers and read back
through the layers' own loaders, by the checkpoint's names, so the parameter names and
the slices each rank reads are checked along with the maths. The oracle is transformers'
layer on the whole sequence at once; our layers see the same tokens cut into steps
(prefill chunks of every size, decodes, packed batches of requests in shuffled slots)
through a toy state pool, and must give the same outputs. The pure delta-rule functions
are held to each other: the chunked form to the token-by-token recurrence.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from steps import step_of
from torch import nn
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNorm,
    apply_rotary_pos_emb,
)

from nanoqwen.attention.base import AttentionMetadata, ReferenceBackend
from nanoqwen.memory.kv_cache import KVCache
from nanoqwen.model import gated_deltanet
from nanoqwen.model.delta_rule import (
    causal_conv1d,
    chunked_delta_rule,
    l2_normalize,
    recurrent_delta_rule_step,
)
from nanoqwen.model.gated_attention import (
    GatedAttention,
    ZeroCenteredRMSNorm,
    partial_rotary,
)
from nanoqwen.model.gated_deltanet import (
    GatedDeltaNet,
    StateShapes,
    deltanet_state_shapes,
)
from nanoqwen.model.layers import TensorParallel, split_across
from nanoqwen.model.loading import TensorSlice, load_whole

LINEAR, FULL = 0, 3  # the layers of the tiny models: linear, linear, linear, full
HIDDEN = 64
SMALL = dict(
    vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=4, intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4,  # two value heads per key head
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
)
ARCHITECTURES = {
    "qwen3_next": (
        Qwen3NextConfig, Qwen3NextForCausalLM,
        dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
             shared_expert_intermediate_size=16),
    ),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, {}),
}
FLOAT32 = dict(atol=1e-5, rtol=1e-4)
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}  # ours → the checkpoint's row blocks


# ------------------------------------------------------------------------------ fixtures
def randomize(model: nn.Module) -> None:
    """Weights far from their initial values (zero-centred norms at zero would hide a
    missing 1 + w), and fading slow enough that the state carries across many tokens."""
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("A_log"):
            param.data = torch.empty(param.shape).uniform_(0.02, 0.3, generator=generator).log()
        elif name.endswith("linear_attn.norm.weight"):
            param.data = 1 + 0.3 * noise
        else:
            param.data = 0.3 * noise


class Checkpoint:
    """A saved tiny model: its config, transformers' layers, and its tensors by name."""

    def __init__(self, architecture: str, directory: Path) -> None:
        config_class, model_class, extra = ARCHITECTURES[architecture]
        self.config = config_class(**SMALL, **extra)
        self.config._attn_implementation = "eager"  # the mask it is given, as it is given
        self.model = model_class(self.config).eval()
        randomize(self.model)
        self.model.save_pretrained(directory)
        self._files = ExitStack()
        self._file = self._files.enter_context(
            safe_open(directory / "model.safetensors", framework="pt")
        )

    def names(self, prefix: str) -> set[str]:
        return {name for name in self._file.keys() if name.startswith(prefix)}

    def slice(self, name: str) -> TensorSlice:
        return self._file.get_slice(name)

    def close(self) -> None:
        self._files.close()

    def oracle(self, layer: int) -> nn.Module:
        decoder = self.model.model.layers[layer]
        return decoder.linear_attn if layer == LINEAR else decoder.self_attn


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Checkpoint]:
    saved = Checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    yield saved
    saved.close()


def load(layer: nn.Module, checkpoint: Checkpoint, prefix: str) -> nn.Module:
    """Fill `layer` as the project's loader does: each parameter through its module's
    `load_block` (whole without one), from the lazily sliced checkpoint tensor of its name;
    every tensor under `prefix` is used, and every parameter element written."""
    used = set()
    for module_name, module in layer.named_modules():
        loader = getattr(module, "load_block", load_whole)
        for param_name, param in module.named_parameters(recurse=False):
            param.data.fill_(torch.nan)
            name = f"{module_name}.{param_name}" if module_name else param_name
            blocks = [f"{part}.{param_name}" for part in FUSED.get(module_name, [])] or [name]
            for block, checkpoint_name in enumerate(blocks):
                loader(param, checkpoint.slice(prefix + checkpoint_name), block)
                used.add(prefix + checkpoint_name)
            assert not param.isnan().any(), f"{name} is not fully loaded"
    assert used == checkpoint.names(prefix)
    return layer


def deltanet(checkpoint: Checkpoint) -> GatedDeltaNet:
    prefix = f"model.layers.{LINEAR}.linear_attn."
    return load(GatedDeltaNet(checkpoint.config, LINEAR), checkpoint, prefix)


def gated_attention(checkpoint: Checkpoint) -> GatedAttention:
    prefix = f"model.layers.{FULL}.self_attn."
    return load(GatedAttention(checkpoint.config, FULL), checkpoint, prefix)


class ToyPool:
    """A state pool for one layer (`StateView`): slot 0 the dummy, then `num_slots` slots."""

    def __init__(
        self, shapes: StateShapes, num_slots: int, device: torch.device = torch.device("cpu")
    ) -> None:
        slots = num_slots + 1
        self.windows = torch.zeros(slots, *shapes.conv, dtype=shapes.conv_dtype, device=device)
        self.recurrent = torch.zeros(
            slots, *shapes.recurrent, dtype=shapes.recurrent_dtype, device=device
        )
        self.query_lens: list[int] = []
        self.slots = torch.empty(0, dtype=torch.int64, device=device)

    def step(self, query_lens: list[int], slots: list[int]) -> ToyPool:
        self.query_lens, self.slots = query_lens, torch.tensor(slots, device=self.slots.device)
        return self

    def layer_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert layer == LINEAR
        return self.windows, self.recurrent

    def slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows[slot].clone(), self.recurrent[slot].clone()


def pool_for(config, num_slots: int = 1) -> ToyPool:
    return ToyPool(deltanet_state_shapes(config, torch.float32), num_slots)


def tokens(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def in_steps(
    layer: GatedDeltaNet, pool: ToyPool, hidden: torch.Tensor, cuts: list[int], slot: int = 1
) -> torch.Tensor:
    """One request's tokens, `cuts[i]` of them in step i, from its slot's state."""
    outputs, start = [], 0
    for length in cuts:
        outputs.append(layer(hidden[start : start + length], SimpleNamespace(states=pool.step([length], [slot]))))
        start += length
    assert start == hidden.shape[0]
    return torch.cat(outputs)


def cut(length: int, chunk: int) -> list[int]:
    return [min(chunk, length - start) for start in range(0, length, chunk)]


@torch.inference_mode()
def whole_sequence(checkpoint: Checkpoint, hidden: torch.Tensor) -> torch.Tensor:
    return checkpoint.oracle(LINEAR)(hidden[None])[0]


# ------------------------------------------------------------------------ Gated DeltaNet
@pytest.mark.parametrize("chunk", [70, 1, 2, 3, 5, 64])
def test_deltanet_matches_transformers_for_any_chunking(
    checkpoint: Checkpoint, chunk: int
) -> None:
    """70 tokens (past one 64-token chunk of the rule) in one step, one token a step
    (decodes), or chunks of 2, 3, 5 or 64, carrying the window and state between them."""
    hidden = tokens(70)
    ours = in_steps(deltanet(checkpoint), pool_for(checkpoint.config), hidden, cut(70, chunk))
    torch.testing.assert_close(ours, whole_sequence(checkpoint, hidden), **FLOAT32)


def test_deltanet_decodes_after_a_prefill(checkpoint: Checkpoint) -> None:
    hidden = tokens(52)
    ours = in_steps(deltanet(checkpoint), pool_for(checkpoint.config), hidden, [40] + [1] * 12)
    torch.testing.assert_close(ours, whole_sequence(checkpoint, hidden), **FLOAT32)


@torch.inference_mode()
def test_deltanet_rounds_like_transformers_in_bfloat16(checkpoint: Checkpoint) -> None:
    """In bf16 (a bf16 conv window, a float32 state) the outputs stay with transformers'
    bf16 layer, far closer than bf16 is to float32 (about 0.2 here)."""
    hidden = tokens(70).bfloat16()
    oracle = copy.deepcopy(checkpoint.oracle(LINEAR)).bfloat16()
    expected = oracle(hidden[None])[0]
    pool = ToyPool(deltanet_state_shapes(checkpoint.config, torch.bfloat16), 1)
    ours = in_steps(deltanet(checkpoint).bfloat16(), pool, hidden, [40, 1, 1, 28])
    torch.testing.assert_close(ours, expected, atol=2e-2, rtol=1e-2)


def test_a_short_chunk_shifts_the_conv_window_partly() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 1, 4, generator=generator)
    sequence = torch.randn(7, 6, generator=generator)
    whole, _ = causal_conv1d(sequence, weight, torch.zeros(6, 3))
    window, parts = torch.zeros(6, 3), []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):  # shorter, then longer than 3
        out, window = causal_conv1d(sequence[rows], weight, window)
        parts.append(out)
        # The window holds the last 3 inputs seen, the old window's where fewer are new.
        seen = torch.cat([torch.zeros(3, 6), sequence[: rows.stop]])
        torch.testing.assert_close(window, seen[-3:].t(), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(parts), whole, **FLOAT32)


@torch.inference_mode()
def test_a_packed_batch_equals_each_request_alone(checkpoint: Checkpoint) -> None:
    """Three requests with some history each, one step: 9 new tokens, a decode, 70."""
    layer = deltanet(checkpoint)
    lengths, slots = [9, 1, 70], [2, 3, 1]
    histories = [tokens(5, seed=10 + i) for i in range(3)]
    new = [tokens(n, seed=20 + i) for i, n in enumerate(lengths)]
    alone, alone_states = [], []
    for history, hidden in zip(histories, new):
        pool = pool_for(checkpoint.config)
        in_steps(layer, pool, history, [5])
        alone.append(in_steps(layer, pool, hidden, [hidden.shape[0]]))
        alone_states.append(pool.slot(1))
    pool = pool_for(checkpoint.config, num_slots=3)
    for history, slot in zip(histories, slots):
        in_steps(layer, pool, history, [5], slot)
    packed = layer(torch.cat(new), SimpleNamespace(states=pool.step(lengths, slots)))
    torch.testing.assert_close(packed, torch.cat(alone), **FLOAT32)
    for slot, (window, state) in zip(slots, alone_states):
        torch.testing.assert_close(pool.slot(slot), (window, state), **FLOAT32)


@torch.inference_mode()
def test_batched_decodes_touch_only_their_own_slots(
    checkpoint: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes of requests in slots 5, 2 and 4 in one step, in that order, with a padding
    row on the dummy slot 0: each equals its request decoded alone, slots 1 and 3 keep
    their bytes, and the step takes the batched path alone (no request by request)."""
    layer = deltanet(checkpoint)
    pool = pool_for(checkpoint.config, num_slots=5)
    lengths = {4: 6, 2: 3, 5: 8, 1: 4}
    prompts = {slot: tokens(length, seed=slot) for slot, length in lengths.items()}
    for slot, prompt in prompts.items():
        in_steps(layer, pool, prompt, [prompt.shape[0]], slot)
    pool.windows[3].normal_()  # a slot no request of this step owns: not even zeros change
    untouched = {slot: pool.slot(slot) for slot in (1, 3)}
    order = [5, 0, 2, 4]
    step = tokens(4, seed=7)
    expected = {}
    for row, slot in enumerate(order):
        if slot:
            alone = pool_for(checkpoint.config)
            in_steps(layer, alone, prompts[slot], [prompts[slot].shape[0]])
            expected[slot] = (in_steps(layer, alone, step[row : row + 1], [1]), alone.slot(1))
    for per_request in ("prefill_requests", "decode_requests"):
        monkeypatch.setattr(gated_deltanet, per_request, None)  # calling it would fail
    out = layer(step, SimpleNamespace(states=pool.step([1] * 4, order)))
    for row, slot in enumerate(order):
        if slot:
            torch.testing.assert_close(out[row : row + 1], expected[slot][0], **FLOAT32)
            torch.testing.assert_close(pool.slot(slot), expected[slot][1], **FLOAT32)
    for slot, before in untouched.items():
        assert all(torch.equal(now, then) for now, then in zip(pool.slot(slot), before))


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_the_chunked_rule_equals_the_recurrence(chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(chunk_size)
    length, heads, k_dim, v_dim = 50, 3, 8, 5
    q, k = (l2_normalize(torch.randn(length, heads, k_dim, generator=generator)) for _ in range(2))
    v = torch.randn(length, heads, v_dim, generator=generator)
    g = -torch.rand(length, heads, generator=generator)
    beta = torch.rand(length, heads, generator=generator)
    initial = torch.randn(heads, k_dim, v_dim, generator=generator)
    out, final = chunked_delta_rule(q, k, v, g, beta, initial.clone(), chunk_size)
    state, steps = initial[None].clone(), []
    for t in range(length):
        token = (x[t : t + 1] for x in (q, k, v, g, beta))
        steps.append(recurrent_delta_rule_step(*token, state))
    torch.testing.assert_close(out, torch.cat(steps), **FLOAT32)
    torch.testing.assert_close(final, state[0], **FLOAT32)


# ---------------------------------------------------------------------- gated attention
def one_request(cached: int, new: int, page_size: int) -> AttentionMetadata:
    """A step of one request on pages 1, 2, ... with `cached` tokens before its `new` ones."""
    total = cached + new
    num_pages = -(-total // page_size)
    return step_of([(cached, [0] * new, list(range(1, num_pages + 1)), 1)], page_size).metadata


def rope(checkpoint: Checkpoint, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin at positions 0..L-1, `[1, L, rotary_dim]` (equal halves)."""
    return checkpoint.model.model.rotary_emb(hidden[None], torch.arange(hidden.shape[0])[None])


@torch.inference_mode()
def attention_in_steps(
    layer: GatedAttention, checkpoint: Checkpoint, hidden: torch.Tensor, cuts: list[int]
) -> torch.Tensor:
    """One request's tokens, `cuts[i]` of them in step i, over a paged KV cache."""
    page_size = 4
    num_pages = -(-hidden.shape[0] // page_size) + 1
    heads = layer.num_heads, layer.num_kv_heads, layer.head_dim
    cache = KVCache(
        FULL + 1, *heads[1:], page_size, num_pages, torch.float32, torch.device("cpu")
    )
    backend = ReferenceBackend(cache, *heads)
    cos, sin = (t[0, :, : t.shape[-1] // 2] for t in rope(checkpoint, hidden))
    outputs, start = [], 0
    for length in cuts:
        rows = slice(start, start + length)
        backend.plan(one_request(start, length, page_size))
        outputs.append(layer(hidden[rows], SimpleNamespace(rope=(cos[rows], sin[rows]), backend=backend)))
        start += length
    return torch.cat(outputs)


@torch.inference_mode()
def attention_oracle(checkpoint: Checkpoint, hidden: torch.Tensor) -> torch.Tensor:
    length = hidden.shape[0]
    mask = torch.full((length, length), -torch.inf).triu(1)[None, None]
    out, _ = checkpoint.oracle(FULL)(hidden[None], rope(checkpoint, hidden), attention_mask=mask)
    return out[0]


def test_gated_attention_matches_transformers(checkpoint: Checkpoint) -> None:
    """A prompt in two prefill chunks, then decodes, over a paged KV cache."""
    hidden = tokens(15)
    ours = attention_in_steps(gated_attention(checkpoint), checkpoint, hidden, [7, 5, 1, 1, 1])
    torch.testing.assert_close(ours, attention_oracle(checkpoint, hidden), **FLOAT32)


def test_zero_centered_norm_rounds_like_transformers() -> None:
    theirs = Qwen3NextRMSNorm(32, eps=1e-6)
    ours = ZeroCenteredRMSNorm(32, eps=1e-6)
    theirs.weight.data = ours.weight.data = torch.randn(32).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    assert torch.equal(ZeroCenteredRMSNorm(32, 1e-6)(x.float()), Qwen3NextRMSNorm(32)(x.float()))


def test_partial_rotary_turns_only_the_leading_dims() -> None:
    x = torch.randn(5, 3, 16)
    angles = torch.arange(5)[:, None] * torch.rand(2)
    cos, sin = angles.cos(), angles.sin()  # [T, rotary_dim / 2] with rotary_dim 4
    whole = torch.cat([cos, cos], dim=-1)[None], torch.cat([sin, sin], dim=-1)[None]
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], *whole)
    ours = partial_rotary(x, cos, sin, 4)
    torch.testing.assert_close(ours, expected[0].transpose(0, 1), **FLOAT32)


# ------------------------------------------------------------------ split across ranks
@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's partial sums come back as they are; the test adds them up."""
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)


@pytest.mark.usefixtures("no_collectives")
def test_deltanet_split_across_two_ranks_sums_to_the_whole(checkpoint: Checkpoint) -> None:
    """Each rank's layer reads its heads' slices; its partial sums add up to the whole."""
    hidden = tokens(30)
    cuts = [20, 1, 1, 8]
    whole = in_steps(deltanet(checkpoint), pool_for(checkpoint.config), hidden, cuts)
    partial = []
    for rank in range(2):
        with split_across(TensorParallel(rank, 2)):
            layer, pool = deltanet(checkpoint), pool_for(checkpoint.config)
        assert pool.recurrent.shape[1] == SMALL["linear_num_value_heads"] // 2
        partial.append(in_steps(layer, pool, hidden, cuts))
    torch.testing.assert_close(partial[0] + partial[1], whole, **FLOAT32)


@pytest.mark.usefixtures("no_collectives")
def test_gated_attention_split_across_two_ranks_sums_to_the_whole(
    checkpoint: Checkpoint,
) -> None:
    hidden = tokens(10)
    cuts = [6, 3, 1]
    whole = attention_in_steps(gated_attention(checkpoint), checkpoint, hidden, cuts)
    partial = []
    for rank in range(2):
        with split_across(TensorParallel(rank, 2)):
            layer = gated_attention(checkpoint)
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        partial.append(attention_in_steps(layer, checkpoint, hidden, cuts))
    torch.testing.assert_close(partial[0] + partial[1], whole, **FLOAT32)


def test_state_shapes_per_rank(checkpoint: Checkpoint) -> None:
    # 2 key heads of 16 for q and k, 4 value heads of 8: 96 conv channels, kernel 4.
    assert deltanet_state_shapes(checkpoint.config, torch.bfloat16) == StateShapes(
        (96, 3), torch.bfloat16, (4, 16, 8), torch.float32
    )
    with split_across(TensorParallel(1, 2)):
        assert deltanet_state_shapes(checkpoint.config, torch.float32).conv == (48, 3)
        with pytest.raises(ValueError, match="ranks must divide"):
            with split_across(TensorParallel(0, 4)):
                GatedDeltaNet(checkpoint.config, LINEAR)


# --------------------------------------------------------------------------------- CUDA
needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and flashinfer",
)


@pytest.mark.cuda
@needs_flashinfer
@torch.inference_mode()
def test_flashinfer_kernels_match_the_torch_rule() -> None:
    """flashinfer's prefill and decode kernels (heads of 128, bf16, on Hopper) against the
    torch path, on the same layer and steps, within bf16's rounding."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("flashinfer's Gated DeltaNet decode kernel is built for Hopper (SM90)")
    config = Qwen3NextConfig(
        **{**SMALL, "linear_key_head_dim": 128, "linear_value_head_dim": 128},
        **ARCHITECTURES["qwen3_next"][2],
    )
    cuda = torch.device("cuda")
    layer = GatedDeltaNet(config, LINEAR)
    randomize(layer)
    layer.to(cuda, torch.bfloat16)
    hidden = tokens(70).to(cuda, torch.bfloat16)
    results = []
    for use_flashinfer in (False, True):
        layer.use_flashinfer = use_flashinfer
        pool = ToyPool(deltanet_state_shapes(config, torch.bfloat16), 1, cuda)
        out = in_steps(layer, pool, hidden, [66, 1, 1, 2])  # past a 64-token chunk, decodes
        results.append((out.float(), pool.recurrent[1]))
    (torch_out, torch_state), (flashinfer_out, flashinfer_state) = results
    torch.testing.assert_close(flashinfer_out, torch_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(flashinfer_state, torch_state, atol=3e-2, rtol=3e-2)
