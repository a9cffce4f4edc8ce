"""The sparse MoE block against transformers' own, on tiny random models in float32.

The oracle is transformers' sparse MoE block (its eager experts loop) with random weights;
ours is filled from the same model's checkpoint through the loaders, in each layout a
checkpoint may have: one tensor per expert (what `save_pretrained` writes, and the hub),
stacked (transformers' parameters, Qwen3.5's files) and llama.cpp's stacks. Tokens are
drawn so that no router logit nearly ties the one that decides the top k, so rounding
cannot send a token to different experts in the two implementations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode
from transformers import (
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeSparseMoeBlock,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from nanoqwen.model.config import MoeShape
from nanoqwen.model.layers import TensorParallel, split_across
from nanoqwen.model.loading import TensorSlice
from nanoqwen.model.moe import (
    SparseMoeBlock,
    moe_checkpoint_name,
    moe_gguf_name,
    runs_grouped_gemm,
    split_expert_stacks,
)
from nanoqwen.weights.loader import parameter_loaders

HIDDEN, EXPERTS, EXPERT_WIDTH, SHARED_WIDTH = 64, 8, 32, 48
# Tokens whose k-th and (k+1)-th router logits are closer than this are drawn again.
ROUTING_MARGIN = 1e-3
TOKEN_COUNTS = (1, 5, 37)
# name → (config class, model class, the config's MoE settings); the last layer is sparse.
CASES = {
    "qwen2_moe-top4-shared": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_experts_per_tok=4, norm_topk_prob=False, shared_expert_intermediate_size=SHARED_WIDTH,
        mlp_only_layers=[1],
    )),
    "qwen2_moe-top2-shared-renormalised": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_experts_per_tok=2, norm_topk_prob=True, shared_expert_intermediate_size=SHARED_WIDTH,
        decoder_sparse_step=2,
    )),
    "qwen3_moe-top2-renormalised": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[1],
    )),
    "qwen3_moe-top4": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_experts_per_tok=4, norm_topk_prob=False,
    )),
}
NUM_LAYERS = 4
SPARSE_LAYER = NUM_LAYERS - 1
LAYOUTS = ("per_expert", "stacked", "gguf")


def tiny_config(config_class: type[PretrainedConfig], **moe: object) -> PretrainedConfig:
    return config_class(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
        moe_intermediate_size=EXPERT_WIDTH, **moe,
    )


class Checkpoint:
    """A tiny random model, its sparse layers' weights drawn large enough that outputs are
    of order 1, saved per expert (`save_pretrained`) and stacked (its state dict)."""

    def __init__(self, case: str, directory: Path) -> None:
        config_class, model_class, moe = CASES[case]
        torch.manual_seed(0)
        self.model = model_class(tiny_config(config_class, **moe)).eval()
        self.model.set_experts_implementation("eager")  # the textbook loop, not its grouped_mm
        for name, param in self.model.named_parameters():
            if ".mlp." in name:
                torch.nn.init.normal_(param, std=0.2)
        self.shape = MoeShape.from_hf(self.model.config)
        self.directory = directory
        self.model.save_pretrained(directory / "per_expert")
        state = self.model.state_dict()
        mlp = {name: tensor.contiguous() for name, tensor in state.items() if ".mlp." in name}
        save_file(mlp, str(directory / "stacked.safetensors"))

    @property
    def oracle(self) -> torch.nn.Module:
        return self.model.model.layers[SPARSE_LAYER].mlp

    def tensors(self, layout: str) -> Iterator[tuple[str, TensorSlice]]:
        """(name, tensor) as each layout names them; safetensors ones read lazily."""
        if layout == "gguf":
            yield from ((moe_gguf_name(name), tensor) for name, tensor in gguf_tensors(self.oracle))
            return
        file_name = {"per_expert": "per_expert/model.safetensors", "stacked": "stacked.safetensors"}
        with safe_open(str(self.directory / file_name[layout]), framework="pt") as file:
            yield from ((name, file.get_slice(name)) for name in file.keys())


def gguf_tensors(block: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A transformers block's weights as llama.cpp's converter writes them: each part's
    experts stacked `[E, rows, cols]`, the shared expert's gate as a vector."""
    layer = f"blk.{SPARSE_LAYER}"
    gate, up = block.experts.gate_up_proj.detach().chunk(2, dim=1)
    yield f"{layer}.ffn_gate_inp.weight", block.gate.weight.detach()
    yield f"{layer}.ffn_gate_exps.weight", gate
    yield f"{layer}.ffn_up_exps.weight", up
    yield f"{layer}.ffn_down_exps.weight", block.experts.down_proj.detach()
    if hasattr(block, "shared_expert"):
        for part in ("gate", "up", "down"):
            weight = getattr(block.shared_expert, f"{part}_proj").weight.detach()
            yield f"{layer}.ffn_{part}_shexp.weight", weight
        shared_gate = block.shared_expert_gate.weight.detach().flatten()
        yield f"{layer}.ffn_gate_inp_shexp.weight", shared_gate


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Checkpoint:
    return Checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def load_block(
    block: SparseMoeBlock, tensors: Iterable[tuple[str, TensorSlice]], shape: MoeShape, layer: int
) -> None:
    """Fill `block` from a checkpoint's tensors as the loader does: stacks cut per expert,
    names mapped to (parameter, block), every block of every parameter written."""
    params = parameter_loaders(block)
    filled: dict[str, set[int]] = {name: set() for name in params}
    prefix = f"model.layers.{layer}.mlp."
    for stacked_name, stacked in tensors:
        for name, source in split_expert_stacks(stacked_name, stacked, shape):
            mapped = moe_checkpoint_name(name, shape)
            if mapped is None or not mapped[0].startswith(prefix):
                continue
            target, index = mapped[0].removeprefix(prefix), mapped[1]
            param, load, _ = params[target]
            load(param, source, index)
            filled[target].add(index)
    missing = {name: num_blocks - len(filled[name]) for name, (_, _, num_blocks) in params.items()}
    assert not any(missing.values()), f"blocks never written: {missing}"


