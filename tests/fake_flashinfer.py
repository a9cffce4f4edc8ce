"""A stand-in for flashinfer's paged-attention wrappers and CUDA events, for CPU tests.

The wrappers mimic flashinfer-python 0.7.2's own `BatchPrefillWithPagedKVCacheWrapper` and
`BatchDecodeWithPagedKVCacheWrapper`, with the same parameter names (so a misnamed argument
fails here as it would there). Those names are the same from 0.4.0 on (checked against the
sources of 0.4.0, 0.6.18.post1 and 0.7.0.post1): the range pyproject's `cuda` extra declares.

* `plan` takes the page table (indptr and last-page lengths on the host), the head counts,
  head size and page size, and remembers the schedule;
* a decode wrapper built with `use_cuda_graph=True` owns fixed page-table buffers: `plan`
  copies the step's page table into them and refuses another batch size, and `run` reads
  them, as a replayed graph's kernels do;
* `run(q, (k_cache, v_cache), k_scale=, v_scale=)` attends with the planned schedule, the
  caches in the planned `kv_data_type` (fp8 numbers read times their per-tensor scale, 1
  when none is given, as flashinfer's default). The attention itself is
  `ReferenceBackend`'s, so a step planned right gives the reference's exact output. Each
  wrapper keeps the scales its last `run` read the pages at (`scales`) and the scale
  arguments it was passed (`scale_arguments`).

Every `plan`, `run`, `synchronize` and `record` is appended to one shared log, with the
object that made it, so tests can check the order of calls across wrappers and events.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from nanoqwen.attention.base import AttentionMetadata, ReferenceBackend

Log = list[tuple[str, object]]
KVCache = tuple[torch.Tensor, torch.Tensor]


class FakeEvent:
    def __init__(self, log: Log) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))

    def record(self, stream: object = None) -> None:
        self.log.append(("record", self))


class FakeWrapper:
    """What the prefill and decode fakes share: the schedule, the log, `run`."""

    def __init__(self, log: Log, float_workspace_buffer: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.log = log
        self.planned: dict | None = None
        # The last run's: the scales the pages were read at, and the arguments it was given.
        self.scales: tuple[float, float] | None = None
        self.scale_arguments: dict[str, float | None] = {}

    def remember(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
        last_page_len: torch.Tensor, shape: tuple[int, int, int, int], dtypes: tuple,
    ) -> None:
        for host in (qo_indptr, kv_indptr, last_page_len):
            assert host.device.type == "cpu", "flashinfer plans from host tensors"
        self.log.append(("plan", self))
        self.planned = dict(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
            last_page_len=last_page_len, shape=shape, dtypes=dtypes,
        )

    def run(
        self, q: torch.Tensor, paged_kv_cache: KVCache, *,
        k_scale: float | None = None, v_scale: float | None = None,
    ) -> torch.Tensor:
        assert self.planned is not None, "run before plan"
        self.log.append(("run", self))
        self.scale_arguments = {"k_scale": k_scale, "v_scale": v_scale}
        # flashinfer's defaults: 1.
        scales = self.scales = tuple(1.0 if s is None else s for s in (k_scale, v_scale))
        num_heads, num_kv_heads, head_dim, page_size = self.planned["shape"]
        q_data_type, kv_data_type = self.planned["dtypes"]
        assert q.dtype == q_data_type and paged_kv_cache[0].dtype == (kv_data_type or q_data_type)

        def gather(layer: int, kind: int, pages: torch.Tensor) -> torch.Tensor:
            return paged_kv_cache[kind][pages].to(q.dtype) * scales[kind]

        # No new keys and values to write: the backend stored them before calling run.
        pool = SimpleNamespace(page_size=page_size, gather=gather, write=lambda *args: None)
        reference = ReferenceBackend(pool, num_heads, num_kv_heads, head_dim)
        nothing = torch.zeros(0, dtype=torch.int64, device=q.device)
        reference.plan(AttentionMetadata(
            qo_indptr=self.planned["qo_indptr"],
            kv_indptr=self.planned["kv_indptr"],
            kv_indices=self.planned["kv_indices"],
            kv_last_page_len=self.planned["last_page_len"],
            positions=nothing, slot_mapping=nothing, max_q_len=0, max_kv_len=0,
            qo_indptr_host=self.planned["qo_indptr"].cpu(),
            kv_indptr_host=self.planned["kv_indptr"].cpu(),
            kv_last_page_len_host=self.planned["last_page_len"].cpu(),
        ))
        no_new_kv = q.new_zeros(0, num_kv_heads, head_dim)
        return reference.forward(0, q, no_new_kv, no_new_kv)


class FakePrefillWrapper(FakeWrapper):
    def __init__(
        self, log: Log, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
        backend: str = "auto",
    ) -> None:
        super().__init__(log, float_workspace_buffer, kv_layout)
        assert backend in ("auto", "fa2", "fa3")
        self.backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False,
             q_data_type="float16", kv_data_type=None) -> None:
        assert causal, "a prefill of new tokens over their prefix is causal"
        self.remember(
            qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            (num_qo_heads, num_kv_heads, head_dim_qk, page_size), (q_data_type, kv_data_type),
        )


class FakeDecodeWrapper(FakeWrapper):
    def __init__(self, log: Log, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        super().__init__(log, float_workspace_buffer, kv_layout)
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (
            paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer
        )
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) for b in self.buffers)
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, q_data_type="float16", kv_data_type=None) -> None:
        batch_size = len(last_page_len)
        if self.use_cuda_graph:
            indptr_buffer, indices_buffer, last_buffer = self.buffers
            if batch_size != len(last_buffer):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            indptr_buffer.copy_(indptr)
            last_buffer.copy_(last_page_len)
            indices_buffer[: len(indices)].copy_(indices)
        self.remember(
            torch.arange(batch_size + 1, dtype=torch.int32), indptr, indices, last_page_len,
            (num_qo_heads, num_kv_heads, head_dim, page_size), (q_data_type, kv_data_type),
        )

    def run(self, q: torch.Tensor, paged_kv_cache: KVCache, **scales: float | None) -> torch.Tensor:
        if self.use_cuda_graph:  # a replayed graph reads the fixed buffers, not the plan's inputs
            indptr_buffer, indices_buffer, last_buffer = self.buffers
            self.planned.update(
                kv_indptr=indptr_buffer.cpu(),
                kv_indices=indices_buffer[: int(indptr_buffer[-1])],
                last_page_len=last_buffer.cpu(),
            )
        return super().run(q, paged_kv_cache, **scales)


def install(monkeypatch: pytest.MonkeyPatch) -> Log:
    """Put the fakes where `import flashinfer` and `torch.cuda.Event()` find them; return
    the log they share."""
    log: Log = []
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: FakePrefillWrapper(log, *a, **k)
    module.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: FakeDecodeWrapper(log, *a, **k)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log))
    # A CPU "workspace" needs no 256 MiB.
    monkeypatch.setattr("nanoqwen.attention.flashinfer_backend.FLASHINFER_WORKSPACE_BYTES", 1024)
    return log
