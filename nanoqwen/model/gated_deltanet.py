"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5.

Three of every four decoder layers of these models replace softmax attention by the gated
delta rule (`delta_rule.py`: what it is, and why its state has a fixed size). The layer
around it is transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet`: project the
hidden state to q, k, v, z, b and a; run the causal depthwise conv1d with SiLU over the
q|k|v channels, continuing from the request's conv window; β = sigmoid(b) and
g = −exp(A_log)·softplus(a + dt_bias); the delta rule from the request's recurrent state;
an RMSNorm of each value head gated by SiLU(z) (its weight multiplies as it is, unlike the
zero-centred norms around the layer); out_proj, whose partial sums the ranks of a split
model add up.

Serving shapes it the way the dense attention is shaped: the input is the flat `[T]`
tokens of many requests. A request's memory here is not pages but one slot of a state
pool, read and written through `StateView`: a decode-only step gathers every request's
slot at once, steps, and scatters back, with fixed shapes and no host sync (so a CUDA
graph can hold it; padding rows point at the dummy slot 0); in a mixed step each prefill
request runs alone, chunked, from its slot's window and state, and the one-token requests
still run together. Split across ranks, each rank keeps whole key heads with their value
heads, their conv channels and their gates.

Invariant: however a request's tokens are cut into steps (prefill chunks of any length,
single-token decodes batched with other requests in any slot order), its outputs equal
transformers' for the whole sequence, and its slot then holds the conv window and state
after the last token seen; no other slot is touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.model.delta_rule import (
    causal_conv1d,
    chunked_delta_rule,
    flashinfer_decode,
    flashinfer_prefill,
    flashinfer_serves,
    prepare_queries_keys,
    recurrent_delta_rule_step,
)
from nanoqwen.model.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    current_group,
    normalize,
)
from nanoqwen.model.loading import read_block

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from nanoqwen.model.config import ModelConfig
    from nanoqwen.model.loading import TensorSlice
    from nanoqwen.model.qwen import LayerInputs


# ------------------------------------------------------------------------ the state pool
class StateView(Protocol):
    """One step's view of the state pool, for the requests of the step in order."""

    query_lens: list[int]  # host: new tokens of each request (their sum is the step's T)
    slots: torch.Tensor  # int64 [B] on the device: each request's state slot

    def layer_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's conv windows `[num_slots, conv_channels, kernel - 1]` (model dtype)
        and recurrent states `[num_slots, v_heads, k_dim, v_dim]` (float32) on this rank,
        updated in place. Slot 0 is a dummy that padding rows may write to."""
        ...


@dataclass(frozen=True)
class StateShapes:
    """One slot of one Gated DeltaNet layer on this rank: what the pool allocates."""

    conv: tuple[int, int]  # (channels, kernel - 1)
    conv_dtype: torch.dtype  # the model's
    recurrent: tuple[int, int, int]  # (value heads, k_dim, v_dim)
    recurrent_dtype: torch.dtype = torch.float32


def deltanet_state_shapes(config: PretrainedConfig, dtype: torch.dtype) -> StateShapes:
    """The per-slot state of a model's Gated DeltaNet layers, for this rank's heads (built
    inside `split_across`, a rank's share), with the model's `dtype` for the conv window."""
    ranks = current_group().size
    key_heads = config.linear_num_key_heads // ranks
    value_heads = config.linear_num_value_heads // ranks
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * key_heads * k_dim + value_heads * v_dim
    return StateShapes(
        (channels, config.linear_conv_kernel_dim - 1), dtype, (value_heads, k_dim, v_dim)
    )


def prefill_requests(states: StateView) -> Iterator[tuple[slice, torch.Tensor]]:
    """The rows and slot (`[1]`, on the device) of each request with more than one token."""
    starts = itertools.accumulate(states.query_lens, initial=0)
    for request, (start, length) in enumerate(zip(starts, states.query_lens)):
        if length > 1:
            yield slice(start, start + length), states.slots[request : request + 1]


def decode_requests(states: StateView) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows and slots of a mixed step's one-token requests; None if it has none."""
    starts = list(itertools.accumulate(states.query_lens, initial=0))
    requests = [request for request, length in enumerate(states.query_lens) if length == 1]
    if not requests:
        return None
    device = states.slots.device
    rows = torch.tensor([starts[request] for request in requests], device=device)
    return rows, states.slots[torch.tensor(requests, device=device)]


# ---------------------------------------------------------------------------- the layer
class StackedColumnLinear(ColumnParallelLinear):
    """A projection whose one checkpoint weight stacks blocks of rows (q | k | v), each
    split across ranks: a rank keeps its slice of every block."""

    def __init__(self, in_features: int, splits: Sequence[Split]) -> None:
        super().__init__(in_features, splits, bias=False)
        self.num_blocks = 1

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        return read_stacked(param, source, self.splits)


class CausalConv1d(nn.Module):
    """The depthwise conv over q|k|v: `weight [channels, 1, kernel]`, this rank's channels."""

    def __init__(self, splits: Sequence[Split], kernel: int) -> None:
        super().__init__()
        self.splits = list(splits)
        self.weight = nn.Parameter(torch.empty(sum(s.length for s in splits), 1, kernel))

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        return read_stacked(param, source, self.splits)

    def forward(
        self, x: torch.Tensor, window: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d(x, self.weight, window)


def read_stacked(
    param: torch.Tensor, source: TensorSlice, splits: Sequence[Split]
) -> torch.Tensor:
    """Every block's slice of one checkpoint tensor, one after another in `param`'s rows."""
    for block in range(len(splits)):
        read_block(param, source, block, splits, dim=0)
    return param.data


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head, times its weight (not zero-centred), times SiLU(z):
    transformers' `Qwen3NextRMSNormGated`, rounding where it rounds."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self.weight * normalize(x, self.eps) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A decoder layer's linear attention (`linear_attn.`), over this rank's heads; `layer`
    is the index its states are kept under (`StateView.layer_states(layer)`).

    Parameter names are the checkpoint's: Qwen3-Next fuses its input projections, grouped
    per key head (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5 keeps them apart (`in_proj_qkv`,
    `in_proj_z`, `in_proj_b`, `in_proj_a`). Both have `conv1d`, `A_log`, `dt_bias`, `norm`
    and `out_proj`.
    """

    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        ranks = current_group().size
        check_splittable(config, ranks)
        self.layer = layer
        hidden = config.hidden_size
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_k_heads = config.linear_num_key_heads // ranks
        self.num_v_heads = config.linear_num_value_heads // ranks
        key_width = config.linear_num_key_heads * self.k_dim
        value_width = config.linear_num_value_heads * self.v_dim
        self.heads = Split.even(config.linear_num_value_heads)
        keys, values = Split.even(key_width), Split.even(value_width)
        # The conv's channels (and Qwen3.5's in_proj_qkv rows): all q, all k, all v heads.
        qkv = [
            keys,
            Split(key_width + keys.start, keys.length),
            Split(2 * key_width + values.start, values.length),
        ]
        self.fused = config.model_type == "qwen3_next"
        if self.fused:  # rows grouped per key head: its [q k v z], then its [b a]
            qkvz_rows = Split.even(2 * (key_width + value_width))
            self.in_proj_qkvz = ColumnParallelLinear(hidden, [qkvz_rows], bias=False)
            ba_rows = Split.even(2 * config.linear_num_value_heads)
            self.in_proj_ba = ColumnParallelLinear(hidden, [ba_rows], bias=False)
        else:
            self.in_proj_qkv = StackedColumnLinear(hidden, qkv)
            self.in_proj_z = ColumnParallelLinear(hidden, [values], bias=False)
            self.in_proj_b = ColumnParallelLinear(hidden, [self.heads], bias=False)
            self.in_proj_a = ColumnParallelLinear(hidden, [self.heads], bias=False)
        self.conv1d = CausalConv1d(qkv, config.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(values, hidden)
        self.use_flashinfer: bool | None = None  # decided on the first step, on its device

    def load_block(self, param: torch.Tensor, source: TensorSlice, block: int) -> torch.Tensor:
        """`A_log` and `dt_bias`: one value per value head, this rank's heads."""
        return read_block(param, source, 0, [self.heads], dim=0)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """hidden `[T, hidden_size]`: the step's requests' tokens, packed in order;
        `inputs.states` is the step's view of the state pool."""
        states: StateView = inputs.states
        if self.use_flashinfer is None:
            self.use_flashinfer = flashinfer_serves(hidden, self.k_dim, self.v_dim)
        qkv, z, b, a = self.project(hidden)
        windows, recurrent = states.layer_states(self.layer)
        if max(states.query_lens) == 1:  # decodes only: fixed shapes, a CUDA graph may hold it
            out = self.decode(qkv, b, a, windows, recurrent, states.slots)
        else:
            out = qkv.new_empty(qkv.shape[0], self.num_v_heads, self.v_dim)
            for rows, slot in prefill_requests(states):
                out[rows] = self.prefill(qkv[rows], b[rows], a[rows], windows, recurrent, slot)
            decodes = decode_requests(states)
            if decodes is not None:
                rows, slots = decodes
                out[rows] = self.decode(qkv[rows], b[rows], a[rows], windows, recurrent, slots)
        return self.out_proj(self.norm(out, z).flatten(1))

    def project(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's input `[T, q|k|v channels]`, z `[T, v_heads, v_dim]`, b and a
        `[T, v_heads]`."""
        if not self.fused:
            z = self.in_proj_z(hidden).unflatten(-1, (-1, self.v_dim))
            return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)
        group = self.num_v_heads // self.num_k_heads  # value heads per key head
        qkvz = self.in_proj_qkvz(hidden).unflatten(-1, (self.num_k_heads, -1))
        widths = [self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim]
        q, k, v, z = qkvz.split(widths, dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (self.num_k_heads, -1)).split(group, dim=-1)
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        return qkv, z.reshape(z.shape[0], -1, self.v_dim), b.flatten(1), a.flatten(1)

    def split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output `[..., channels]` → q, k `[..., key_heads, k_dim]` and v
        `[..., v_heads, v_dim]`."""
        width = self.num_k_heads * self.k_dim
        q, k, v = mixed.split([width, width, self.num_v_heads * self.v_dim], dim=-1)
        head = (-1, self.k_dim)
        return q.unflatten(-1, head), k.unflatten(-1, head), v.unflatten(-1, (-1, self.v_dim))

    def gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g (log of the fading, ≤ 0) and β in float32, rounded where transformers rounds."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return g, b.sigmoid().float()

    def decode(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        windows: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each of B requests, all at once: gather their slots, step, scatter."""
        mixed, window = self.conv1d(qkv[:, None], windows.index_select(0, slots))
        windows.index_copy_(0, slots, window)
        q, k, v = self.split_heads(mixed[:, 0])
        state = recurrent.index_select(0, slots)
        if self.use_flashinfer:
            out = flashinfer_decode(q, k, v, a, b, self.A_log, self.dt_bias, state)
        else:
            g, beta = self.gates(a, b)
            q, k = prepare_queries_keys(q, k, self.num_v_heads)
            out = recurrent_delta_rule_step(q, k, v.float(), g, beta, state).to(v.dtype)
        recurrent.index_copy_(0, slots, state)
        return out

    def prefill(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        windows: torch.Tensor, recurrent: torch.Tensor, slot: torch.Tensor,
    ) -> torch.Tensor:
        """One request's L tokens, continuing from its slot's window and state."""
        mixed, window = self.conv1d(qkv, windows.index_select(0, slot)[0])
        windows.index_copy_(0, slot, window[None])
        q, k, v = self.split_heads(mixed)
        g, beta = self.gates(a, b)
        state = recurrent.index_select(0, slot)[0]
        if self.use_flashinfer:
            out, state = flashinfer_prefill(q, k, v, g, beta, state)
        else:
            q, k = prepare_queries_keys(q, k, self.num_v_heads)
            out, state = chunked_delta_rule(q, k, v.float(), g, beta, state)
            out = out.to(v.dtype)
        recurrent.index_copy_(0, slot, state[None])
        return out


def gated_deltanet(config: ModelConfig, layer: int) -> GatedDeltaNet:
    """The `linear_attention` layer kind: decoder layer `layer`, known to the state pool by
    its place among the layers that keep a recurrent state."""
    return GatedDeltaNet(config.hf_config, config.state_layers.index(layer))


def check_splittable(config: PretrainedConfig, ranks: int) -> None:
    """A ValueError unless `ranks` ranks can each hold whole key heads with their values."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if key_heads % ranks or value_heads % key_heads:
        raise ValueError(
            f"{ranks} ranks must divide the model's {key_heads} linear-attention key heads, "
            f"whose number must divide its {value_heads} value heads"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"Gated DeltaNet's conv runs SiLU, not {config.hidden_act}")
