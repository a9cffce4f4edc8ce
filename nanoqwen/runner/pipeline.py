"""One step, in four stages: lay the batch out, plan attention, run the model, choose tokens.

Every caller that runs the model goes through this one pipeline: the runner for each
engine step, the memory profile for the worst step a schedule can make, and graph capture
for a step of padding rows. So what is measured and what is captured are exactly what
runs.

1. **Lay out** (`prepare`): the scheduled batch becomes flat tensors (`step_inputs.py`).
   This is where a decode-only batch that fits a graph bucket is padded to it: the
   graph-or-eager decision is made here, once, and travels with the step (`bucket`).
2. **Plan** attention once for all layers (`AttentionBackend.plan`).
3. **Forward**: the model's logits for the sampled rows, replayed from a CUDA graph (or
   run through the graph's static buffers, on a CPU) when the step has a bucket. A model
   split across ranks returns this rank's block of the vocabulary, which `join_logits`
   joins (on rank 0; other ranks get None).
4. **Choose tokens**: each sampled request's new tokens from its rows of logits, by a
   `TokenChooser` (one sampled token each, unless the engine plugs in a verifier of
   proposed tokens).

Two kinds of request want more of a step than its next token. Prompt rows a request asked
to score have their logits computed after the sampled rows, and are scored before the
tokens are chosen (`sampling/logprobs.py`); a step that ends an embedding request's prompt
runs eagerly, never from a graph, and keeps that row's final hidden state
(`sampling/pooling.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nanoqwen.attention.base import AttentionBackend
from nanoqwen.model.qwen import QwenForCausalLM
from nanoqwen.runner.cuda_graph import DecodeGraphRunner
from nanoqwen.runner.step_inputs import StepInputs, build_step_inputs
from nanoqwen.sampling.logprobs import score_prompts
from nanoqwen.sampling.pooling import record_embeddings
from nanoqwen.sampling.sampler import Sampler
from nanoqwen.scheduling.batch import ScheduledBatch
from nanoqwen.scheduling.request import Request

# Each request's new tokens from its consecutive rows of logits (one row, unless it
# carries proposed tokens to verify).
TokenChooser = Callable[[Sampler, torch.Tensor, Sequence[Request]], list[list[int]]]


def sample_one_each(
    sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request]
) -> list[list[int]]:
    """One sampled token per request, from its one row of logits."""
    return [[token_id] for token_id in sampler.sample(logits, requests)]


class StepPipeline:
    """The four stages for one model on one KV cache (see the module docstring)."""

    def __init__(
        self,
        model: QwenForCausalLM,
        backend: AttentionBackend,
        graphs: DecodeGraphRunner | None,
        sampler: Sampler,
        choose_tokens: TokenChooser,
        join_logits: Callable[[torch.Tensor], torch.Tensor | None],
        layout_device: torch.device,  # the host, when the step is sent to other ranks first
    ) -> None:
        self.model, self.backend, self.graphs = model, backend, graphs
        self.sampler, self.choose_tokens = sampler, choose_tokens
        self.join_logits, self.layout_device = join_logits, layout_device
        self.page_size = backend.kv_cache.page_size

    def prepare(self, batch: ScheduledBatch, bucket: int | None = None) -> StepInputs:
        """The batch as flat tensors, padded to its graph bucket (or to `bucket`)."""
        if bucket is None:
            pools = any(request.pooling is not None for request in batch.requests)
            bucket = self.graphs.bucket_for(batch) if self.graphs and not pools else 0
        return build_step_inputs(batch, self.page_size, self.layout_device, pad_to=bucket)

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits for the sampled rows, `[S, vocab]` (None on ranks other than 0)."""
        if inputs.pooled_rows:
            logits = self._forward_pooling(inputs)
        elif inputs.bucket:
            logits = self.graphs.forward(inputs)
        else:
            self.backend.plan(inputs.metadata)
            logits = self.model(inputs.input_ids, inputs.metadata, self.backend, inputs.sample_rows)
        return self.join_logits(logits)

    @torch.inference_mode()
    def _forward_pooling(self, inputs: StepInputs) -> torch.Tensor:
        """An eager forward pass that also hands each embedding request its row's final
        hidden state (graphs keep only logits)."""
        self.backend.plan(inputs.metadata)
        hidden = self.model.hidden_states(inputs.input_ids, inputs.metadata, self.backend)
        rows = hidden[inputs.sample_rows]
        record_embeddings(self.model.model.norm(rows), inputs.pooled_rows)
        return self.model.compute_logits(rows)

    def sample(
        self, logits: torch.Tensor | None, inputs: StepInputs
    ) -> list[tuple[Request, list[int]]]:
        """Every sampled request with its new tokens (on rank 0; other ranks sample nothing),
        after scoring the prompt rows that follow the sampled ones."""
        if logits is None:
            return []
        if inputs.prompt_rows:
            num_sampled = sum(inputs.num_sampled_rows)
            score_prompts(logits[num_sampled:], inputs.prompt_rows)
            logits = logits[:num_sampled]
        if not inputs.sampled_requests:
            return []
        tokens = self.choose_tokens(self.sampler, logits, inputs.sampled_requests)
        return list(zip(inputs.sampled_requests, tokens))

    def run(self, batch: ScheduledBatch) -> list[tuple[Request, list[int]]]:
        inputs = self.prepare(batch)
        return self.sample(self.forward(inputs), inputs)

    def capture_graphs(self) -> None:
        """Record the decode graphs, from padding steps laid out like any other."""
        if self.graphs is not None:
            self.graphs.capture_all(lambda bucket: self.prepare(ScheduledBatch([], []), bucket))