def built_block(shape: MoeShape, rank: int = 0, ranks: int = 1) -> SparseMoeBlock:
    with split_across(TensorParallel(rank, ranks)):
        return SparseMoeBlock(shape)


def well_routed_tokens(router: torch.Tensor, count: int, k: int, seed: int) -> torch.Tensor:
    """`count` random hidden states, none with its k-th and (k+1)-th logits within
    `ROUTING_MARGIN` of each other."""
    generator = torch.Generator().manual_seed(seed)
    kept = torch.empty(0, router.shape[1])
    while len(kept) < count:
        tokens = torch.randn(64, router.shape[1], generator=generator)
        top = (tokens @ router.T).topk(min(k + 1, router.shape[0]), dim=-1).values
        clear = top[:, k - 1] - top[:, -1] > ROUTING_MARGIN if k < router.shape[0] else slice(None)
        kept = torch.cat([kept, tokens[clear]])
    return kept[:count]


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_block_matches_transformers(checkpoint: Checkpoint, layout: str) -> None:
    block = built_block(checkpoint.shape)
    load_block(block, checkpoint.tensors(layout), checkpoint.shape, SPARSE_LAYER)
    k = checkpoint.shape.num_experts_per_tok
    for count in TOKEN_COUNTS:
        hidden = well_routed_tokens(checkpoint.oracle.gate.weight, count, k, seed=count)
        close(block(hidden), checkpoint.oracle(hidden[None])[0])


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_two_ranks_partial_sums_add_up_to_one_rank(
    checkpoint: Checkpoint, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank reads its half of every expert's channels (and the shared expert's) and
    returns a partial sum, added up by one collective per forward, here counted instead."""
    shape = checkpoint.shape
    reductions = []
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: reductions.append(self) or x)
    whole = built_block(shape)
    load_block(whole, checkpoint.tensors(layout), shape, SPARSE_LAYER)
    hidden = well_routed_tokens(whole.gate.weight, 37, shape.num_experts_per_tok, seed=1)
    expected = whole(hidden)
    partials = []
    for rank in range(2):
        block = built_block(shape, rank, 2)
        assert block.experts.gate_up_proj.weight.shape == (EXPERTS, EXPERT_WIDTH, HIDDEN)
        load_block(block, checkpoint.tensors(layout), shape, SPARSE_LAYER)
        partials.append(block(hidden))
    assert [(group.rank, group.size) for group in reductions] == [(0, 1), (0, 2), (1, 2)]
    close(partials[0] + partials[1], expected)
    assert not torch.allclose(partials[0], expected, atol=1e-3)  # each rank holds only a part


class ExpertMatmuls(TorchFunctionMode):
    """Which experts' gate_up weights the forward multiplies by, and which calls read a
    tensor back to the host."""

    HOST_READS = {"tolist", "item", "nonzero", "__bool__", "__int__", "__index__", "cpu", "numpy"}

    def __init__(self, stack: torch.Tensor) -> None:
        super().__init__()
        self.stack, self.experts, self.host_reads = stack, [], []

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        if func is F.linear and args[1].untyped_storage().data_ptr() == self.stack.data_ptr():
            offset = args[1].data_ptr() - self.stack.data_ptr()
            self.experts.append(offset // (self.stack.stride(0) * self.stack.element_size()))
        if getattr(func, "__name__", "") in self.HOST_READS:
            self.host_reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_a_decode_batch_runs_only_the_experts_it_routes_to() -> None:
    shape = MoeShape(HIDDEN, 64, 2, EXPERT_WIDTH, True, 0, 1, ())
    block = random_block(shape, seed=3)
    hidden = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3))
    expert_ids, weights = block.route(hidden)
    routed = set(expert_ids.flatten().tolist())
    with ExpertMatmuls(block.experts.gate_up_proj.weight) as calls:
        block.experts.grouped_loop(hidden, expert_ids, weights)
    assert sorted(calls.experts) == sorted(routed)  # each routed expert once, no other
    assert len(routed) < shape.num_experts
    assert calls.host_reads == ["tolist"]  # the counts, once


@given(
    tokens=st.integers(1, 40),
    k=st.integers(1, 8),
    renormalise=st.booleans(),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
@torch.inference_mode()
def test_any_batch_and_top_k_match_transformers(
    tokens: int, k: int, renormalise: bool, shared: bool, seed: int
) -> None:
    moe = dict(num_experts_per_tok=k, norm_topk_prob=renormalise)
    if shared:
        config = tiny_config(Qwen2MoeConfig, shared_expert_intermediate_size=SHARED_WIDTH, **moe)
        oracle_class = Qwen2MoeSparseMoeBlock
    else:
        config = tiny_config(Qwen3MoeConfig, **moe)
        oracle_class = Qwen3MoeSparseMoeBlock
    config._experts_implementation = "eager"
    check_against(oracle_class(config), MoeShape.from_hf(config), tokens, seed)


@pytest.mark.parametrize("oracle_class, config", [
    (Qwen3NextSparseMoeBlock, Qwen3NextConfig(
        hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=SHARED_WIDTH,
    )),
    (Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=4,
        moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=SHARED_WIDTH,
    )),
], ids=["qwen3_next", "qwen3_5_moe"])
@torch.inference_mode()
def test_hybrid_models_mlps_match_transformers(
    oracle_class: type[torch.nn.Module], config: PretrainedConfig
) -> None:
    config._experts_implementation = "eager"
    check_against(oracle_class(config), MoeShape.from_hf(config), 37, seed=5)


def check_against(oracle: torch.nn.Module, shape: MoeShape, tokens: int, seed: int) -> None:
    """Our block, filled from `oracle`'s parameters (stacked experts), gives its output."""
    torch.manual_seed(seed)
    for param in oracle.parameters():
        torch.nn.init.normal_(param, std=0.2)
    block = built_block(shape)
    state = oracle.state_dict().items()
    load_block(block, ((f"model.layers.0.mlp.{n}", t) for n, t in state), shape, 0)
    hidden = well_routed_tokens(oracle.gate.weight, tokens, shape.num_experts_per_tok, seed)
    close(block(hidden), oracle(hidden[None])[0])


