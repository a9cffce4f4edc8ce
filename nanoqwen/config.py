"""Engine settings: what the engine is asked to do, checked before anything loads.

`EngineConfig` holds the user's choices (device, dtype, batch limits, page size, KV
memory, chunk size, caching, graphs, ranks, scheduling policy, speculative decoding) and
validates them in `__post_init__`, so a typo in a dtype fails in one clear line instead of
deep inside a kernel. The model's own shape is `model/config.py`'s `ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ATTENTION_BACKEND_NAMES = (None, "reference", "torch", "flashinfer")
SCHEDULING_POLICIES = ("fcfs", "priority", "deadline", "sjf", "fair")
# What a preempted request loses: "recompute" drops its pages (the prefix cache may keep
# them); "swap" also copies them to host memory and back (scheduling/swapping.py).
PREEMPTION_MODES = ("recompute", "swap")
SPECULATIVE_METHODS = (None, "ngram", "draft")
# Where sampling settings a request leaves out come from: "auto", the checkpoint's
# generation_config.json (as vLLM's generation_config="auto"); "none", the neutral ones.
GENERATION_CONFIG_SOURCES = ("auto", "none")
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
# How KV-cache pages are stored: "auto" in the model's dtype, else one byte per number
# with a scale per (token, KV head) beside it, or per tensor on flashinfer (kv_pool.py).
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
# How linear weights are kept in memory: as the dtype ("none"), or as 8/4-bit integers.
QUANTIZATION_MODES = ("none", "int8", "int4")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` means CUDA when it is there, else the CPU; anything else must exist."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda'") from error
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use 'cpu' or 'cuda'")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Unless told otherwise: bf16 on CUDA, and on a CPU with bf16 arithmetic of its own
    (AVX512-BF16 or AMX); float32 on other CPUs, which would only emulate bf16, slowly."""
    if dtype is None:
        native_bf16 = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native_bf16 else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}: use one of float32, bfloat16, float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of float32, bfloat16, float16")
    return DTYPES[dtype]


