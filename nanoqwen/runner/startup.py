"""Start-up, in the order it happens: load the model, size the KV cache, allocate it.

1. **Load**: the checkpoint's weights into the decoder, on the device and in the dtype
   asked for (`weights/loader.py`; built inside `split_across`, one rank's slice).
2. **Size**: how many KV pages. Asked for in pages (`num_pages`) or bytes
   (`kv_cache_memory` above 1): as asked. On a CPU, which shares its RAM with everything
   else: what every sequence at full length could use, but at most a fixed share of the
   RAM (`CPU_KV_CACHE_FRACTION` of the total, so the cache is the same size every run), or
   a `kv_cache_memory` fraction of what is available. On a GPU the cache gets what the rest
   of the engine leaves, which `memory_profile.py` measures by running the worst step.
3. **Allocate**: the cache, the attention backend over it, the decode graphs' buffers, and
   the runner that owns them; then the graphs are captured.

Several models may keep K/V for the same tokens (a draft model beside the target): they
are sized together, so each gets a cache with the same pages. Every rank of a split model
runs this same start-up over its slice, and the ranks agree on the smallest page count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.attention.registry import attention_backend_class
from nanoqwen.config import RunnerSettings
from nanoqwen.memory.kv_cache import ONE_BYTE_DTYPES, KVCache
from nanoqwen.model.layers import SINGLE, TensorParallel, split_across
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.runner import ModelRunner, on_device
from nanoqwen.weights.checkpoint import Checkpoint
from nanoqwen.weights.loader import load_model

if TYPE_CHECKING:
    from nanoqwen.memory.state_pool import StateCache

logger = logging.getLogger(__name__)
# On the CPU the cache shares RAM with everything else: by default it takes at most this
# share of the machine's RAM.
CPU_KV_CACHE_FRACTION = 0.2
# The fewest slots a state pool has: two running requests, a snapshot for each.
MIN_STATE_SLOTS = 4


# How a runner is made from its parts (rank 0 of a split model makes its own kind).
RunnerFactory = Callable[..., ModelRunner]


def start_runners(
    checkpoints: Sequence[Checkpoint],
    settings: RunnerSettings,
    tp: TensorParallel = SINGLE,
    device: torch.device | None = None,
    max_proposed: int = 0,
    agree: Callable[[int], int] = int,
    make: RunnerFactory = ModelRunner,
) -> list[ModelRunner]:
    """A runner per checkpoint, ready to step, on caches with the same pages. `agree` turns
    this rank's page count into the one every rank can afford; `max_proposed` is the most
    tokens a step appends to a row (sizing's worst step)."""
    device = exact_device(device or settings.device)
    with on_device(device):
        with split_across(tp):
            models = [load_model(c, settings.dtype, device, settings.quantization) for c in checkpoints]
            states = state_shapes(models[0], settings.dtype)
        backend_class = attention_backend_class(
            settings.attention_backend, models[0].attention_shape, settings.page_size,
            settings.dtype, settings.kv_storage_dtype, device,
        )
        buckets = decode_buckets(settings, models[0], backend_class, device)
        parts = RunnerParts(settings, backend_class, buckets, device, states)
        memory = cache_memory(models, parts, device, tp.size, max_proposed)
        num_slots = agree(state_slots(settings, memory, parts.slot_bytes()))
        page_bytes = sum(parts.page_bytes(model) for model in models)
        num_pages = settings.num_pages or max(
            2, int((memory - num_slots * parts.slot_bytes()) // page_bytes) + 1
        )
        runners = [parts.runner(model, agree(num_pages), make, num_slots) for model in models]
    for runner in runners:
        runner.capture_graphs()  # on the runner's own device
    return runners


@dataclass(frozen=True)
class RunnerParts:
    """How a runner is put together around a model: its backend, graph buckets and, for a
    model with recurrent layers, the shape of one slot of its state pool."""

    settings: RunnerSettings
    backend_class: type[AttentionBackend]
    buckets: list[int]
    device: torch.device
    states: StateLayers | None = None

    def runner(
        self, model: QwenForCausalLM, num_pages: int, make: RunnerFactory = ModelRunner,
        num_state_slots: int = 0,
    ) -> ModelRunner:
        shape, settings = model.attention_shape, self.settings
        kv_cache = make_kv_cache(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, settings.page_size, num_pages,
            settings.dtype, self.device, settings.kv_storage_dtype,
            self.backend_class.per_vector_kv_scales,
        )
        backend = self.backend_class(kv_cache, shape.num_heads, shape.num_kv_heads, shape.head_dim)
        graphs = None
        if self.buckets:
            from nanoqwen.runner.cuda_graph import DecodeGraphRunner

            graphs = DecodeGraphRunner(model, backend, self.buckets, settings.max_model_len)
        runner = make(model, backend, graphs)
        if num_state_slots:
            runner.states = self.states.cache(num_state_slots, self.device)
        return runner

    def slot_bytes(self) -> int:
        """Bytes of one slot of the state pool (0: the model keeps no states)."""
        return 0 if self.states is None else self.states.bytes_per_slot()

    def page_bytes(self, model: QwenForCausalLM) -> int:
        shape = model.attention_shape
        return KVCache.bytes_per_page(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, self.settings.page_size,
            self.settings.kv_storage_dtype, self.backend_class.per_vector_kv_scales,
        )


def cache_memory(
    models: Sequence[QwenForCausalLM], parts: RunnerParts, device: torch.device, num_ranks: int,
    max_proposed: int,
) -> float:
    """Bytes for the models' KV caches (and state pool), this rank's share."""
    settings = parts.settings
    page_bytes = sum(parts.page_bytes(model) for model in models)
    memory = settings.kv_cache_memory
    if settings.num_pages is not None:
        return (settings.num_pages - 1) * page_bytes  # as asked; a state pool comes beside
    if device.type == "cuda" and (memory is None or memory <= 1):
        from nanoqwen.runner.memory_profile import gpu_kv_memory_for

        return gpu_kv_memory_for(models, parts.runner, parts.backend_class, len(parts.buckets),
                                 settings, device, max_proposed)
    if memory is None or memory <= 1:
        ram = psutil.virtual_memory()  # the ranks of a split model share it
        return cpu_kv_memory(ram.total / num_ranks, ram.available / num_ranks, memory,
                             settings, page_bytes, parts.slot_bytes())
    return memory


def state_slots(settings: RunnerSettings, memory: float, slot_bytes: int) -> int:
    """Slots of the state pool, for a model with recurrent layers (else 0): one per running
    request and as many for snapshots (`memory/state_pool.py`), within half of the cache's
    memory, and at least `MIN_STATE_SLOTS`. A slot costs what a few thousand tokens of K/V
    do, so a long-context model's pool is mostly pages either way."""
    if not slot_bytes:
        return 0
    return max(MIN_STATE_SLOTS, min(2 * settings.max_num_seqs, int(memory / 2 // slot_bytes)))


def cpu_kv_memory(
    total: float, available: float, fraction: float | None, settings: RunnerSettings,
    page_bytes: int, slot_bytes: int = 0,
) -> float:
    """Bytes for the cache on a CPU with `total` bytes of RAM, `available` of them free:
    `fraction` of what is available, or what every sequence at full length needs (with two
    state slots each, for a model that keeps states), at most `CPU_KV_CACHE_FRACTION` of
    the total."""
    if fraction is not None:
        return fraction * available
    pages_per_sequence = -(-settings.max_model_len // settings.page_size)
    every_sequence_full = settings.max_num_seqs * (pages_per_sequence * page_bytes + 2 * slot_bytes)
    return min(CPU_KV_CACHE_FRACTION * total, every_sequence_full)


@dataclass(frozen=True)
class StateLayers:
    """A model's recurrent layers: how many, and the shape of one slot of each."""

    num_layers: int
    conv: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent: tuple[int, ...]

    def bytes_per_slot(self) -> int:
        from nanoqwen.memory.state_pool import StateCache

        return StateCache.bytes_per_slot(self.num_layers, self.conv, self.conv_dtype, self.recurrent)

    def cache(self, num_slots: int, device: torch.device) -> StateCache:
        from nanoqwen.memory.state_pool import StateCache

        return StateCache(self.num_layers, num_slots, self.conv, self.conv_dtype, self.recurrent,
                          device)


def state_shapes(model: QwenForCausalLM, dtype: torch.dtype) -> StateLayers | None:
    """The recurrent layers of `model` (this rank's share), or None if it has none."""
    config = model.config
    if not config.state_layers:
        return None
    from nanoqwen.model.gated_deltanet import deltanet_state_shapes

    shapes = deltanet_state_shapes(config.hf_config, dtype)
    return StateLayers(len(config.state_layers), shapes.conv, shapes.conv_dtype, shapes.recurrent)


def make_kv_cache(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
    dtype: torch.dtype, device: torch.device, storage_dtype: torch.dtype,
    per_vector_scales: bool = True,
) -> KVCache:
    """A cache storing pages in `storage_dtype`: one byte per number is `kv_quant.py`'s."""
    shape = (num_layers, num_kv_heads, head_dim, page_size, num_pages, dtype, device)
    if storage_dtype not in ONE_BYTE_DTYPES:
        return KVCache(*shape)
    from nanoqwen.memory.kv_quant import QuantizedKVCache

    return QuantizedKVCache(*shape, storage_dtype=storage_dtype, per_vector_scales=per_vector_scales)


def decode_buckets(
    settings: RunnerSettings, model: QwenForCausalLM, backend_class: type[AttentionBackend],
    device: torch.device,
) -> list[int]:
    """The batch sizes decode steps are padded to: asked for, or on CUDA the defaults where
    graphs can be captured (`cuda_graph.py`); none means every step runs eagerly."""
    if settings.enforce_eager or (settings.decode_buckets is None and device.type != "cuda"):
        return []
    if settings.decode_buckets is None and model.config.moe is not None:
        from nanoqwen.model.moe import experts_fit_cuda_graphs

        if not experts_fit_cuda_graphs(model, settings.dtype, device):
            logger.warning("decode steps run without CUDA graphs: this model's experts run on "
                           "torch's grouped GEMM only in bfloat16 on sm90/sm100 GPUs, and "
                           "elsewhere read their row counts on the host")
            return []
    from nanoqwen.runner.cuda_graph import decode_buckets as buckets_for

    return buckets_for(settings.decode_buckets, settings.max_num_seqs, device, backend_class,
                       model.config.rope_type)


def exact_device(device: torch.device) -> torch.device:
    """`cuda` means the current CUDA device: name it, so it stays the same from any thread."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
