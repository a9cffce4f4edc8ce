"""The model's shape: the only facts the decoder needs about a checkpoint.

`ModelConfig` is read from transformers' config object (`config.json`, or whatever a
checkpoint format keeps instead, turned into one by `weights/`). The decoder in `qwen.py`
is built from it alone; the transformers config rides along because its rotary-embedding
helpers and the newer layers read it. Besides the sizes it says what each decoder layer is
made of, as a pair of *layer kinds* (`qwen.py`'s `LAYER_KINDS`): a mixer, which lets tokens
see each other, and an MLP.

| architecture | mixers | MLPs | norms |
|---|---|---|---|
| Qwen2, Qwen3 | attention | mlp | rms |
| Qwen2-MoE, Qwen3-MoE | attention | sparse_moe (some layers may stay mlp) | rms |
| Qwen3-Next, Qwen3.5, Qwen3.5-MoE | linear_attention, every 4th gated_attention | mlp or sparse_moe | zero-centred |

Layers whose mixer keeps K/V (`kv_layers`) have pages in the KV cache; layers with a
recurrent state (`state_layers`) have a slot in the state pool (`memory/state_pool.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from nanoqwen.attention.base import AttentionShape

DENSE_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES + HYBRID_ARCHITECTURES
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn")
# Mixer kinds that keep K/V in the paged cache, and those with a recurrent state instead.
ATTENTION_KINDS = ("attention", "gated_attention")
STATE_KINDS = ("linear_attention",)


@dataclass(frozen=True)
class MoeShape:
    """A sparse model's experts, and which decoder layers have them."""

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int  # k, the experts each token is routed to
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the k routing weights to sum to 1
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen3-MoE)
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> MoeShape | None:
        """The shape a transformers config describes; None for a dense model."""
        hf = hf_config.get_text_config()  # Qwen3.5-MoE nests the decoder's config
        if not getattr(hf, "num_experts", 0):
            return None
        if hf.hidden_act != "silu":
            raise ValueError(f"unsupported expert activation {hf.hidden_act!r}: nanoqwen runs silu")
        return cls(
            hidden_size=hf.hidden_size,
            num_experts=hf.num_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size,
            # Qwen3.5-MoE has no such switches: it always renormalises, and every layer is sparse.
            norm_topk_prob=getattr(hf, "norm_topk_prob", True),
            shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0),
            decoder_sparse_step=getattr(hf, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        """Does decoder layer `layer` (from 0) have the sparse block, or a dense MLP of the
        config's `intermediate_size`? transformers' rule, the same for every Qwen MoE."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def check_splittable(self, ranks: int) -> None:
        """A ValueError unless `ranks` ranks can each keep an equal slice of every expert."""
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            size = getattr(self, name)
            if size % ranks:
                raise ValueError(f"{ranks} ranks must divide the model's {name}={size}")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape: the only facts `qwen.py` needs about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 adds a bias to the q, k and v projections
    qk_norm: bool  # Qwen3 RMS-normalises each head of q and k before RoPE
    max_position_embeddings: int
    rope_type: str
    hf_config: PretrainedConfig
    layer_kinds: tuple[tuple[str, str], ...]  # (mixer kind, MLP kind) of each layer
    norm_kind: str = "rms_norm"  # the decoder's norms (hybrid models: zero-centred)
    moe: MoeShape | None = None  # the experts of a sparse model

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache, in order."""
        return [i for i, (mixer, _) in enumerate(self.layer_kinds) if mixer in ATTENTION_KINDS]

    @property
    def state_layers(self) -> list[int]:
        """The layers that keep a recurrent state per request, in order."""
        return [i for i, (mixer, _) in enumerate(self.layer_kinds) if mixer in STATE_KINDS]

    def attention_shape(self) -> AttentionShape:
        """The whole model's K/V layers and heads (one rank of a split model holds fewer heads)."""
        return AttentionShape(len(self.kv_layers), self.num_heads, self.num_kv_heads, self.head_dim)

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> ModelConfig:
        architecture = (getattr(hf, "architectures", None) or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}: nanoqwen runs "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}: nanoqwen supports "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        is_qwen3 = architecture.startswith("Qwen3")
        moe = None if architecture in DENSE_ARCHITECTURES else MoeShape.from_hf(hf)
        hybrid = architecture in HYBRID_ARCHITECTURES
        return cls(
            architecture=architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            qkv_bias=bool(getattr(hf, "attention_bias", False)) if is_qwen3 else True,
            qk_norm=is_qwen3,
            max_position_embeddings=hf.max_position_embeddings,
            rope_type=rope_type,
            hf_config=hf,
            layer_kinds=tuple(zip(mixer_kinds(hf, hybrid), mlp_kinds(hf, moe))),
            norm_kind="zero_centered_rms_norm" if hybrid else "rms_norm",
            moe=moe,
        )


def mixer_kinds(hf: PretrainedConfig, hybrid: bool) -> list[str]:
    """Each layer's mixer: attention, or in a hybrid model the kind its `layer_types` says."""
    if not hybrid:
        return ["attention"] * hf.num_hidden_layers
    return ["linear_attention" if kind == "linear_attention" else "gated_attention"
            for kind in hf.layer_types]


def mlp_kinds(hf: PretrainedConfig, moe: MoeShape | None) -> list[str]:
    """Each layer's MLP: the experts where the model has them, a dense SwiGLU elsewhere."""
    return ["sparse_moe" if moe is not None and moe.is_sparse(layer) else "mlp"
            for layer in range(hf.num_hidden_layers)]


def resolve_max_model_len(wanted: int | None, model_config: ModelConfig) -> int:
    """The longest sequence served: the model's trained context unless told otherwise.

    Only a model with RoPE scaling may be asked to go past what it was trained on.
    """
    trained = model_config.max_position_embeddings
    if wanted is None:
        return trained
    if wanted > trained and model_config.rope_type == "default":
        raise ValueError(
            f"max_model_len={wanted} exceeds the model's max_position_embeddings={trained}"
        )
    return wanted
