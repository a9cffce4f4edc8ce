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

import logging

import fake_flashinfer
import pytest
import torch
from cli_options import parse_engine_options
from cuda_helpers import build_model_64
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import greedy, hf_last_logits, random_prompts, run_to_completion
from test_attention import HEAD_DIM, HEADS, ROWS, Row, random_step

from nanoqwen import LLM, LLMEngine
from nanoqwen.attention import flashinfer_backend as attention_flashinfer
from nanoqwen.attention import registry
from nanoqwen.attention.base import AttentionBackend, ReferenceBackend
from nanoqwen.attention.flashinfer_backend import (
    FlashInferBackend,
    flashinfer_unsupported_reason,
)
from nanoqwen.attention.registry import attention_backend_class
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.config import KV_CACHE_DTYPES
from nanoqwen.memory.kv_quant import (
    TENSOR_SCALE,
    dequantize,
    quantize,
)
from nanoqwen.runner.startup import make_kv_cache
from nanoqwen.weights.checkpoint import read_checkpoint

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
    pool = make_kv_cache(2, 2, HEAD_DIM, 4, 6, torch.float32, CPU, storage_dtype=dtype)
    assert pool.is_quantized and pool.kv.dtype == dtype and pool.kv.element_size() == 1
    k, v = torch.randn(2, 8, 2, HEAD_DIM)
    slots = torch.arange(8, 16)  # pages 2 and 3
    pool.write(1, k, v, slots)
    for kind, written in enumerate((k, v)):
        read = pool.gather(1, kind, torch.tensor([2, 3])).flatten(0, 1)
        assert read.dtype == torch.float32
        assert ((read - written).abs() <= round_trip_bound(written, dtype) * (1 + 1e-5)).all()
    assert not pool.gather(0, 0, torch.tensor([2, 3])).any()  # another layer: untouched


def test_a_per_tensor_fp8_pool_stores_numbers_at_scale_one_and_saturates() -> None:
    pool = make_kv_cache(
        1, 2, HEAD_DIM, 4, 4, torch.bfloat16, CPU,
        storage_dtype=torch.float8_e4m3fn, per_vector_scales=False,
    )
    assert pool.scales is None and pool.nbytes == pool.kv.nbytes
    k, v = torch.randn(2, 4, 2, HEAD_DIM, dtype=torch.bfloat16) * 100
    k[0, 0, 0], v[3, 1, 5] = 1000, -2000  # beyond fp8's range
    pool.write(0, k, v, torch.arange(4, 8))
    largest = torch.finfo(torch.float8_e4m3fn).max
    for kind, written in enumerate((k, v)):
        expected = written.float().clamp(-largest, largest)
        read = pool.gather(0, kind, torch.tensor([1])).flatten(0, 1).float()
        # 3 mantissa bits: within 1/16 of the number, plus half the smallest subnormal step.
        assert ((read - expected).abs() <= expected.abs() / 16 + 2.0**-10).all()
    saturated = pool.gather(0, 0, torch.tensor([1]))[0, 0, 0, 0], pool.gather(0, 1, torch.tensor([1]))[0, 3, 1, 5]
    assert [float(x) for x in saturated] == [largest, -largest]


def test_int8_needs_a_scale_per_vector() -> None:
    with pytest.raises(ValueError, match="int8 KV cache needs a scale per vector"):
        make_kv_cache(1, 2, HEAD_DIM, 4, 4, torch.float32, CPU, storage_dtype=torch.int8,
               per_vector_scales=False)


# ----------------------------------------------------------------- attention
# Unit-normal queries, keys and values: int8 moves each key and value element by at most
# 0.4% of its vector's largest one, fp8 by 6% of itself, and attention's output moves by
# about as much; fp8 at one scale per tensor (flashinfer's pools) the same, as unit-normal
# numbers sit well inside its range. Measured worst cases: 0.02 (int8) and 0.10 (fp8);
# stated with headroom.
ATTENTION_TOLERANCE = {"int8": 0.05, "fp8_e4m3": 0.25}
# (kv_cache_dtype, a scale per vector?): the pools the backends may read.
POOL_KINDS = [("int8", True), ("fp8_e4m3", True), ("fp8_e4m3", False)]


