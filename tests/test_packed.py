"""Linear weights prepacked for oneDNN (`model/packed.py`): the CPU's weight form.

A float32 model on a CPU is always packed, and a bf16 one where the CPU multiplies bf16 in
hardware. The packed matmul must give what `F.linear` gives: the same bits in bf16, and in
float32 the same result up to the order of the sums (a few float32 roundings). Packing
swaps the matmul, not the layer, and an lm_head tied to the embedding gets a copy of its
own, since the embedding's lookup needs the plain rows.
"""

import pytest
import torch
import torch.nn.functional as F
from oracle import greedy, random_prompts, run_to_completion
from torch import nn

from nanoqwen import LLMEngine
from nanoqwen.model.layers import RowParallelLinear, Split
from nanoqwen.model.packed import pack_linear_weights
from nanoqwen.weights import loader
from nanoqwen.weights.checkpoint import read_checkpoint

# The tests run torch's AVX2 kernels, where the engine would not pack bf16 by itself:
# where oneDNN can multiply bf16 at all, these tests pack it on purpose.
BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        reason="oneDNN cannot multiply bfloat16 on this CPU",
    ),
)
DTYPES = [torch.float32, BF16]
pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch without oneDNN"
)


def assert_same_product(packed: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16: the same bits. float32: within a few roundings of the largest term's size."""
    if packed.dtype == torch.bfloat16:
        assert torch.equal(packed, expected)
    else:
        torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 128, 512])
@pytest.mark.parametrize("out_features, in_features, bias", [(96, 64, True), (64, 352, False)])
def test_packed_linear_equals_f_linear(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight, layer.bias)
        pack_linear_weights(layer)
        assert layer.weight.is_mkldnn
        assert_same_product(layer(x), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_row_parallel_layer_keeps_its_own_forward(dtype: torch.dtype) -> None:
    """Packing swaps the matmul, not the layer: a row-parallel layer still runs its own
    forward (the all-reduce, with one rank none) around the packed product."""
    torch.manual_seed(0)
    layer = RowParallelLinear(Split(0, 64), 32).to(dtype)
    x = torch.randn(3, 64, dtype=dtype)
    with torch.inference_mode():
        expected = F.linear(x, layer.weight)
        pack_linear_weights(layer)
        assert isinstance(layer, RowParallelLinear) and layer.weight.is_mkldnn
        assert_same_product(layer(x), expected)


@pytest.mark.parametrize("dtype, packs", [(torch.float32, True), (torch.float16, False)])
def test_a_cpu_packs_float32_weights(qwen3_dir: str, dtype: torch.dtype, packs: bool) -> None:
    """The loader's own choice on a CPU: float32 is packed; float16 is not (oneDNN's
    float16 matmul needs AVX512-FP16 or AMX), nor is anything off a CPU."""
    checkpoint = read_checkpoint(qwen3_dir)
    form = loader.weight_form(None, checkpoint, dtype, torch.device("cpu"))
    assert form == ("onednn_packed" if packs else None)
    assert loader.weight_form(None, checkpoint, dtype, torch.device("cuda")) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_leaves_greedy_tokens_unchanged_and_gives_a_tied_lm_head_its_own_copy(
    model_dir: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines = []
    for packs in (True, False):
        form = "onednn_packed" if packs else None
        monkeypatch.setattr(loader, "weight_form", lambda *args, form=form: form)
        engine = LLMEngine(model_dir, device="cpu", dtype=dtype, num_pages=200, max_num_seqs=16)
        engines.append(engine)
    packed, plain = (engine.runner.model for engine in engines)
    assert packed.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert not plain.model.layers[0].mlp.down_proj.weight.is_mkldnn
    assert not packed.model.embed_tokens.weight.is_mkldnn  # the lookup keeps its plain rows
    assert packed.lm_head.weight.is_mkldnn
    tied = plain.lm_head.weight is plain.model.embed_tokens.weight
    assert plain.config.tie_word_embeddings == tied
    assert torch.equal(packed.lm_head.weight.to_dense(), plain.lm_head.weight)  # same bits
    prompts = random_prompts(800, [1, 9, 40, 250, 17], seed=7)
    tokens = []
    for engine in engines:
        ids = [engine.add_request(prompt, greedy(8)) for prompt in prompts]
        final = run_to_completion(engine)
        tokens.append([final[request_id].token_ids for request_id in ids])
    assert tokens[0] == tokens[1]