def random_block(shape: MoeShape, seed: int) -> SparseMoeBlock:
    block = built_block(shape)
    generator = torch.Generator().manual_seed(seed)
    for param in block.parameters():
        param.data.normal_(std=0.2, generator=generator)
    return block


@pytest.mark.parametrize("tokens, k", [(1, 1), (1, 8), (16, 2), (37, 4)])
@torch.inference_mode()
def test_the_grouped_gemm_path_matches_the_grouped_loop(tokens: int, k: int) -> None:
    """The CUDA path's sorting, group ends and un-sorting, through torch's grouped GEMM on
    the CPU; reading nothing back to the host, so a CUDA graph can hold it."""
    block = random_block(MoeShape(HIDDEN, 16, k, EXPERT_WIDTH, False, 0, 1, ()), seed=tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(k))
    expert_ids, weights = block.route(hidden)
    with ExpertMatmuls(block.experts.gate_up_proj.weight) as calls:
        grouped = block.experts.grouped_gemm(hidden, expert_ids, weights)
    assert calls.host_reads == []
    close(grouped, block.experts.grouped_loop(hidden, expert_ids, weights))


@pytest.mark.parametrize("tokens, dtype, hidden_size, grouped", [
    (1, torch.float32, HIDDEN, False),  # 2 (token, k) pairs for 32 experts: the loop
    (2, torch.float32, HIDDEN, True),  # 4 pairs, one per 8 experts: the grouped GEMM
    (16, torch.bfloat16, HIDDEN, True),
    (16, torch.float16, HIDDEN, True),
    (16, torch.bfloat16, 36, False),  # rows of 72 bytes, not 16-byte aligned
])
@torch.inference_mode()
def test_the_cpu_takes_the_grouped_gemm_for_enough_pairs_and_it_matches_the_loop(
    tokens: int, dtype: torch.dtype, hidden_size: int, grouped: bool
) -> None:
    block = random_block(MoeShape(hidden_size, 32, 2, EXPERT_WIDTH, True, 0, 1, ()), seed=5)
    block = block.to(dtype)
    hidden = torch.randn(tokens, hidden_size, generator=torch.Generator().manual_seed(5))
    hidden = hidden.to(dtype)
    expert_ids, weights = block.route(hidden)
    with ExpertMatmuls(block.experts.gate_up_proj.weight) as calls:
        ours = block.experts(hidden, expert_ids, weights)
    assert (calls.experts == []) == grouped  # the grouped GEMM never calls `F.linear`
    looped = block.experts.grouped_loop(hidden, expert_ids, weights)
    torch.testing.assert_close(ours, looped, rtol=2e-2, atol=2e-2 * looped.abs().max().item())


