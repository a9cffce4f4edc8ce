"""Dynamic (NTK) RoPE scaling: a wider base for a sequence once it outgrows the trained context.

transformers decides the scaling from the longest sequence in its forward pass, which for
one request is its own length. A serving batch holds many requests of different lengths,
so here every token is scaled for its own request's length: `RotaryEmbedding` with
per-token inverse frequencies. Only such a model reads device values on the host in its
forward pass (the lengths), which is why it never runs inside a CUDA graph.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoqwen.attention.base import AttentionMetadata
from nanoqwen.model.layers import RotaryEmbedding


class DynamicRotaryEmbedding(RotaryEmbedding):
    def __init__(self, hf_config: PretrainedConfig, rope_type: str) -> None:
        super().__init__(hf_config, rope_type)
        self.hf_config = hf_config

    def forward(
        self, metadata: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = metadata.positions[:, None].float() * self._inv_freq_per_token(metadata)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def _inv_freq_per_token(self, metadata: AttentionMetadata) -> torch.Tensor:
        """Each token's inverse frequencies, scaled for its own request's length."""
        # A request's length is one past the position of its last token in this step.
        request_lens = metadata.positions[metadata.qo_indptr[1:].long() - 1] + 1
        seq_lens = torch.repeat_interleave(request_lens, metadata.q_lens())
        inv_freq = self.inv_freq[None, :].expand(seq_lens.numel(), -1).clone()
        trained = self.hf_config.max_position_embeddings
        for seq_len in seq_lens[seq_lens > trained].unique().tolist():
            longer, _ = ROPE_INIT_FUNCTIONS["dynamic"](
                self.hf_config, self.inv_freq.device, seq_len=seq_len
            )
            inv_freq[seq_lens == seq_len] = longer
        return inv_freq
