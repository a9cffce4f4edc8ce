"""The gated delta rule: linear attention that edits its memory, in torch and in flashinfer.

Softmax attention keeps every past key and value (the KV cache) and reads all of them for
each new token, so its memory and work grow with the sequence. Drop the softmax and the
past folds into one matrix per head: the state S = Σ k_t v_tᵀ, `[k_dim, v_dim]`. A query
reads it with one product, o = Sᵀ q, and a token writes itself in with one outer product.
The state is as large after ten tokens as after a million: a request's whole memory in
such a layer is this matrix plus the last few inputs of a short convolution, which live in
one *slot* of a state pool rather than in pages of a KV cache.

Plain addition only piles associations on top of each other; the *delta rule* edits them.
Before writing v_t under the key k_t, the state recalls what it already holds there,
Sᵀ k_t, and writes only the correction, at a learning rate β_t in (0, 1):
S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ. *Gated* DeltaNet first lets the whole state fade,
S ← exp(g_t) S with g_t ≤ 0, so the layer can forget. Token by token this is
`recurrent_delta_rule_step`, which is what a decode step runs.

A prompt as L sequential updates would leave a matrix unit idle, so `chunked_delta_rule`
works in chunks of 64 tokens. Within a chunk, each correction depends on the earlier ones
only through a lower-triangular system (the WY/UT form of the chunk's updates), solved
once; the chunk reads the state carried in with one matmul and hands a new state on. That
state is exactly the one the recurrence reaches at the chunk's last token, which is why a
prompt may be cut anywhere: prefilled in chunks of any size from the state its earlier
tokens left, then decoded one token at a time, it gives the same outputs.

Before the rule, `causal_conv1d` mixes each channel with its last few inputs (a kernel of
4), continuing from the window of inputs the previous step left; and q, k are made unit
length, q scaled by k_dim^-½, each key head shared by a group of value heads.

On a Hopper GPU flashinfer runs the same rule as two kernels; they differ from the torch
functions in form only: the prefill kernel takes the fading in linear space, exp(g), and
its state K-last (`[v_heads, v_dim, k_dim]`); the decode kernel takes our K-major layout
and computes the gates and the normalisation itself.

Invariant: `chunked_delta_rule` over any chunk size gives the outputs and final state of
`recurrent_delta_rule_step` applied token by token (within float32 rounding), and both
give transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv and SiLU over new tokens `x [..., L, C]`, continuing from the
    `window [..., C, kernel - 1]` of inputs before them (zeros for a fresh request); weight
    `[C, 1, kernel]`. Returns the outputs `[..., L, C]` and the window after these tokens:
    the last `kernel - 1` inputs, partly the old window's when L < kernel - 1."""
    kernel = weight.shape[-1]
    inputs = torch.cat([window, x.transpose(-1, -2).to(window.dtype)], dim=-1)
    channels, length = inputs.shape[-2:]
    out = F.conv1d(inputs.reshape(-1, channels, length).to(weight.dtype), weight, groups=channels)
    out = F.silu(out).reshape(*inputs.shape[:-1], -1).transpose(-1, -2).to(x.dtype)
    return out, inputs[..., length - (kernel - 1) :]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / |x| along the last dimension, as FLA's kernels (and transformers) compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def prepare_queries_keys(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[..., key_heads, k_dim]` → float32, unit length, q scaled by k_dim^-½, each key
    head repeated for the value heads that read it: `[..., num_v_heads, k_dim]`."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    group = num_v_heads // q.shape[-2]
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def recurrent_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """One token for each of B requests: q, k `[B, heads, k_dim]` (prepared), v
    `[B, heads, v_dim]`, g, beta `[B, heads]`, all float32. Updates `states
    [B, heads, k_dim, v_dim]` in place and returns the outputs `[B, heads, v_dim]`."""
    states.mul_(g.exp()[..., None, None])
    recalled = torch.einsum("bhkv,bhk->bhv", states, k)
    correction = (v - recalled) * beta[..., None]
    states.add_(k[..., :, None] * correction[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", states, q)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's L tokens from `state [heads, k_dim, v_dim]`: q, k `[L, heads, k_dim]`
    (prepared), v `[L, heads, v_dim]`, g, beta `[L, heads]`, all float32. Returns the
    outputs `[L, heads, v_dim]` and the state after the last token (a new tensor)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # heads first: [heads, L, dim]
    g, beta = g.t(), beta.t()
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk_size):
        rows = slice(start, start + chunk_size)
        out[:, rows], state = delta_rule_chunk(
            q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], state
        )
    return out.transpose(0, 1), state


def delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens per head (`[heads, C, dim]`; g, beta `[heads, C]`) from the state before
    them: their outputs, and the state after them."""
    decay = g.cumsum(dim=-1)  # log of the fading from the chunk's start to token i
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    # How much of token j's write survives at token i (j <= i), 0 for later tokens.
    pairwise = (decay[:, :, None] - decay[:, None, :]).masked_fill(~causal, -torch.inf).exp()
    k_beta = k * beta[..., None]
    # Token i's correction subtracts what tokens j < i already wrote under k_i: a
    # unit-lower-triangular system (its diagonal is taken as ones), solved for all i at once.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    corrections = torch.linalg.solve_triangular(
        system, torch.cat([v * beta[..., None], k_beta * decay.exp()[..., None]], dim=-1),
        upper=False, unitriangular=True,
    )
    # What each token writes with an empty state, and how much of the carried one it erases.
    writes, erased = corrections.split([v.shape[-1], k.shape[-1]], dim=-1)
    values = writes - erased @ state
    out = (q * decay.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * pairwise) @ values
    last = decay[:, -1:]
    surviving_keys = k * (last - decay).exp()[..., None]
    state = state * last.exp()[..., None] + surviving_keys.transpose(-1, -2) @ values
    return out, state


# ------------------------------------------------------------------------- flashinfer
def flashinfer_serves(hidden: torch.Tensor, k_dim: int, v_dim: int) -> bool:
    """Do flashinfer's Gated DeltaNet kernels run this layer? On a Hopper GPU (SM90, where
    both the chunked prefill and the K-major decode are built), in 16 bits, with heads of
    128. Elsewhere on a GPU the torch path runs, and a warning says why, once."""
    if not hidden.is_cuda:
        return False
    reason = None
    if importlib.util.find_spec("flashinfer") is None:
        reason = "flashinfer is not installed"
    elif hidden.dtype not in (torch.bfloat16, torch.float16):
        reason = f"its kernels take 16-bit inputs, not {hidden.dtype}"
    elif (k_dim, v_dim) != (128, 128):
        reason = f"its kernels take heads of 128, not k_dim {k_dim} and v_dim {v_dim}"
    elif torch.cuda.get_device_capability(hidden.device)[0] != 9:
        reason = "its decode kernel is built for Hopper (SM90) only"
    elif not has_flashinfer_kernels():
        reason = "this flashinfer has no Gated DeltaNet kernels (gdn_prefill, gdn_decode)"
    if reason is not None:
        warn_once(f"Gated DeltaNet runs in torch, not flashinfer: {reason}")
    return reason is None


@functools.cache
def warn_once(message: str) -> None:
    """Every layer asks; the log says it once."""
    logger.warning(message)


def has_flashinfer_kernels() -> bool:
    try:
        from flashinfer.gdn_decode import gated_delta_rule_decode  # noqa: F401
        from flashinfer.gdn_prefill import chunk_gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def flashinfer_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
) -> torch.Tensor:
    """`recurrent_delta_rule_step` as one kernel that also normalises q and k and computes
    the gates from the raw a and b. Its state layout is ours, K-major `[B, v_heads, k_dim,
    v_dim]`, float32, updated in place; key heads are shared by value heads inside it."""
    from flashinfer.gdn_decode import gated_delta_rule_decode

    one_token = [t[:, None].contiguous() for t in (q, k, v, a, b)]  # [B, 1, ...]
    out, _ = gated_delta_rule_decode(
        *one_token[:3], state, A_log.float(), one_token[3], dt_bias.float(), one_token[4],
        scale=q.shape[-1] ** -0.5, use_qk_l2norm=True,
    )
    return out[:, 0]


def flashinfer_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_delta_rule` for one request as flashinfer's kernel: it takes the fading in
    linear space (exp(g)) and the state K-last (`[v_heads, v_dim, k_dim]`), and q and k
    normalised here (not every build of it honours its own normalisation flag)."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    q, k = (l2_normalize(t.float()).to(v.dtype).contiguous() for t in (q, k))
    cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int64, device=q.device)
    out, final = chunk_gated_delta_rule(
        q, k, v.contiguous(), g=g.exp().contiguous(), beta=beta.contiguous(),
        scale=q.shape[-1] ** -0.5, initial_state=state.transpose(-1, -2).contiguous()[None],
        output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=False,
    )
    return out, final[0].transpose(-1, -2)