def attend_full_and_quantized(
    backend_class: type[AttentionBackend],
    pool_kind: tuple[str, bool],
    rows: list[Row],
    heads: tuple[int, int],
    page_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One random step attended over a full-precision pool and over a quantized pool that
    were handed the same keys and values."""
    num_heads, num_kv_heads = heads
    name, per_vector_scales = pool_kind
    torch.manual_seed(seed)
    num_pages = sum(-(-(cached + new) // page_size) for cached, new in rows) + 1
    pools = [
        make_kv_cache(1, num_kv_heads, HEAD_DIM, page_size, num_pages, dtype, CPU, storage_dtype=storage,
               per_vector_scales=per_vector_scales)
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
    pool_kind=st.sampled_from(POOL_KINDS),
    rows=ROWS,
    heads=st.sampled_from(HEADS),
    page_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_attention_over_a_quantized_pool_is_close_to_full_precision(
    backend_class: type[AttentionBackend],
    pool_kind: tuple[str, bool],
    rows: list[Row],
    heads: tuple[int, int],
    page_size: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    full, quantized = attend_full_and_quantized(
        backend_class, pool_kind, rows, heads, page_size, dtype, seed
    )
    assert (full - quantized).abs().max() <= ATTENTION_TOLERANCE[pool_kind[0]]


def test_the_torch_backend_gathers_a_quantized_pool_s_decodes() -> None:
    pool = make_kv_cache(1, 2, HEAD_DIM, 4, 16, torch.float32, CPU, storage_dtype=torch.int8)
    inputs, _ = random_step(pool, [(30, 1), (0, 12), (5, 1)], seed=0)
    backend = TorchBackend(pool, 4, 2, HEAD_DIM)
    backend.plan(inputs.metadata)
    assert backend.decodes is None  # no sparse product over one-byte codes
    # Gathered and padded, in a group of their own (not padded to the prompt's length).
    [decodes] = backend.padded
    assert decodes.output_rows.tolist() == [0, 13] and decodes.mask.shape[2] == 1


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
    shape = engines["auto"].runner.model.attention_shape
    # Per token and KV head, in both K and V of every layer: head_dim numbers in the model's
    # dtype, or head_dim bytes and a 4-byte scale.
    slots = 2 * shape.num_layers * 4 * shape.num_kv_heads
    full_page = slots * shape.head_dim * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    quantized_page = slots * (shape.head_dim + 4)
    usable = {kv: engine.allocator.num_usable_pages for kv, engine in engines.items()}
    assert usable == {"auto": memory // full_page, name: memory // quantized_page}
    # head_dim 32: 3.6 times the float32 pages, 1.8 times the bfloat16 ones.
    assert usable[name] / usable["auto"] == pytest.approx(full_page / quantized_page, rel=0.02)
    kv_bytes = engines[name].stats()["kv_cache"]["bytes"]
    assert kv_bytes == (usable[name] + 1) * quantized_page <= memory + quantized_page


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
    assert engine.stats()["kv_cache"]["pages_used"] == 0
    return [outputs[str(index)].token_ids for index in range(len(prompts))]


def top_two_margin(model_dir: str, tokens: list[int]) -> float:
    top = hf_last_logits(model_dir, tokens).topk(2).values
    return float(top[0] - top[1])


@pytest.mark.slow
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
    assert_agrees_except_at_near_ties(model_dir, prompts, full, quantized, NEAR_TIE[name])


def assert_agrees_except_at_near_ties(
    model_dir: str,
    prompts: list[list[int]],
    full: list[list[int]],
    quantized: list[list[int]],
    near_tie: float,
    min_agreement: float = 0.75,
) -> None:
    """Each quantized output equals the full-precision one up to a token where float32's
    top two logits were within `near_tie`; and at least `min_agreement` of the tokens come
    before the first difference (near-ties are rare)."""
    agreed = 0
    for prompt, expected, got in zip(prompts, full, quantized, strict=True):
        first_difference = next(
            (i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected)
        )
        agreed += first_difference
        if first_difference < len(expected):
            context = prompt + expected[:first_difference]
            assert top_two_margin(model_dir, context) < near_tie
    assert agreed >= min_agreement * len(prompts) * NEW_TOKENS


# ----------------------------------------------------------------- tensor parallel, drafts
@pytest.mark.slow
def test_tensor_parallel_ranks_each_quantize_their_own_heads(qwen3_dir: str) -> None:
    """A scale belongs to one (token, KV head), so two ranks holding half the heads each
    store what one device stores, and decode the same tokens."""
    options = dict(device="cpu", kv_cache_dtype="int8", page_size=4, num_pages=24, chunk_size=16,
                   max_num_seqs=3)
    prompts = random_prompts(800, PROMPT_LENGTHS, seed=3)
    expected = [o.token_ids for o in LLM(qwen3_dir, **options).generate(prompts, greedy(8))]
    split = LLM(qwen3_dir, tensor_parallel_size=2, **options)
    try:
        assert [o.token_ids for o in split.generate(prompts, greedy(8))] == expected
        stats = split.stats()
        # both ranks' pools
        assert stats["kv_cache"]["bytes"] == 2 * split.engine.runner.kv_cache.nbytes
        assert stats["kv_cache"]["pages_used"] == 0
    finally:
        split.shutdown()


@pytest.mark.slow
def test_a_draft_model_s_pool_is_quantized_too(qwen2_dir: str, qwen3_dir: str) -> None:
    memory = 1 << 20
    engine = make_engine(qwen3_dir, "int8", draft_model=qwen2_dir, num_speculative_tokens=3,
                         kv_cache_memory=memory)
    target, draft = engine.runner.kv_cache, engine.step_hooks[0].proposer.runner.kv_cache
    assert draft.kv.dtype == torch.int8 and draft.scales is not None
    page_bytes = [pool.nbytes // pool.num_pages for pool in (target, draft)]
    assert draft.num_pages == target.num_pages == memory // sum(page_bytes) + 1
    prompts = random_prompts(800, PROMPT_LENGTHS[:3], seed=3)
    plain = greedy_outputs(make_engine(qwen3_dir, "int8", kv_cache_memory=memory), prompts)
    assert greedy_outputs(engine, prompts) == plain


# ----------------------------------------------------------------- flashinfer's fp8 pages
@pytest.fixture(scope="module")
def model_64_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """head_dim 64, one of flashinfer's sizes."""
    return build_model_64(tmp_path_factory.mktemp("qwen2_64"), num_key_value_heads=2)


@pytest.mark.slow
def test_fp8_on_flashinfer_stand_ins_reads_fp8_pages_at_one_scale_per_tensor(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flashinfer's wrappers replaced by `fake_flashinfer`'s (its parameter names; the
    reference's attention over the pages it is handed, read in the planned kv_data_type
    times the scales given to run). The stand-ins run any dtype and head size, so this runs
    on the float32 fixtures. The engine plans fp8 pages, passes their scales, sizes the pool
    by one byte per number and no scales, and decodes like float32 pages up to near-ties.
    At scale 1 the fixtures' small random keys and values lie among fp8's subnormals, so
    outputs part earlier than with a scale per vector (on some prompts at the first token),
    but only where float32 itself nearly hesitated."""
    log = fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(registry, "flashinfer_backend_for", lambda *args: FlashInferBackend)
    monkeypatch.setattr(attention_flashinfer, "flashinfer_unsupported_reason", lambda *args: None)
    memory = 400_000
    options = dict(attention_backend="flashinfer", kv_cache_memory=memory)
    engines = {kv: make_engine(model_dir, kv, **options) for kv in ("auto", "fp8_e4m3")}
    pool = engines["fp8_e4m3"].runner.kv_cache
    assert pool.kv.dtype == torch.float8_e4m3fn and pool.scales is None
    shape = engines["auto"].runner.model.attention_shape
    fp8_page = 2 * shape.num_layers * 4 * shape.num_kv_heads * shape.head_dim  # bytes
    # One byte per number and no scales: four times float32's pages.
    assert engines["fp8_e4m3"].allocator.num_usable_pages == memory // fp8_page
    assert engines["auto"].allocator.num_usable_pages == memory // (4 * fp8_page)
    assert engines["fp8_e4m3"].stats()["kv_cache"]["bytes"] == pool.num_pages * fp8_page

    prompts = random_prompts(800, PROMPT_LENGTHS, seed=3)
    full = greedy_outputs(engines["auto"], prompts)
    start = len(log)
    quantized = greedy_outputs(engines["fp8_e4m3"], prompts)
    runs = [wrapper for name, wrapper in log[start:] if name == "run"]
    assert runs and all(w.planned["dtypes"] == (torch.float32, torch.float8_e4m3fn) for w in runs)
    assert all(wrapper.scales == (TENSOR_SCALE, TENSOR_SCALE) for wrapper in runs)
    assert_agrees_except_at_near_ties(
        model_dir, prompts, full, quantized, NEAR_TIE["fp8_e4m3"], min_agreement=0.0
    )


def test_on_cuda_fp8_builds_flashinfer_s_fp8_kernels_and_int8_falls_back_with_a_warning(
    model_64_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The backend choice alone (nothing runs on the device): fp8 asks flashinfer for its
    fp8 kernels; int8, which it has none for, gets the torch backend and one warning."""
    model_config = read_checkpoint(model_64_dir).model_config
    built = []
    fake_flashinfer.install(monkeypatch)  # so that `import flashinfer` works
    monkeypatch.setattr(attention_flashinfer, "warm_up_kernels", lambda *args: built.append(args))
    cuda = torch.device("cuda")

    def choose(kv_dtype: torch.dtype) -> type:
        shape = model_config.attention_shape()
        return attention_backend_class(None, shape, 16, torch.bfloat16, kv_dtype, cuda)

    assert choose(torch.float8_e4m3fn) is FlashInferBackend
    assert [args[5] for args in built] == [torch.float8_e4m3fn] * 2  # a decode, a prefill
    with caplog.at_level(logging.WARNING):
        assert choose(torch.int8) is TorchBackend
    [warning] = [record.getMessage() for record in caplog.records]
    assert "fp8_e4m3, not torch.int8; falling back" in warning and len(built) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [[(0, 9), (17, 1)], [(40, 1), (3, 1), (30, 1)], [(20, 7), (5, 1)]])
def test_flashinfer_reads_fp8_pages_like_the_reference_backend(rows: list[Row]) -> None:
    """flashinfer's own kernels on an fp8 pool against the reference backend on the same
    pool, so the same quantized numbers: only the kernels' bfloat16 arithmetic differs."""
    if flashinfer_unsupported_reason(64, torch.bfloat16, torch.float8_e4m3fn) is not None:
        pytest.skip("flashinfer cannot run here")
    cuda = torch.device("cuda")
    pool = make_kv_cache(1, 2, 64, 16, 16, torch.bfloat16, cuda, storage_dtype=torch.float8_e4m3fn,
                  per_vector_scales=False)
    every_slot = torch.arange(pool.num_pages * pool.page_size, device=cuda)
    pool.write(0, *torch.randn(2, every_slot.numel(), 2, 64, dtype=torch.bfloat16, device=cuda),
               every_slot)
    inputs, _ = random_step(pool, rows, seed=0)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, 8, 64, dtype=torch.bfloat16, device=cuda)
    k, v = torch.randn(2, num_tokens, 2, 64, dtype=torch.bfloat16, device=cuda)
    initial, outputs = pool.kv.clone(), []
    for backend_class in (ReferenceBackend, FlashInferBackend):
        pool.kv.copy_(initial)
        backend = backend_class(pool, 8, 2, 64)
        backend.plan(inputs.metadata)
        outputs.append(backend.forward(0, q, k, v).float())
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_fp8_runs_on_flashinfer_and_int8_on_the_torch_backend(
    model_64_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    if flashinfer_unsupported_reason(64, torch.bfloat16, torch.float8_e4m3fn) is not None:
        pytest.skip("flashinfer cannot run here")
    options = dict(device="cuda", dtype="bfloat16", num_pages=40)
    prompts = random_prompts(800, PROMPT_LENGTHS, seed=3)
    fp8 = make_engine(model_64_dir, "fp8_e4m3", **options)
    assert isinstance(fp8.runner.backend, FlashInferBackend) and fp8.runner.kv_cache.scales is None
    assert all(len(tokens) == NEW_TOKENS for tokens in greedy_outputs(fp8, prompts))
    with caplog.at_level(logging.WARNING):
        int8 = make_engine(model_64_dir, "int8", **options)
    assert isinstance(int8.runner.backend, TorchBackend) and int8.runner.kv_cache.scales is not None
    [warning] = [r.getMessage() for r in caplog.records if "int8" in r.getMessage()]
    assert "falling back" in warning
    assert all(len(tokens) == NEW_TOKENS for tokens in greedy_outputs(int8, prompts))


# ----------------------------------------------------------------- errors and options
@pytest.mark.parametrize("value", ["fp16", "int4", "", None])
def test_an_unknown_kv_cache_dtype_is_refused(qwen3_dir: str, value: object) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(qwen3_dir, device="cpu", kv_cache_dtype=value)


def test_flashinfer_with_an_int8_kv_cache_is_refused(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*attention_backend='torch'"):
        LLMEngine(qwen3_dir, device="cpu", kv_cache_dtype="int8", attention_backend="flashinfer")


def test_the_command_line_option_reaches_the_engine_config() -> None:
    code, seen = parse_engine_options(["--kv-cache-dtype", "fp8_e4m3"])
    assert code == 0 and seen["kv_cache_dtype"] == "fp8_e4m3"
    assert parse_engine_options(["--kv-cache-dtype", "int3"])[0] != 0
