"""Which attention backend serves a model: asked for by name, or the fastest that runs."""

from __future__ import annotations

import logging

import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.attention.flashinfer_backend import FlashInferBackend, check_flashinfer
from nanoqwen.attention.reference import ReferenceBackend
from nanoqwen.attention.torch_backend import TorchBackend
from nanoqwen.config import EngineConfig
from nanoqwen.model.config import ModelConfig

logger = logging.getLogger(__name__)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceBackend,
    "torch": TorchBackend,
    "flashinfer": FlashInferBackend,
}


def attention_backend_class(
    config: EngineConfig, model_config: ModelConfig, device: torch.device
) -> type[AttentionBackend]:
    """The backend asked for by name; otherwise flashinfer on CUDA once its kernels for the
    model are built and run, the torch backend everywhere else."""
    name = config.attention_backend
    if name not in (None, "flashinfer"):
        return ATTENTION_BACKENDS[name]
    if name is None and device.type != "cuda":
        return TorchBackend
    reason = check_flashinfer(
        model_config, config.page_size, config.dtype, config.kv_storage_dtype, device
    )
    if reason is None:
        return FlashInferBackend
    if name == "flashinfer":
        raise ValueError(f"attention_backend='flashinfer' cannot run: {reason}")
    logger.warning("%s; falling back to the slower torch attention backend", reason)
    return TorchBackend
