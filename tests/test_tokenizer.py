"""Tests for the tiny checkpoints and for nanoqwen.tokenizer (chat template, EOS ids,
UTF-8-safe streaming, stop strings)."""

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nanoqwen import SamplingParams
from nanoqwen.text.generation_config import FALLBACK_SAMPLING
from nanoqwen.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tools.checkpoints import (
    END_OF_TEXT,
    IM_END,
    IM_START,
    build_qwen3,
    build_tokenizer,
)

MULTILINGUAL_TEXT = "你好世界，今天天气很好 😀🎉 café naïve Łódź 丐丑 done"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time as an engine would; the last delta is the flush."""
    deltas = []
    for token_id in token_ids:
        deltas.append(detokenizer.add_token(token_id))
        if detokenizer.stopped:
            return deltas
    deltas.append(detokenizer.flush())
    return deltas


def cut_at_first_stop(text: str, stop: list[str]) -> str:
    """Reference: the shortest prefix of `text` that contains a stop string, without it."""
    for end in range(len(text) + 1):
        matched = [s for s in stop if s and text[:end].endswith(s)]
        if matched:
            return text[: end - max(map(len, matched))]
    return text


def token_ids_of(tokenizer: Tokenizer, token: str) -> int:
    (token_id,) = tokenizer.encode(token)
    return token_id


# --- the fixture checkpoints ---------------------------------------------------------------


def test_qwen2_fixture_has_qkv_bias_and_untied_head(qwen2_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    attention = model.model.layers[0].self_attn
    assert model.config.model_type == "qwen2"
    assert attention.q_proj.bias is not None and attention.q_proj.bias.abs().sum() > 0
    assert not model.config.tie_word_embeddings
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_qwen3_fixture_has_qk_norm_tied_head_and_own_head_dim(qwen3_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    config = model.config
    attention = model.model.layers[0].self_attn
    assert config.model_type == "qwen3"
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    assert attention.q_proj.out_features == config.num_attention_heads * config.head_dim
    # RMSNorm weights start at one in transformers; the fixture must randomise them or an
    # engine that skipped them would go unnoticed.
    assert not torch.allclose(attention.q_norm.weight, torch.ones_like(attention.q_norm.weight))
    assert attention.k_norm.weight.shape == (config.head_dim,)
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # A tied checkpoint stores the embedding only.
    stored = load_file(Path(qwen3_dir) / "model.safetensors")
    assert "lm_head.weight" not in stored


def test_fixture_vocab_matches_tokenizer(model_dir: str, tokenizer: Tokenizer) -> None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert (Path(model_dir) / "model.safetensors").stat().st_size < 4 * 2**20


def test_fixture_building_is_deterministic(qwen3_dir: str, tmp_path: Path) -> None:
    rebuilt = build_qwen3(tmp_path)
    original_vocab = (Path(qwen3_dir) / "tokenizer.json").read_text()
    assert (tmp_path / "tokenizer.json").read_text() == original_vocab
    original_weights = load_file(Path(qwen3_dir) / "model.safetensors")
    rebuilt_weights = load_file(Path(rebuilt) / "model.safetensors")
    assert original_weights.keys() == rebuilt_weights.keys()
    assert all(torch.equal(original_weights[k], rebuilt_weights[k]) for k in original_weights)


def test_multibyte_characters_are_split_across_tokens(tokenizer: Tokenizer) -> None:
    """Precondition of the streaming tests: some tokens hold only part of a character."""
    token_ids = tokenizer.encode(MULTILINGUAL_TEXT)
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in token_ids)
    assert tokenizer.decode(token_ids) == MULTILINGUAL_TEXT


# --- Tokenizer -------------------------------------------------------------------------------


def test_encode_adds_no_special_tokens(tokenizer: Tokenizer) -> None:
    special_ids = {token_ids_of(tokenizer, t) for t in (END_OF_TEXT, IM_START, IM_END)}
    assert len(special_ids) == 3
    assert not special_ids & set(tokenizer.encode("hello world"))


def test_decode_skips_special_tokens_unless_asked(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("hi") + [token_ids_of(tokenizer, IM_END)]
    assert tokenizer.decode(token_ids) == "hi"
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == "hi" + IM_END


def test_chat_template_is_chatml_with_generation_prompt(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好 😀"},
    ]
    token_ids = tokenizer.apply_chat_template(messages)
    assert all(isinstance(token_id, int) for token_id in token_ids)
    expected = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    expected += f"{IM_START}assistant\n"
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == expected
    # The markers are single special tokens, not spelled out in bytes.
    assert token_ids.count(token_ids_of(tokenizer, IM_START)) == 3


def test_enable_thinking_false_prefills_an_empty_think_block(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    default = tokenizer.decode(tokenizer.apply_chat_template(messages))
    thinking = tokenizer.decode(tokenizer.apply_chat_template(messages, enable_thinking=True))
    direct = tokenizer.decode(tokenizer.apply_chat_template(messages, enable_thinking=False))
    assert default == thinking
    assert "<think>" not in default
    assert direct == default + "<think>\n\n</think>\n\n"


def test_eos_token_ids_come_from_generation_config(model_dir: str, tokenizer: Tokenizer) -> None:
    generation_config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    assert isinstance(generation_config["eos_token_id"], list)
    assert Tokenizer(model_dir).eos_token_ids == frozenset(generation_config["eos_token_id"])
    assert token_ids_of(tokenizer, END_OF_TEXT) in Tokenizer(model_dir).eos_token_ids


def test_eos_token_ids_fall_back_to_the_tokenizer(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)  # a directory without generation_config.json
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.eos_token_ids == frozenset({token_ids_of(tokenizer, IM_END)})


@pytest.mark.parametrize(
    ("published", "expected"),
    [
        ({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
         {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}),
        ({"do_sample": True, "top_p": 0.9}, {"top_p": 0.9}),
        ({"do_sample": False, "temperature": 0.7}, {"temperature": 0.0}),
        ({}, FALLBACK_SAMPLING),
    ],
)
def test_sampling_defaults_are_what_generation_config_publishes(
    tmp_path: Path, published: dict, expected: dict
) -> None:
    build_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, **published}))
    defaults = Tokenizer(tmp_path).sampling_defaults
    assert defaults == expected
    SamplingParams(**defaults)  # every default is a valid setting


def test_sampling_defaults_without_generation_config(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    assert Tokenizer(tmp_path).sampling_defaults == FALLBACK_SAMPLING


# --- IncrementalDetokenizer ------------------------------------------------------------------


def test_streaming_multibyte_text_never_emits_half_a_character(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "say hi"}])
    output_ids = tokenizer.encode(MULTILINGUAL_TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])
    deltas = stream(detokenizer, output_ids)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(output_ids) == MULTILINGUAL_TEXT
    assert not detokenizer.stopped


def test_special_tokens_are_not_streamed(tokenizer: Tokenizer) -> None:
    output_ids = tokenizer.encode("ok 好") + [token_ids_of(tokenizer, IM_END)]
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[])
    assert "".join(stream(detokenizer, output_ids)) == "ok 好"


def test_stop_string_spanning_tokens_is_cut_before_it(tokenizer: Tokenizer) -> None:
    stop = "\n\nUser:"
    before, after = "The answer is 42 😀.", " and more text"
    output_ids = tokenizer.encode(before + stop + after)
    assert len(tokenizer.encode(stop)) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    deltas = []
    for token_id in output_ids:
        deltas.append(detokenizer.add_token(token_id))
        # The stop string must not reach the client, not even while it is incomplete.
        assert not "".join(deltas).endswith("\n\n")
        if detokenizer.stopped:
            break
    assert detokenizer.stopped and detokenizer.stop_reason == stop
    assert "".join(deltas) == detokenizer.text == before
    assert detokenizer.add_token(output_ids[-1]) == "" and detokenizer.flush() == ""


def test_stop_string_made_of_split_characters(tokenizer: Tokenizer) -> None:
    output_ids = tokenizer.encode("你好世界再见")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["世界"])
    assert "".join(stream(detokenizer, output_ids)) == "你好"
    assert detokenizer.stop_reason == "世界"


def test_stop_string_that_never_appears_leaves_text_intact(tokenizer: Tokenizer) -> None:
    output_ids = tokenizer.encode(MULTILINGUAL_TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["never there", "好很"])
    assert "".join(stream(detokenizer, output_ids)) == MULTILINGUAL_TEXT
    assert not detokenizer.stopped and detokenizer.stop_reason is None


def test_partial_stop_string_at_the_end_is_released_by_flush(tokenizer: Tokenizer) -> None:
    held, stop = "wor", "world!"
    output_ids = tokenizer.encode("hello " + held)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    streamed = "".join(detokenizer.add_token(token_id) for token_id in output_ids)
    assert streamed == "hello "
    assert detokenizer.flush() == held
    assert detokenizer.text == "hello " + held and not detokenizer.stopped


def test_the_stop_string_completed_first_wins(tokenizer: Tokenizer) -> None:
    # "abcd" starts earlier, but "bc" is complete first, so generation would already stop there.
    output_ids = tokenizer.encode("xabcdy")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["abcd", "bc"])
    assert "".join(stream(detokenizer, output_ids)) == "xa"
    assert detokenizer.stop_reason == "bc"


def test_unfinished_character_at_the_end_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    complete_ids = tokenizer.encode("ab😀")
    output_ids = complete_ids[:-1]  # the emoji's last byte(s) never arrive
    truncated_text = tokenizer.decode(output_ids)
    assert truncated_text.endswith("\ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[])
    deltas = stream(detokenizer, output_ids)
    assert not any("\ufffd" in delta for delta in deltas[:-1])
    assert "".join(deltas) == truncated_text


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("😀")
    assert len(emoji_ids) > 1
    prompt_ids, output_ids = emoji_ids[:1], emoji_ids[1:] + tokenizer.encode(" ok")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])
    assert "".join(stream(detokenizer, output_ids)) == tokenizer.decode(output_ids)


class DecodeRecordingTokenizer(Tokenizer):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.longest_decode = 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest_decode = max(self.longest_decode, len(token_ids))
        return super().decode(token_ids, skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_output(tokenizer_dir: str) -> None:
    longest_decode_by_length = {}
    for repeats in (4, 32):
        recorder = DecodeRecordingTokenizer(tokenizer_dir)
        output_ids = recorder.encode(MULTILINGUAL_TEXT * repeats)
        stream(IncrementalDetokenizer(recorder, [], stop=["never there"]), output_ids)
        longest_decode_by_length[len(output_ids)] = recorder.longest_decode
    short, long = sorted(longest_decode_by_length)
    assert longest_decode_by_length[long] == longest_decode_by_length[short] < short


STREAM_ALPHABET = st.sampled_from([*"ab xyz\n.", "é", "ø", "你", "好", "世", "界", "丐", "😀", "🎉"])


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(STREAM_ALPHABET, max_size=40),
    stop_slices=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), max_size=3),
    extra_stop=st.lists(st.text(STREAM_ALPHABET, min_size=1, max_size=4), max_size=2),
)
def test_streaming_matches_reference_on_random_text(
    tokenizer: Tokenizer,
    text: str,
    stop_slices: list[tuple[int, int]],
    extra_stop: list[str],
) -> None:
    # Stop strings cut from the text itself are likely to match; random ones mostly are not.
    stop = [text[start : start + length] for start, length in stop_slices] + extra_stop
    output_ids = tokenizer.encode(text)
    expected = cut_at_first_stop(tokenizer.decode(output_ids), stop)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stop)
    deltas = stream(detokenizer, output_ids)
    assert "".join(deltas) == detokenizer.text == expected
    assert not any("\ufffd" in delta for delta in deltas)
    assert detokenizer.stopped == (expected != text)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streaming_matches_reference_on_random_token_ids(
    tokenizer: Tokenizer, data: st.DataObject
) -> None:
    """A random model emits arbitrary tokens, including stray UTF-8 bytes and special tokens:
    whatever decode() makes of them, the stream must agree."""
    token_id = st.integers(0, len(tokenizer) - 1)
    prompt_ids = data.draw(st.lists(token_id, max_size=8))
    output_ids = data.draw(st.lists(token_id, max_size=30))
    stop = data.draw(st.lists(st.text(STREAM_ALPHABET, min_size=1, max_size=3), max_size=2))
    expected = cut_at_first_stop(tokenizer.decode(output_ids), stop)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stop)
    released = ""
    for delta in stream(detokenizer, output_ids):
        released += delta
        assert expected.startswith(released)  # never retracts, never runs ahead
    assert released == detokenizer.text == expected