@pytest.mark.parametrize("config_class, moe, sparse", [
    (Qwen2MoeConfig, dict(decoder_sparse_step=2, mlp_only_layers=[3]), [1, 5]),
    (Qwen3MoeConfig, dict(decoder_sparse_step=1, mlp_only_layers=[0, 4]), [1, 2, 3, 5]),
    (Qwen3MoeConfig, dict(decoder_sparse_step=3), [2, 5]),
])
def test_the_layer_plan_is_transformers(
    config_class: type[PretrainedConfig], moe: dict[str, object], sparse: list[int]
) -> None:
    config = config_class(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, num_experts=4, **moe,
    )
    model_class = Qwen2MoeForCausalLM if config_class is Qwen2MoeConfig else Qwen3MoeForCausalLM
    with torch.device("meta"):
        layers = model_class(config).model.layers
    theirs = [i for i, layer in enumerate(layers) if "SparseMoeBlock" in type(layer.mlp).__name__]
    shape = MoeShape.from_hf(config)
    assert [i for i in range(6) if shape.is_sparse(i)] == theirs == sparse


def test_shapes_from_every_config() -> None:
    qwen3_5 = MoeShape.from_hf(Qwen3_5MoeConfig(text_config=dict(
        hidden_size=HIDDEN, num_experts=EXPERTS, shared_expert_intermediate_size=SHARED_WIDTH,
    )))
    assert qwen3_5.norm_topk_prob and qwen3_5.shared_expert_intermediate_size == SHARED_WIDTH
    assert all(qwen3_5.is_sparse(layer) for layer in range(48))
    qwen3 = MoeShape.from_hf(tiny_config(Qwen3MoeConfig, num_experts_per_tok=8))
    assert (qwen3.num_experts_per_tok, qwen3.shared_expert_intermediate_size) == (8, 0)
    assert MoeShape.from_hf(Qwen2Config()) is None and MoeShape.from_hf(Qwen3Config()) is None
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        qwen3.check_splittable(3)
    qwen3.check_splittable(4)


def test_checkpoint_names() -> None:
    shape = MoeShape.from_hf(tiny_config(Qwen2MoeConfig, shared_expert_intermediate_size=48))
    mlp = "model.layers.2.mlp."
    assert moe_checkpoint_name(mlp + "experts.5.up_proj.weight", shape) == (
        mlp + "experts.gate_up_proj.weight", 11)
    assert moe_checkpoint_name(mlp + "experts.7.down_proj.weight", shape) == (
        mlp + "experts.down_proj.weight", 7)
    assert moe_checkpoint_name(mlp + "shared_expert.up_proj.weight", shape) == (
        mlp + "shared_expert.gate_up_proj.weight", 1)
    prefixed = "model.language_model.layers.0.mlp.gate.weight"  # Qwen3.5's checkpoints
    assert moe_checkpoint_name(prefixed, shape) == (prefixed, 0)
    for dense in (mlp + "gate_proj", "model.layers.2.self_attn.q_proj", "lm_head"):
        assert moe_checkpoint_name(f"{dense}.weight", shape) is None
    with pytest.raises(ValueError, match="expert 8"):
        moe_checkpoint_name(mlp + "experts.8.gate_proj.weight", shape)
    router = mlp + "gate.weight"
    assert [name for name, _ in split_expert_stacks(router, None, shape)] == [router]


