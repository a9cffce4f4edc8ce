"""Time one sparse MoE layer's experts on this CPU, grouped by expert against looping over them.

    python -m tools.bench_moe [--threads N] [--repeats R]

At a Qwen3-30B-A3B layer's shape (hidden 2048, 128 experts, top-8, expert width 768), for 1
and 16 tokens, in bfloat16 and float32, the median and the best time of:

* `grouped loop`: one SwiGLU per expert that received tokens, nanoqwen's CPU path for
  fewer (token, k) pairs than experts / 8 (here: 1 token);
* `grouped_mm`: torch's grouped GEMM, nanoqwen's CPU path for more pairs (here: 16 tokens)
  and its CUDA path;
* `transformers`: transformers' eager experts loop (a mask and a host sync per routed expert);
* `every expert`: every expert on every token, as a batched matmul, then weighted (what a
  path with fixed shapes and no grouped GEMM would compute).

All four share the same weights and routing; the router itself is left out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from nanoqwen.model.config import MoeShape
from nanoqwen.model.moe import SparseMoeBlock

SHAPE = MoeShape(
    hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, shared_expert_intermediate_size=0, decoder_sparse_step=1,
    mlp_only_layers=(),
)
TOKEN_COUNTS = (1, 16)


def every_expert(block: SparseMoeBlock, hidden: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    gate, up = torch.matmul(hidden, block.experts.gate_up_proj.weight.transpose(1, 2)).chunk(2, -1)
    outputs = torch.matmul(F.silu(gate) * up, block.experts.down_proj.weight.transpose(1, 2))
    combine = torch.zeros(hidden.shape[0], SHAPE.num_experts, dtype=hidden.dtype)
    combine.scatter_(1, ids, weights)  # [T, E]: each token's weight for each expert, mostly 0
    return torch.einsum("te,eth->th", combine, outputs)


def transformers_experts(block: SparseMoeBlock) -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(
        hidden_size=SHAPE.hidden_size, num_experts=SHAPE.num_experts,
        moe_intermediate_size=SHAPE.moe_intermediate_size,
    )
    config._experts_implementation = "eager"
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj = block.experts.gate_up_proj.weight  # the same tensors, not copies
    experts.down_proj = block.experts.down_proj.weight
    return experts


def interleaved_ms(
    ways: dict[str, Callable[[], torch.Tensor]], rounds: int
) -> dict[str, list[float]]:
    """Each way's times in ms, the ways taking turns round by round, so that a machine
    whose load drifts (other processes) slows them all alike."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds + 1):  # the first round warms up
        for name, run in ways.items():
            start = time.perf_counter()
            run()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: values[1:] for name, values in times.items()}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, the ways interleaved over {args.repeats} rounds, ms per layer")
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        block = SparseMoeBlock(SHAPE).to(dtype)
        for param in block.parameters():
            param.data.normal_(std=0.02)
        theirs = transformers_experts(block)
        for count in TOKEN_COUNTS:
            hidden = torch.randn(count, SHAPE.hidden_size, dtype=dtype)
            ids, weights = block.route(hidden)
            ways = {
                "grouped loop": lambda: block.experts.grouped_loop(hidden, ids, weights),
                "grouped_mm": lambda: block.experts.grouped_gemm(hidden, ids, weights),
                "transformers": lambda: theirs(hidden, ids, weights),
                "every expert": lambda: every_expert(block, hidden, ids, weights),
            }
            reference = ways["grouped loop"]().float()
            routed = len(ids.unique())
            for name, values in interleaved_ms(ways, args.repeats).items():
                error = (ways[name]().float() - reference).abs().max().item()
                dtype_name = str(dtype).removeprefix("torch.")
                print(
                    f"{dtype_name:>8} {count:>2} tokens ({routed:>3} experts routed) "
                    f"{name:>13}: median {statistics.median(values):8.2f}  "
                    f"min {min(values):8.2f} ms  (max diff {error:.1e})", flush=True,
                )


if __name__ == "__main__":
    main()
