"""Checking a bfloat16 engine against transformers in bfloat16: what "the same" can mean.

bfloat16 keeps 8 significant bits, so a logit of magnitude `s` is only known to within
`eps * s` (`eps` = 2**-7) each time it is rounded, and two correct implementations that
round in different places drift apart by a few such steps over a forward pass (on the
tiny test models transformers' own bfloat16 logits differ from its float32 ones by up to
2.5 `eps * s`). So:

* **logits** must agree within `tie_margin(logits)` = 4 `eps * s`, with `s` the largest
  logit's magnitude: a few roundings, where a real bug (a missing bias or norm) moves
  logits by whole units;
* **greedy tokens** must be identical, except that where transformers' own logits hold a
  near-tie (the engine's token within `tie_margin` of transformers' best), either choice
  is right; the sequences then continue from different tokens, so comparison stops there.
"""

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

BF16_EPS = torch.finfo(torch.bfloat16).eps
ROUNDINGS = 4


def tie_margin(logits: torch.Tensor) -> float:
    return ROUNDINGS * BF16_EPS * logits.float().abs().max().item()


@lru_cache(maxsize=4)
def hf_bf16(model_dir: str, device: str = "cpu") -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()


@torch.no_grad()
def hf_greedy_with_logits(
    model_dir: str, prompt: list[int], max_new_tokens: int, device: str = "cpu"
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation in bfloat16, and its logits at every step."""
    ids = torch.tensor([prompt], device=device)
    out = hf_bf16(model_dir, device).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float().cpu() for step in out.logits]


def assert_greedy_agrees(
    engine_tokens: list[int], hf_tokens: list[int], hf_logits: list[torch.Tensor]
) -> int:
    """The engine's greedy tokens equal transformers' up to the first near-tie where they
    part (see the module docstring); returns how many tokens were compared equal."""
    for step, (ours, theirs) in enumerate(zip(engine_tokens, hf_tokens, strict=True)):
        if ours != theirs:
            logits = hf_logits[step]
            behind = (logits[theirs] - logits[ours]).item()
            assert behind <= tie_margin(logits), (
                f"token {step}: the engine chose {ours}, {behind:.4f} below transformers' "
                f"{theirs}, beyond the bf16 margin {tie_margin(logits):.4f}"
            )
            return step
    return len(hf_tokens)
