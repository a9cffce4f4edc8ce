"""Which attention backend serves a model: asked for by name, or the fastest that runs."""

from __future__ import annotations

import logging

import torch

from nanoqwen.attention.base import AttentionBackend, AttentionShape, ReferenceBackend
from nanoqwen.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferUnavailable,
    flashinfer_backend_for,
)
from nanoqwen.attention.torch_backend import TorchBackend

logger = logging.getLogger(__name__)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceBackend,
    "torch": TorchBackend,
    "flashinfer": FlashInferBackend,
}


def attention_backend_class(
    name: str | None,
    shape: AttentionShape,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> type[AttentionBackend]:
    """The backend asked for by `name`; otherwise flashinfer on CUDA once its kernels for
    `shape` (this rank's heads) are built and run (with its FA2 prefill if the kernels it
    picks fail), the torch backend everywhere else."""
    if name not in (None, "flashinfer"):
        return ATTENTION_BACKENDS[name]
    if name is None and device.type != "cuda":
        return TorchBackend
    try:
        return flashinfer_backend_for(shape, page_size, dtype, kv_dtype, device)
    except FlashInferUnavailable as reason:
        if name == "flashinfer":
            raise ValueError(f"attention_backend='flashinfer' cannot run: {reason}") from None
        logger.warning("%s; falling back to the slower torch attention backend", reason)
        return TorchBackend
