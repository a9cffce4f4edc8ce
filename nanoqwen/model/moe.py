"""The sparse Mixture-of-Experts block: the MLP of Qwen2/Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE.

A dense MLP runs every token through one SwiGLU. A sparse block holds E narrower ones, the
experts, and a router (`gate`, a linear map H → E) that picks k of them per token: a
softmax over the E logits in float32, the k largest probabilities name the token's experts
and weigh their outputs (renormalised to sum to 1 where `norm_topk_prob` says so, as in
Qwen3-MoE; Qwen2-MoE keeps them as they are). Qwen2-MoE, Qwen3-Next and Qwen3.5 add a
shared expert that every token goes through, scaled by sigmoid(`shared_expert_gate`(x)). A
token reads k/E of the expert weights: Qwen3-30B-A3B holds 30B parameters and uses 3B.

The serving problem: a step's tokens arrive as one flat batch `[T, H]`, many requests back
to back, and each token wants different experts. transformers builds a one-hot mask
`[E, k, T]` and finds each routed expert's tokens with `torch.where`, a host sync per
expert; padding every expert to the same number of rows wastes work; running every expert
on every token reads all E experts' weights. Instead the block sorts the work:

    (token, k) pairs ──argsort by expert──► rows grouped by expert
    expert:    0        1     2      3    ...  E-1
    rows:   [0, c0)    ∅    ∅   [c0, c0+c3)  ...        (at decode, most experts get none)

* The grouped loop (`Experts.grouped_loop`, the lesson and the oracle): one bincount, read
  once by the host, says where each expert's rows lie; each expert that received tokens runs
  one SwiGLU on its rows, and `index_add_` adds them, weighted, into their tokens' outputs.
* The grouped GEMM (`Experts.grouped_gemm`): torch's grouped GEMM (`F.grouped_mm`) multiplies
  every group by its expert's weight in one call, the groups' ends (`offs`) a tensor, and the
  results go back to (token, k) order to be summed per token.
* CUDA: the grouped GEMM where torch has a kernel for it (bf16 on sm90/sm100), with no host
  sync and fixed shapes, so a decode step can be captured in a CUDA graph; the loop elsewhere.
* CPU: torch's grouped GEMM walks all E groups, empty or not, in C++, while the loop pays a
  few Python-dispatched ops per expert it runs. The loop is faster for very few (token, k)
  pairs (one decoding token: k experts of E), the grouped GEMM from one pair per 8 experts
  up (two tokens of Qwen3-MoE's top-8 of 128), so the step's pairs choose.

Weights are stacked per layer, `experts.gate_up_proj.weight` `[E, 2·I, H]` (each expert's
gate rows, then its up rows) and `experts.down_proj.weight` `[E, H, I]`, as transformers
and Qwen3.5's checkpoints keep them: `weight[e]` is expert e's linear weight for the loop,
`weight.transpose(1, 2)` the column-major operand the grouped GEMM wants. Checkpoints
store experts one tensor per expert and part (`mlp.experts.3.gate_proj.weight`, on the hub
and as transformers saves) or stacked (Qwen3.5, llama.cpp's `ffn_gate_exps`);
`split_expert_stacks` cuts stacked ones into per-expert views read lazily, so the loader
fills one block of a parameter per tensor whatever the layout.

Split across ranks, each rank keeps the same slice of every expert's intermediate channels
(and of the shared expert's), as the dense MLP does; the router and the shared expert's
gate are whole on every rank. Each rank's output is then a partial sum, and the ranks add
theirs up once, at the end of the block.

Invariant: for the same weights, the block's output equals transformers' sparse MoE block
(in float32, within rounding), whichever path computes it and however the ranks split it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.model.config import ModelConfig, MoeShape
from nanoqwen.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    current_group,
)
from nanoqwen.model.loading import copy_checked, read_block

if TYPE_CHECKING:
    from nanoqwen.model.loading import TensorSlice


def sparse_moe_block(config: ModelConfig, layer: int) -> SparseMoeBlock:
    """The `sparse_moe` layer kind: the experts of the model's config."""
    return SparseMoeBlock(config.moe)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse decoder layer: `[T, H]` hidden states in, `[T, H]` out."""

    def __init__(self, shape: MoeShape) -> None:
        super().__init__()
        self.num_experts_per_tok = shape.num_experts_per_tok
        self.norm_topk_prob = shape.norm_topk_prob
        self.gate = ReplicatedLinear(shape.hidden_size, shape.num_experts)
        channels = Split.even(shape.moe_intermediate_size)
        self.experts = Experts(shape.num_experts, shape.hidden_size, channels)
        if shape.shared_expert_intermediate_size:
            shared_channels = Split.even(shape.shared_expert_intermediate_size)
            self.shared_expert = SharedExpert(shape.hidden_size, shared_channels)
            self.shared_expert_gate = ReplicatedLinear(shape.hidden_size, 1)
        self.group = current_group()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The shared expert reads `hidden` first: a fused expert kernel may write its output there.
        shared = self.shared_output(hidden) if hasattr(self, "shared_expert") else None
        expert_ids, weights = self.route(hidden)
        out = self.experts(hidden, expert_ids, weights)
        if shared is not None:
            out += shared
        # Experts and shared expert added their partial sums first; the ranks add theirs once.
        return self.group.all_reduce(out)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts `[T, k]` and their weights `[T, k]` (in `hidden`'s dtype),
        computed exactly as transformers does, so that both pick the same experts."""
        probs = torch.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.num_experts_per_tok, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(hidden.dtype)

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked, and the two ways to run them."""

    def __init__(self, num_experts: int, hidden_size: int, channels: Split) -> None:
        super().__init__()
        self.num_experts = num_experts
        gate_up_shape = (num_experts, 2 * channels.length, hidden_size)
        self.gate_up_proj = ExpertStack(gate_up_shape, [channels] * 2, dim=0)
        self.down_proj = ExpertStack((num_experts, hidden_size, channels.length), [channels], dim=1)

    def forward(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Σ over each token's k experts of weight × expert(token): this rank's partial sum."""
        channels, pairs = self.down_proj.weight.shape[-1], expert_ids.numel()
        if runs_grouped_gemm(hidden, channels) or grouped_gemm_pays_on_cpu(
            hidden, channels, pairs, self.num_experts
        ):
            return self.grouped_gemm(hidden, expert_ids, weights)
        return self.grouped_loop(hidden, expert_ids, weights)

    def grouped_loop(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One SwiGLU per expert that received tokens, on its rows; one host sync in all."""
        _, order = sort_by_expert(expert_ids)
        tokens = order // expert_ids.shape[1]
        rows = hidden[tokens]  # each (token, k) pair's token, grouped by expert
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        end = 0
        for expert, count in enumerate(counts):
            start, end = end, end + count
            if count:  # its output overwrites its input: one buffer serves the whole batch
                gate_up, down = self.gate_up_proj.weight[expert], self.down_proj.weight[expert]
                rows[start:end] = swiglu(rows[start:end], gate_up, down)
        rows *= weights.flatten()[order, None]
        return torch.zeros_like(hidden).index_add_(0, tokens, rows)

    def grouped_gemm(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert in two grouped GEMMs, with no host sync and shapes fixed by `[T, k]`
        alone (CUDA-graph safe on the GPU). Results go back to (token, k) order and are summed per
        token, so no atomic adds make the sum's rounding depend on timing."""
        num_tokens, k = expert_ids.shape
        sorted_ids, order = sort_by_expert(expert_ids)
        experts = torch.arange(self.num_experts, device=hidden.device)
        ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
        gate_up_weights, down_weights = (
            stack.weight.transpose(1, 2) for stack in (self.gate_up_proj, self.down_proj)
        )
        gate, up = F.grouped_mm(hidden[order // k], gate_up_weights, offs=ends).chunk(2, dim=-1)
        by_expert = F.grouped_mm(F.silu(gate) * up, down_weights, offs=ends)
        by_pair = torch.empty_like(by_expert).index_copy_(0, order, by_expert)
        return (by_pair.view(num_tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def sort_by_expert(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs, flattened, sorted by expert: their experts, and each one's
    index `token * k + j`. Stable, so tokens keep their order within an expert."""
    return expert_ids.flatten().sort(stable=True)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate, inplace=True).mul_(up), down)


def runs_grouped_gemm(hidden: torch.Tensor, channels: int) -> bool:
    """On a GPU, does torch's grouped GEMM serve these experts without a host sync? Only its
    CUTLASS kernel does (bf16 on sm90/sm100, rows 16-byte aligned); on other GPUs torch loops
    over every group with the sizes read on the host, where the grouped loop skips empty ones."""
    return grouped_gemm_serves(hidden.device, hidden.dtype, hidden.shape[-1], channels)


def grouped_gemm_serves(
    device: torch.device, dtype: torch.dtype, hidden_size: int, channels: int
) -> bool:
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and hasattr(F, "grouped_mm")
        and hidden_size % 8 == 0
        and channels % 8 == 0
        and cuda_major(device.index) in (9, 10)
    )


def grouped_gemm_pays_on_cpu(
    hidden: torch.Tensor, channels: int, pairs: int, num_experts: int
) -> bool:
    """Is torch's grouped GEMM the faster way to run a step's experts on the CPU? It walks
    all E groups; the grouped loop runs ~6 ops from Python for each expert a pair routes to.
    Measured on one thread, the loop wins below one (token, k) pair per 8 experts, the
    grouped GEMM from there up. Its rows must be 16-byte aligned there too."""
    row_bytes = hidden.element_size()
    return (
        hidden.device.type == "cpu"
        and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and hasattr(F, "grouped_mm")
        and hidden.shape[-1] * row_bytes % 16 == 0
        and channels * row_bytes % 16 == 0
        and 8 * pairs >= num_experts
    )


def experts_fit_cuda_graphs(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Can a CUDA graph hold the model's experts? Only where the grouped GEMM runs them:
    the grouped loop reads its experts' row counts on the host, which a graph cannot."""
    return all(
        grouped_gemm_serves(device, dtype, *block.experts.down_proj.weight.shape[1:])
        for block in model.modules() if isinstance(block, SparseMoeBlock)
    )


@functools.cache
def cuda_major(device: int | None) -> int:
    return torch.cuda.get_device_capability(device)[0]


class ExpertStack(nn.Module):
    """One linear weight per expert, stacked `[E, out, in]`, each split across ranks as a
    dense layer's is: along its rows (`dim=0`, one `Split` per fused part) or columns."""

    def __init__(self, shape: tuple[int, int, int], splits: Sequence[Split], dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        self.splits, self.dim = list(splits), dim
        self.num_blocks = shape[0] * len(self.splits)  # one checkpoint tensor per expert and part

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        """Block `expert * parts + part`: this rank's slice of one expert's part."""
        expert, part = divmod(block, len(self.splits))
        return read_block(param.data[expert], source, part, self.splits, self.dim)


class SharedExpert(nn.Module):
    """A dense SwiGLU every token goes through, split across ranks as the experts are."""

    def __init__(self, hidden_size: int, channels: Split) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [channels] * 2, bias=False)
        self.down_proj = PartialSumLinear(channels, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class PartialSumLinear(RowParallelLinear):
    """A row-parallel layer that leaves its partial sum for the block to add up, once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super(RowParallelLinear, self).forward(x)  # RowParallelLinear's, but the sum


class ReplicatedLinear(nn.Module):
    """`x @ W.T` with a weight every rank keeps whole. Not an `nn.Linear`, so that weight
    quantization, which rounds those, leaves the routing decisions as the model made them."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        tensor = source[:]
        if tensor.numel() == param.numel():  # llama.cpp keeps the `[1, H]` shared gate as `[H]`
            tensor = tensor.reshape(param.shape)
        copy_checked(param.data, tensor)
        return param.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


# Checkpoint names, after a sparse layer's `...layers.N.mlp.`: ours, and the block's index.
BLOCK_WEIGHTS = {
    "gate.weight": ("gate.weight", 0),
    "shared_expert_gate.weight": ("shared_expert_gate.weight", 0),
    "shared_expert.gate_proj.weight": ("shared_expert.gate_up_proj.weight", 0),
    "shared_expert.up_proj.weight": ("shared_expert.gate_up_proj.weight", 1),
    "shared_expert.down_proj.weight": ("shared_expert.down_proj.weight", 0),
}
# An expert's part → our stacked parameter, the part's index in it, and its number of parts.
EXPERT_PARTS = {
    "gate_proj": ("experts.gate_up_proj.weight", 0, 2),
    "up_proj": ("experts.gate_up_proj.weight", 1, 2),
    "down_proj": ("experts.down_proj.weight", 0, 1),
}
# A stacked tensor `[E, rows, cols]` → the experts' parts it holds, along its rows.
STACKED_PARTS = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "gate_proj": ("gate_proj",),
    "up_proj": ("up_proj",),
    "down_proj": ("down_proj",),
}
MLP_WEIGHT = re.compile(r"(?P<mlp>(?:.+\.)?layers\.\d+\.mlp\.)(?P<rest>.+)")
EXPERT_WEIGHT = re.compile(r"experts\.(?P<expert>\d+)\.(?P<part>\w+)\.weight")
STACKED_WEIGHT = re.compile(r"experts\.(?P<parts>\w+?)(?:\.weight)?")
# llama.cpp's tensor names, after `blk.N.` (gguf's `MODEL_TENSOR`), → transformers', after
# `model.layers.N.mlp.` (the stacked ones as gguf's `TensorNameMap` calls them).
GGUF_PARTS = {
    "ffn_gate_inp": "gate",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_shexp": "shared_expert.gate_proj",
    "ffn_up_shexp": "shared_expert.up_proj",
    "ffn_down_shexp": "shared_expert.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}


def moe_checkpoint_name(name: str, shape: MoeShape) -> tuple[str, int] | None:
    """A sparse block's checkpoint tensor, one per expert and part (as on the hub) or a
    router or shared-expert weight → (our parameter, its block); None for any other tensor.
    Stacked experts go through `split_expert_stacks` first."""
    match = MLP_WEIGHT.fullmatch(name)
    if match is None:
        return None
    mlp, rest = match["mlp"], match["rest"]
    if rest in BLOCK_WEIGHTS:
        ours, block = BLOCK_WEIGHTS[rest]
        return mlp + ours, block
    expert = EXPERT_WEIGHT.fullmatch(rest)
    if expert is None or expert["part"] not in EXPERT_PARTS:
        return None
    index = int(expert["expert"])
    if index >= shape.num_experts:
        raise ValueError(f"{name!r} names expert {index}, but the model has {shape.num_experts}")
    ours, part, parts = EXPERT_PARTS[expert["part"]]
    return mlp + ours, index * parts + part


def split_expert_stacks(
    name: str, source: TensorSlice, shape: MoeShape
) -> Iterator[tuple[str, TensorSlice]]:
    """A stacked experts tensor (`mlp.experts.gate_up_proj` `[E, 2·I, H]`, `...down_proj`
    `[E, H, I]`, llama.cpp's per-part stacks) as one view per expert and part, named as on
    the hub and read only where indexed; any other tensor as it is."""
    match = MLP_WEIGHT.fullmatch(name)
    stacked = match and STACKED_WEIGHT.fullmatch(match["rest"])
    if not stacked or stacked["parts"] not in STACKED_PARTS:
        yield name, source
        return
    parts = STACKED_PARTS[stacked["parts"]]
    for expert in range(shape.num_experts):
        for index, part in enumerate(parts):
            rows = shape.hidden_size if part == "down_proj" else shape.moe_intermediate_size
            view = ExpertView(source, expert, index * rows, rows)
            yield f"{match['mlp']}experts.{expert}.{part}.weight", view


class ExpertView:
    """Rows `[first_row, first_row + rows)` of expert `expert` in a stacked tensor, which
    reads (a safetensors slice: from the file) only what it is indexed with."""

    def __init__(self, stack: TensorSlice, expert: int, first_row: int, rows: int) -> None:
        self.stack, self.expert, self.first_row, self.rows = stack, expert, first_row, rows

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        row_slice, *columns = index if isinstance(index, tuple) else (index,)
        start, stop, _ = row_slice.indices(self.rows)
        rows = slice(self.first_row + start, self.first_row + stop)
        return self.stack[(slice(self.expert, self.expert + 1), rows, *columns)][0]


def moe_gguf_name(name: str) -> str | None:
    """llama.cpp's name of a sparse block's tensor (`blk.3.ffn_gate_exps.weight`) →
    transformers' (`model.layers.3.mlp.experts.gate_proj.weight`); None for any other."""
    match = re.fullmatch(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.weight", name)
    if match is None or match["part"] not in GGUF_PARTS:
        return None
    return f"model.layers.{match['layer']}.mlp.{GGUF_PARTS[match['part']]}.weight"