def cpu_has_native_bf16() -> bool:
    """Does this CPU multiply bfloat16 in hardware (AVX512-BF16 or AMX), as vLLM's CPU
    build requires of its bf16 default? Only if torch uses its AVX512 kernels here:
    `ATEN_CPU_CAPABILITY=avx2` (torch's own setting) turns both off."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


@dataclass
class EngineConfig:
    """Everything the engine is told by its user. Validated in `__post_init__`."""

    model: str
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    page_size: int = 16
    kv_cache_memory: int | float | None = None
    num_pages: int | None = None
    chunk_size: int | None = None
    enable_prefix_cache: bool = True
    enforce_eager: bool = False
    # Batch sizes decode steps are padded to, each replayed as a CUDA graph (cuda_graph.py).
    # None: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs where graphs can be captured, and
    # none on the CPU, which has no graphs; given explicitly, the CPU pads to them too.
    decode_buckets: list[int] | None = None
    gpu_memory_utilization: float = 0.9
    # "reference", "torch" or "flashinfer"; None picks the fastest that can run the model.
    attention_backend: str | None = None
    # "fcfs" serves requests in arrival order; "priority" by each request's priority
    # (lower first), improved by one level per `priority_aging_steps` steps since it
    # arrived (0: no aging), so one level is worth that many steps of waiting. The default
    # is about one long request's lifetime in decode steps. See waiting_queue.py.
    # "deadline" serves the request due soonest first (`default_deadline` seconds after
    # arrival for one without a deadline), "sjf" the shortest remaining prompt (aged), and
    # "fair" takes turns between users (aged). See policies.py.
    scheduling_policy: str = "fcfs"
    priority_aging_steps: int = 1024
    default_deadline: float = 60.0
    # The most unfinished requests one user may have at once (None: no cap).
    max_seqs_per_user: int | None = None
    # "recompute" or "swap" (with `swap_space` bytes of host memory for swapped pages).
    preemption_mode: str = "recompute"
    swap_space: int | None = None
    # "int8" or "int4" keeps linear weights quantized in memory, "none" in `dtype`; None
    # follows the checkpoint (a GPTQ/AWQ/GGUF file's bits, else "none").
    quantization: str | None = None
    # "fp8_e4m3" or "int8" stores the KV cache in one byte per number (about twice the
    # pages of bfloat16 for the same memory); "auto" stores it in `dtype`.
    kv_cache_dtype: str = "auto"
    # Ranks (GPUs, or CPU processes) the model is split across (`parallel/`).
    tensor_parallel_size: int = 1
    # Speculative decoding (speculative.py): "ngram" guesses from the request's own text,
    # "draft" runs `draft_model`, a smaller model with the same tokenizer; None is off.
    speculative: str | None = None
    num_speculative_tokens: int = 4  # draft tokens per request and step
    draft_model: str | None = None  # a hub id or directory; implies speculative="draft"
    ngram_min: int = 2  # shortest suffix of the text to look up earlier in it
    ngram_max: int = 4  # longest one; longer suffixes are tried first
    # "auto": sampling settings a request leaves out take the model's recommended ones
    # (generation_config.json); "none": temperature 1, no top-k/top-p/min-p/penalty.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        for name in ("max_num_seqs", "page_size", "tensor_parallel_size"):
            _require_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_pages", "chunk_size"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if self.decode_buckets is not None:
            for size in self.decode_buckets:
                _require_positive_int("every decode_buckets entry", size)
            self.decode_buckets = sorted(set(self.decode_buckets))
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            names = ", ".join(str(name) for name in ATTENTION_BACKEND_NAMES)
            raise ValueError(f"attention_backend must be one of {names}, got {self.attention_backend!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        aging = self.priority_aging_steps
        if isinstance(aging, bool) or not isinstance(aging, int) or aging < 0:
            raise ValueError(f"priority_aging_steps must be a non-negative integer, got {aging!r}")
        self._check_scheduling_features()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(
                f"unknown quantization {self.quantization!r}: use one of "
                + ", ".join(QUANTIZATION_MODES)
            )
        if self.generation_config not in GENERATION_CONFIG_SOURCES:
            raise ValueError(
                f"generation_config must be one of {', '.join(GENERATION_CONFIG_SOURCES)}, "
                f"got {self.generation_config!r}"
            )
        self._check_kv_cache_dtype()
        if self.chunk_size is None:
            # Big chunks keep a GPU busy; on a CPU, 2048 (vLLM's server's) prefills a burst at once.
            self.chunk_size = 8192 if self.device.type == "cuda" else 2048
        self._check_speculative()

    def _check_scheduling_features(self) -> None:
        deadline = self.default_deadline
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0:
            raise ValueError(f"default_deadline must be a positive number of seconds, got {deadline!r}")
        if self.max_seqs_per_user is not None:
            _require_positive_int("max_seqs_per_user", self.max_seqs_per_user)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                f"got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap":
            if self.swap_space is None:
                raise ValueError("preemption_mode='swap' needs swap_space: bytes of host "
                                 "memory for the pages of swapped-out requests")
            if not self.enable_prefix_cache:
                raise ValueError("preemption_mode='swap' brings pages back through the prefix "
                                 "cache: leave enable_prefix_cache on")
            if self.tensor_parallel_size > 1 or self.draft_model is not None:
                raise ValueError("preemption_mode='swap' swaps one model's KV cache on one rank: "
                                 "not with tensor_parallel_size > 1 or a draft model")
        if self.swap_space is not None:
            if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int) \
                    or self.swap_space < 0:
                raise ValueError(f"swap_space must be a number of bytes, got {self.swap_space!r}")
            if self.preemption_mode != "swap":
                raise ValueError("swap_space is only used with preemption_mode='swap'")

    @property
    def plain_scheduling(self) -> bool:
        """Does the scheduler need nothing beyond the core's (fcfs or priority, recompute)?"""
        return (self.scheduling_policy in ("fcfs", "priority") and self.max_seqs_per_user is None
                and self.preemption_mode == "recompute")

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "int8" and self.attention_backend == "flashinfer":
            raise ValueError(
                "kv_cache_dtype='int8' runs on the torch and reference attention backends, "
                "not flashinfer (which reads fp8_e4m3): use attention_backend='torch'"
            )

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The dtype KV-cache pages are stored in."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    def _check_speculative(self) -> None:
        if self.speculative is None and self.draft_model is not None:
            self.speculative = "draft"  # naming a draft model asks for it, as in vLLM
        if self.speculative not in SPECULATIVE_METHODS:
            names = ", ".join(str(name) for name in SPECULATIVE_METHODS)
            raise ValueError(f"speculative must be one of {names}, got {self.speculative!r}")
        if self.speculative == "draft" and self.tensor_parallel_size > 1:
            raise ValueError("speculative='draft' does not run with tensor_parallel_size > 1")
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative='draft' needs draft_model (a hub id or directory)")
        if self.speculative != "draft" and self.draft_model is not None:
            raise ValueError(
                f"draft_model is only used with speculative='draft', not {self.speculative!r}"
            )
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            _require_positive_int(name, getattr(self, name))
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )

    def runner_settings(self, max_model_len: int) -> RunnerSettings:
        """The settings start-up and the runner use, for a model served up to `max_model_len`."""
        return RunnerSettings(
            device=self.device, dtype=self.dtype, page_size=self.page_size,
            max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
            chunk_size=self.chunk_size, kv_storage_dtype=self.kv_storage_dtype,
            quantization=self.quantization, attention_backend=self.attention_backend,
            decode_buckets=self.decode_buckets, enforce_eager=self.enforce_eager,
            num_pages=self.num_pages, kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )

    @property
    def num_drafts_per_step(self) -> int:
        """The most draft tokens a request carries into one step (0 without speculation)."""
        return self.num_speculative_tokens if self.speculative else 0


@dataclass(frozen=True)
class RunnerSettings:
    """The engine settings start-up and the runner use (`EngineConfig`'s fields)."""

    device: torch.device
    dtype: torch.dtype
    page_size: int
    max_model_len: int
    max_num_seqs: int
    chunk_size: int
    kv_storage_dtype: torch.dtype  # the dtype pages are stored in
    quantization: str | None = None
    attention_backend: str | None = None
    decode_buckets: list[int] | None = None
    enforce_eager: bool = False
    num_pages: int | None = None
    kv_cache_memory: float | None = None  # bytes, or (at most 1) a fraction
    gpu_memory_utilization: float = 0.9


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


