"""Embeddings: a prompt's vector instead of its continuation.

An embedding request (`LLM.embed`, the server's `/v1/embeddings`) is queued, scheduled and
prefilled like any other request, chunk by chunk and with its prefix from the prefix
cache, so it shares the engine, its memory and its batches with generation. Where a
generation request would have its next token sampled, at the step that computes its
last prompt token, the runner hands this module's `Pooler` (one of its output hooks) that
token's final hidden state: the decoder's output after the final RMSNorm, the vector the
lm_head would turn into the next token's logits. The request then finishes without
generating anything.

That is *last-token pooling*, which is how Qwen's embedding models (Qwen3-Embedding,
gte-Qwen2) define their embeddings: in a causal model only the last token has seen the
whole text. With `normalize` (the default, as OpenAI's embeddings are) the vector has
length 1, so a dot product of two of them is their cosine similarity. A chat model's
vector is its summary of the text for predicting what comes next: usable for rough
similarity; an embedding checkpoint's is made for retrieval.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class Pooler:
    """The runner's output hook for embedding requests (`PoolingParams` on the request)."""

    def extra_rows(self, rows: Sequence, row_starts: Sequence[int]) -> list[int]:
        return []  # the sampled row's hidden state is all it needs

    def take(self, sampled: Sequence, hidden: torch.Tensor, extra_logits: torch.Tensor) -> None:
        """Give each embedding request its sampled row's final hidden state, in float32,
        normalised if it asks."""
        for row, state in zip(sampled, hidden):
            pooling = row.request.pooling
            if pooling is not None:
                vector = state.float()
                row.request.embedding = F.normalize(vector, dim=-1) if pooling.normalize else vector
