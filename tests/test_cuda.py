"""The CUDA path: flashinfer attention against the torch reference, and CUDA-graph decode.

Skipped as a whole without a CUDA GPU and flashinfer. The tiny test models have head
sizes flashinfer has no kernels for, so these tests build their own: a Qwen2 with
head_dim 64, once with one KV head per query head and once with groups of 4 (where decode
runs on tensor cores).
"""

import gc
import logging
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from nanoqwen import LLMEngine  # noqa: E402
from nanoqwen.attention_flashinfer import FlashInferBackend  # noqa: E402
from nanoqwen.attention_torch import TorchBackend  # noqa: E402
from nanoqwen.batch import StepInputs, StepInputsBuilder  # noqa: E402
from nanoqwen.kv_pool import KVPool  # noqa: E402
from oracle import greedy, random_prompts, run_to_completion  # noqa: E402
from checkpoints import build_qwen2  # noqa: E402

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
VOCAB = 800
BUCKETS = [1, 2, 4, 8, 16, 24]

# (cached tokens, new tokens) per request.
PREFILL_WITH_PREFIX = [(0, 37), (33, 20), (64, 16), (5, 120)]
DECODE = [(0, 1), (15, 1), (16, 1), (200, 1), (47, 1)]
MIXED = [(40, 1), (0, 25), (100, 1), (17, 9)]


