"""The quantized KV cache (`kv_cache_dtype` "int8" or "fp8_e4m3"), checked against full precision.

Quantizing keys and values loses precision by design, so nothing here is exact; each test
states how far off it may be and why:

* a vector's round trip is off by at most half a step of its code type: for int8 half of
  `scale` (1/254 of the vector's largest magnitude), for fp8 e4m3, with 3 mantissa bits,
  1/16 of the element plus half of its smallest step;
* attention over a quantized pool stays within a stated distance of attention over the same
  keys and values kept in full precision, for both torch backends and any batch mix;
* the pool gets as many more pages as its smaller page allows;
* the engine's greedy output agrees with full precision, except where the full-precision
  model itself almost hesitated: at the first token where they part, its top two logits
  were close (a near-tie the quantization error can flip).
"""

import click
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen import LLMEngine
from nanoqwen.attention import AttentionBackend, ReferenceBackend
from nanoqwen.attention_torch import TorchBackend
from nanoqwen.cli import engine_options, pop_engine_options
from nanoqwen.config import KV_CACHE_DTYPES
from nanoqwen.kv_pool import KVPool, dequantize, quantize
from oracle import greedy, hf_last_logits, random_prompts, run_to_completion
from test_attention import HEAD_DIM, HEADS, ROWS, Row, random_step

QUANTIZED = ["int8", "fp8_e4m3"]
CPU = torch.device("cpu")