@pytest.mark.parametrize("arch", ["QWEN2MOE", "QWEN3MOE", "QWEN3NEXT", "QWEN35MOE"])
def test_gguf_names_are_llama_cpps(arch: str) -> None:
    """Every MoE tensor llama.cpp writes for these models is named, as gguf's own name
    map pairs it with transformers' name."""
    model_arch = gguf.MODEL_ARCH[arch]
    names = gguf.get_tensor_name_map(model_arch, 4)
    moe_tensors = [
        tensor for tensor in gguf.MODEL_TENSORS[model_arch]
        if "EXP" in tensor.name or "GATE_INP" in tensor.name
    ]
    assert moe_tensors
    for tensor in moe_tensors:
        gguf_name = gguf.TENSOR_NAMES[tensor].format(bid=3)
        ours = moe_gguf_name(f"{gguf_name}.weight")
        assert ours is not None, gguf_name
        assert names.get_name(ours.removesuffix(".weight")) == gguf_name
    assert moe_gguf_name("blk.3.ffn_gate.weight") is None  # a dense layer's


def cuda_grouped_gemm_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_grouped_gemm_available(), reason="needs a CUDA GPU of sm90 or sm100")
@torch.inference_mode()
def test_grouped_gemm_on_cuda_matches_the_grouped_loop_and_replays_in_a_cuda_graph() -> None:
    """bf16 on the GPU: the grouped GEMM gives the grouped loop's sums for the same routing,
    and the whole block, captured once, replays new tokens as it runs them eagerly."""
    shape = MoeShape(256, 64, 8, 128, True, 128, 1, ())
    block = random_block(shape, seed=7).to("cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(16, 256, generator=generator).cuda().bfloat16() for _ in range(2)]
    assert runs_grouped_gemm(batches[0], channels=128)
    expert_ids, weights = block.route(batches[0])
    grouped = block.experts.grouped_gemm(batches[0], expert_ids, weights)
    looped = block.experts.grouped_loop(batches[0], expert_ids, weights)
    scale = looped.abs().max().item()
    torch.testing.assert_close(grouped, looped, rtol=2e-2, atol=2e-2 * scale)
    static = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block(static)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block(static)
    static.copy_(batches[1])
    graph.replay()
    torch.testing.assert_close(captured, block(batches[1]))


def test_decode_graphs_are_left_out_where_the_experts_would_sync(
    newer_kind_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A CUDA graph cannot hold the grouped loop, which reads its row counts on the host:
    where torch's grouped GEMM cannot run the experts (before sm90, or not in bf16), decode
    steps run eagerly, with a warning that says why. No GPU needed: only the decision."""
    from nanoqwen.config import RunnerSettings
    from nanoqwen.model import moe
    from nanoqwen.model.qwen import QwenForCausalLM
    from nanoqwen.runner import startup
    from nanoqwen.weights.checkpoint import read_checkpoint

    class GraphBackend:
        supports_cuda_graphs = True

    config = read_checkpoint(newer_kind_dirs["qwen3_moe"]).model_config
    with torch.device("meta"):
        model = QwenForCausalLM(config)
    cuda = torch.device("cuda", 0)

    def buckets(dtype: torch.dtype, major: int) -> list[int]:
        monkeypatch.setattr(moe, "cuda_major", lambda index: major)
        settings = RunnerSettings(device=cuda, dtype=dtype, page_size=16, max_model_len=256,
                                  max_num_seqs=4, chunk_size=64, kv_storage_dtype=dtype)
        return startup.decode_buckets(settings, model, GraphBackend, cuda)

    assert buckets(torch.bfloat16, 9) == [1, 2, 4]
    assert not caplog.records
    assert buckets(torch.bfloat16, 8) == buckets(torch.float16, 9) == []
    assert "decode steps run without CUDA graphs" in caplog.text