def random_step(pool: KVPool, rows: list[tuple[int, int]], seed: int) -> StepInputs:
    """A step over `rows`, each request on distinct random pages of `pool`."""
    rng = random.Random(seed)
    free = list(range(1, pool.num_pages))
    rng.shuffle(free)
    builder = StepInputsBuilder(pool.page_size)
    for cached, new in rows:
        pages = [free.pop() for _ in range(-(-(cached + new) // pool.page_size))]
        builder.add_row([0] * new, cached, pages, num_sampled=1)
    return builder.build(pool.kv.device, [], [])


@pytest.mark.parametrize(
    "rows", [PREFILL_WITH_PREFIX, DECODE, MIXED], ids=["prefill", "decode", "mixed"]
)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_matches_torch(rows, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(0)
    pool = KVPool(1, num_kv_heads, head_dim, 16, 64, torch.bfloat16, CUDA)
    pool.kv.normal_()
    inputs = random_step(pool, rows, seed=0)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=torch.bfloat16, device=CUDA)
    k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device=CUDA)
    initial = pool.kv.clone()
    outputs, caches = [], []
    for backend_class in (TorchBackend, FlashInferBackend):
        pool.kv.copy_(initial)
        backend = backend_class(pool, num_heads, num_kv_heads, head_dim)
        backend.plan(inputs.metadata)
        outputs.append(backend.forward(0, q, k, v))
        caches.append(pool.kv.clone())
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(caches[1], caches[0]), "the backends wrote different slots"


@pytest.mark.parametrize("rows", [DECODE, MIXED], ids=["decode", "mixed"])
def test_torch_backend_in_float32_on_cuda_matches_cpu(rows) -> None:
    """float32 on CUDA is served by the torch backend, decodes by its sparse path."""
    torch.manual_seed(0)
    kv = torch.randn(1, 2, 64, 16, 2, 64)
    num_tokens = sum(new for _, new in rows)
    q, k, v = torch.randn(num_tokens, 8, 64), *torch.randn(2, num_tokens, 2, 64)
    outputs = []
    for device in (torch.device("cpu"), CUDA):
        pool = KVPool(1, 2, 64, 16, 64, torch.float32, device)
        pool.kv.copy_(kv)
        backend = TorchBackend(pool, 8, 2, 64)
        backend.plan(random_step(pool, rows, seed=0).metadata)
        outputs.append(backend.forward(0, q.to(device), k.to(device), v.to(device)).cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


def test_flashinfer_refuses_float32() -> None:
    pool = KVPool(1, 2, 128, 16, 4, torch.float32, CUDA)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        FlashInferBackend(pool, 8, 2, 128)


# ----------------------------------------------------------------- engines
@pytest.fixture(scope="module", params=[4, 1], ids=["mha", "gqa4"])
def model_64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp(f"qwen2_kv{request.param}")
    return build_qwen2(
        directory, hidden_size=256, num_attention_heads=4, num_key_value_heads=request.param
    )


@pytest.fixture(scope="module")
def engines(model_64: str):
    """A graph engine (buckets up to 24, so 25..32 run eagerly) and an eager one."""
    options = dict(device="cuda", max_num_seqs=32, num_pages=512)
    graphed = LLMEngine(model_64, decode_buckets=BUCKETS, **options)
    eager = LLMEngine(model_64, enforce_eager=True, **options)
    yield graphed, eager
    del graphed, eager
    gc.collect()
    torch.cuda.empty_cache()


def test_engine_uses_flashinfer_and_captures_every_bucket(engines) -> None:
    graphed, eager = engines
    assert isinstance(graphed.runner.backend, FlashInferBackend)
    assert sorted(graphed.runner.decode_graphs.graphs) == BUCKETS
    assert eager.runner.decode_graphs is None


@pytest.mark.parametrize("batch_size", [1, 3, 5, 17, 30])
def test_graph_replay_matches_eager(engines, batch_size: int) -> None:
    graphed, eager = engines
    rng = random.Random(batch_size)
    lengths = [rng.randint(2, 60) for _ in range(batch_size)]
    prompts = random_prompts(VOCAB, lengths, seed=batch_size)
    outputs = []
    for engine in (graphed, eager):
        ids = [engine.add_request(prompt, greedy(12)) for prompt in prompts]
        final = run_to_completion(engine)
        outputs.append([final[i].token_ids for i in ids])
    assert outputs[0] == outputs[1]


def test_replays_allocate_nothing(engines) -> None:
    engine = engines[0]
    for prompt in random_prompts(VOCAB, [7, 20, 33, 4, 50], seed=3):
        engine.add_request(prompt, greedy(50))
    engine.step()  # the prefill
    inputs = engine.runner.prepare(engine.scheduler.schedule().batch)
    assert inputs.metadata.batch_size == 8 and engine.runner.decode_graphs.handles(inputs.metadata)
    logits = engine.runner.forward(inputs)
    first = logits.clone()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for _ in range(100):
        logits = engine.runner.forward(inputs)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.equal(logits, first)  # same step replayed: same logits
    for request_id in list(engine.requests):
        engine.abort(request_id)


def test_capture_reports_what_it_did(model_64: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        LLMEngine(model_64, device="cuda", num_pages=64, decode_buckets=[1, 2])
    assert any("captured 2 decode CUDA graphs" in r.getMessage() for r in caplog.records)


def test_float32_on_cuda_falls_back_to_torch_without_graphs(
    model_64: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(model_64, device="cuda", dtype="float32", num_pages=64)
    assert isinstance(engine.runner.backend, TorchBackend)
    assert engine.runner.decode_graphs is None
    assert any("float32" in record.getMessage() for record in caplog.records)


def test_kv_pool_fills_the_memory_budget(model_64: str) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free) / total + 0.2)
    engine = LLMEngine(model_64, device="cuda", gpu_memory_utilization=utilization)
    for prompt in random_prompts(VOCAB, [1000 + i for i in range(8)], seed=5):
        engine.add_request(prompt, greedy(4))
    run_to_completion(engine)
    pool_bytes = engine.pool.kv.numel() * engine.pool.kv.element_size()
    free_after, _ = torch.cuda.mem_get_info()
    assert pool_bytes > 0.1 * total, "the pool took much less than the budget"
    assert total - free_after <= utilization * total + (512 << 20), "the budget was overrun"
    del engine
    gc.collect()
    torch.cuda.empty_cache()