# ----------------------------------------------------------------- round trip
def round_trip_bound(vectors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most each element may move through `quantize` and `dequantize` (see above)."""
    scale = vectors.abs().amax(dim=-1, keepdim=True) / (127 if dtype == torch.int8 else 448)
    if dtype == torch.int8:
        return scale / 2
    smallest_step = scale * 2.0**-9  # e4m3's smallest subnormal, 2^-9, in the vector's units
    return vectors.abs() / 16 + smallest_step / 2


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(QUANTIZED),
    tokens=st.integers(1, 8),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_within_half_a_step(
    name: str, tokens: int, magnitude: float, seed: int
) -> None:
    dtype = KV_CACHE_DTYPES[name]
    vectors = torch.randn(tokens, 3, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    vectors = vectors * magnitude
    vectors[0, 0] = 0  # an all-zero vector must survive too
    codes, scales = quantize(vectors, dtype)
    assert codes.dtype == dtype and scales.shape == vectors.shape[:-1]
    error = (dequantize(codes, scales, torch.float32) - vectors).abs()
    assert (error <= round_trip_bound(vectors, dtype) * (1 + 1e-5)).all()
    assert not dequantize(codes, scales, torch.float32)[0, 0].any()


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_pool_stores_codes_and_scales_and_gathers_dequantized_pages(name: str) -> None:
    dtype = KV_CACHE_DTYPES[name]
    pool = KVPool(2, 2, HEAD_DIM, 4, 6, torch.float32, CPU, storage_dtype=dtype)
    assert pool.is_quantized and pool.kv.dtype == dtype and pool.kv.element_size() == 1
    k, v = torch.randn(2, 8, 2, HEAD_DIM)
    slots = torch.arange(8, 16)  # pages 2 and 3
    pool.write(1, k, v, slots)
    for kind, written in enumerate((k, v)):
        read = pool.gather(1, kind, torch.tensor([2, 3])).flatten(0, 1)
        assert read.dtype == torch.float32
        assert ((read - written).abs() <= round_trip_bound(written, dtype) * (1 + 1e-5)).all()
    assert not pool.gather(0, 0, torch.tensor([2, 3])).any()  # another layer: untouched


# ----------------------------------------------------------------- attention
# Unit-normal queries, keys and values: int8 moves each key and value element by at most
# 0.4% of its vector's largest one, fp8 by 6% of itself, and attention's output moves by
# about as much. Measured worst cases: 0.02 (int8) and 0.10 (fp8); stated with headroom.
ATTENTION_TOLERANCE = {"int8": 0.05, "fp8_e4m3": 0.25}


def attend_full_and_quantized(
    backend_class: type[AttentionBackend],
    name: str,
    rows: list[Row],
    heads: tuple[int, int],
    page_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One random step attended over a full-precision pool and over a quantized pool that
    were handed the same keys and values."""
    num_heads, num_kv_heads = heads
    torch.manual_seed(seed)
    num_pages = sum(-(-(cached + new) // page_size) for cached, new in rows) + 1
    pools = [
        KVPool(1, num_kv_heads, HEAD_DIM, page_size, num_pages, dtype, CPU, storage_dtype=storage)
        for storage in (None, KV_CACHE_DTYPES[name])
    ]
    every_slot = torch.arange(num_pages * page_size)
    cached_k, cached_v = torch.randn(2, every_slot.numel(), num_kv_heads, HEAD_DIM, dtype=dtype)
    inputs, _ = random_step(pools[0], rows, seed)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(2, num_tokens, num_kv_heads, HEAD_DIM, dtype=dtype)
    outputs = []
    for pool in pools:
        pool.write(0, cached_k, cached_v, every_slot)
        backend = backend_class(pool, num_heads, num_kv_heads, HEAD_DIM)
        backend.plan(inputs.metadata)
        outputs.append(backend.forward(0, q, k, v).float())
    return outputs[0], outputs[1]


@settings(max_examples=40, deadline=None)
@given(
    backend_class=st.sampled_from([ReferenceBackend, TorchBackend]),
    name=st.sampled_from(QUANTIZED),
    rows=ROWS,
    heads=st.sampled_from(HEADS),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_attention_over_a_quantized_pool_is_close_to_full_precision(
    backend_class: type[AttentionBackend],
    name: str,
    rows: list[Row],
    heads: tuple[int, int],
    page_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    full, quantized = attend_full_and_quantized(
        backend_class, name, rows, heads, page_size, dtype, seed
    )
    assert (full - quantized).abs().max() <= ATTENTION_TOLERANCE[name]


def test_the_torch_backend_gathers_a_quantized_pool_s_decodes() -> None:
    pool = KVPool(1, 2, HEAD_DIM, 4, 16, torch.float32, CPU, storage_dtype=torch.int8)
    inputs, _ = random_step(pool, [(30, 1), (0, 12), (5, 1)], seed=0)
    backend = TorchBackend(pool, 4, 2, HEAD_DIM)
    backend.plan(inputs.metadata)
    assert backend.decodes is None  # no sparse product over one-byte codes
    assert backend.padded is not None and backend.padded.output_rows.tolist() == [0, 13]


# ----------------------------------------------------------------- sizing
def make_engine(model_dir: str, kv_cache_dtype: str, **options: object) -> LLMEngine:
    settings = dict(device="cpu", page_size=4, max_model_len=64, max_num_seqs=4, chunk_size=16)
    return LLMEngine(model_dir, kv_cache_dtype=kv_cache_dtype, **(settings | options))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_memory_holds_more_pages(qwen3_dir: str, name: str, dtype: str) -> None:
    memory = 400_000
    engines = {
        kv: make_engine(qwen3_dir, kv, dtype=dtype, kv_cache_memory=memory) for kv in ("auto", name)
    }
    shape = engines["auto"].runner.model_config
    # Per token and KV head, in both K and V of every layer: head_dim numbers in the model's
    # dtype, or head_dim bytes and a 4-byte scale.
    slots = 2 * shape.num_layers * 4 * shape.num_kv_heads
    full_page = slots * shape.head_dim * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    quantized_page = slots * (shape.head_dim + 4)
    usable = {kv: engine.pool.num_usable_pages for kv, engine in engines.items()}
    assert usable == {"auto": memory // full_page, name: memory // quantized_page}
    # head_dim 32: 3.6 times the float32 pages, 1.8 times the bfloat16 ones.
    assert usable[name] / usable["auto"] == pytest.approx(full_page / quantized_page, rel=0.02)
    stats = engines[name].stats()
    assert stats["kv_cache_bytes"] == (usable[name] + 1) * quantized_page <= memory + quantized_page


# ----------------------------------------------------------------- the engine
# A full-precision top-2 logit margin below this is a near-tie. On the fixtures' random
# weights the margins along a greedy output spread over 0 to about 1.2 (median about 0.3);
# keys and values off by a step of int8 (fp8) move a logit by thousandths (hundredths):
# the measured divergences came at margins up to 0.004 (int8) and 0.036 (fp8).
NEAR_TIE = {"int8": 0.02, "fp8_e4m3": 0.06}
PROMPT_LENGTHS = [5, 17, 30, 9, 23, 3]
NEW_TOKENS = 16


def greedy_outputs(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(NEW_TOKENS), request_id=str(index))
    outputs = run_to_completion(engine)  # checks the page accounting after every step
    assert engine.stats()["pages_used"] == 0
    return [outputs[str(index)].token_ids for index in range(len(prompts))]


def top_two_margin(model_dir: str, tokens: list[int]) -> float:
    top = hf_last_logits(model_dir, tokens).topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_greedy_output_agrees_with_full_precision_except_at_near_ties(
    model_dir: str, name: str, backend: str
) -> None:
    # A small pool, so requests wait, share cached prefixes and return pages under pressure.
    options = dict(attention_backend=backend, num_pages=40)
    prompts = random_prompts(800, PROMPT_LENGTHS, seed=3)
    prompts.append(prompts[1][:12] + prompts[4][:6])  # shares a cached prefix with prompt 1
    full = greedy_outputs(make_engine(model_dir, "auto", **options), prompts)
    quantized = greedy_outputs(make_engine(model_dir, name, **options), prompts)
    agreed = 0
    for prompt, expected, got in zip(prompts, full, quantized):
        first_difference = next(
            (i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected)
        )
        agreed += first_difference
        if first_difference < len(expected):
            context = prompt + expected[:first_difference]
            assert top_two_margin(model_dir, context) < NEAR_TIE[name]
    # Near-ties are rare: most tokens agree.
    assert agreed >= 0.75 * len(prompts) * NEW_TOKENS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_quantized_kv_cache_runs_on_the_torch_backend(qwen3_dir: str) -> None:
    engine = make_engine(qwen3_dir, "fp8_e4m3", device="cuda", num_pages=40)
    assert isinstance(engine.runner.backend, TorchBackend)
    assert engine.pool.kv.dtype == torch.float8_e4m3fn and engine.pool.kv.is_cuda
    outputs = greedy_outputs(engine, random_prompts(800, PROMPT_LENGTHS, seed=3))
    assert all(len(tokens) == NEW_TOKENS for tokens in outputs)


# ----------------------------------------------------------------- errors and options
@pytest.mark.parametrize("value", ["fp16", "int4", "", None])
def test_an_unknown_kv_cache_dtype_is_refused(qwen3_dir: str, value: object) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(qwen3_dir, device="cpu", kv_cache_dtype=value)


def test_flashinfer_with_a_quantized_kv_cache_is_refused(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*attention_backend='torch'"):
        LLMEngine(qwen3_dir, device="cpu", kv_cache_dtype="int8", attention_backend="flashinfer")


def test_the_command_line_option_reaches_the_engine_config() -> None:
    seen = {}

    @click.command()
    @engine_options
    def command(**options: object) -> None:
        seen.update(pop_engine_options(options))

    assert CliRunner().invoke(command, ["--kv-cache-dtype", "fp8_e4m3"]).exit_code == 0
    assert seen["kv_cache_dtype"] == "fp8_e4m3"
    assert CliRunner().invoke(command, ["--kv-cache-dtype", "int3"]).exit_code != 0
