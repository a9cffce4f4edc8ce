"""The core engine against transformers: same logits, same greedy tokens, any batch."""

import json
from pathlib import Path

import pytest
import torch
from oracle import (
    assert_greedy_matches,
    check_page_accounting,
    greedy,
    hf_last_logits,
    random_prompts,
    run_to_completion,
)

from nanoqwen import LLM, LLMEngine, SamplingParams, StepError

MIXED_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 129, 200, 300]


@pytest.fixture(scope="module")
def llms(qwen2_dir: str, qwen3_dir: str) -> dict[str, LLM]:
    return {d: LLM(d, device="cpu") for d in (qwen2_dir, qwen3_dir)}


@pytest.fixture
def llm(llms: dict[str, LLM], model_dir: str) -> LLM:
    return llms[model_dir]


def vocab(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


@pytest.mark.slow
@pytest.mark.native_kernels
def test_greedy_batch_matches_transformers(llm: LLM, model_dir: str) -> None:
    prompts = random_prompts(vocab(llm), MIXED_LENGTHS, seed=1)
    outputs = llm.generate(prompts, greedy(32))
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        assert_greedy_matches(model_dir, prompt, output.token_ids, llm.engine.config.dtype)
        assert output.finish_reason == "length"


@pytest.mark.native_kernels
def test_reference_attention_engine_matches_transformers(model_dir: str) -> None:
    """The textbook attention backend, end to end: the oracle of the fast one is itself right."""
    llm = LLM(model_dir, device="cpu", attention_backend="reference", chunk_size=64)
    assert type(llm.engine.runner.backend).__name__ == "ReferenceBackend"
    prompts = random_prompts(vocab(llm), [1, 17, 150], seed=11)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(12))):
        assert_greedy_matches(model_dir, prompt, output.token_ids, llm.engine.config.dtype)


def test_a_failing_step_names_its_requests_and_leaves_them_in_the_engine(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    ids = [engine.add_request(prompt, greedy(4)) for prompt in random_prompts(vocab(llm), [5, 9])]

    def broken_forward(inputs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    with pytest.raises(StepError) as raised:
        engine.step()
    assert sorted(raised.value.request_ids) == sorted(ids)
    assert "device fell over" in str(raised.value.__cause__)
    assert sorted(engine.requests) == sorted(ids)
    monkeypatch.undo()
    for request_id in ids:
        assert engine.abort(request_id).finish_reason == "abort"
    check_page_accounting(engine)
    assert engine.stats()["kv_cache"]["pages_used"] == 0


def test_first_step_logits_match_transformers(llm: LLM, model_dir: str) -> None:
    engine = llm.engine
    prompts = random_prompts(vocab(llm), [1, 9, 40, 250], seed=2)
    for prompt in prompts:
        engine.add_request(prompt, greedy(1))
    batch = engine.scheduler.schedule().rows
    inputs = engine.runner.prepare(batch)
    logits = engine.runner.forward(inputs)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], hf_last_logits(model_dir, prompt), atol=1e-4, rtol=0)
    engine.scheduler.advance(batch)
    for request in list(engine.requests):
        engine.abort(request)
    check_page_accounting(engine)


@pytest.mark.slow
def test_output_is_independent_of_batch(llm: LLM) -> None:
    probe = random_prompts(vocab(llm), [45], seed=3)[0]
    others = random_prompts(vocab(llm), [5 + 9 * i for i in range(31)], seed=4)
    alone = llm.generate([probe], greedy(24))[0].token_ids
    in_batch = llm.generate(others[:15] + [probe] + others[15:], greedy(24))[15].token_ids
    assert in_batch == alone

    # Joining a batch that is already decoding.
    engine = llm.engine
    for prompt in others[:8]:
        engine.add_request(prompt, greedy(40))
    for _ in range(5):
        engine.step()
    probe_id = engine.add_request(probe, greedy(24))
    final = run_to_completion(engine)
    assert final[probe_id].token_ids == alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    prompts = random_prompts(vocab(llm), [3, 30], seed=5)
    expected = [o.token_ids for o in llm.generate(prompts, greedy(12))]
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, top1)] == expected


def test_seed_gives_same_tokens_whatever_the_batch(llm: LLM) -> None:
    probe = random_prompts(vocab(llm), [20], seed=6)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([probe], seeded)[0].token_ids
    companions = random_prompts(vocab(llm), [4, 50, 11], seed=7)
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(companions + [probe], [noisy, noisy, noisy, seeded])
    assert outputs[-1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate([probe], other_seed)[0].token_ids != alone


def test_generate_accepts_text_and_keeps_prompt_order(llm: LLM) -> None:
    texts = ["hello world", "the quick brown fox", "café 你好 😀"]
    outputs = llm.generate(texts, greedy(5))
    for text, output in zip(texts, outputs):
        assert output.prompt_token_ids == llm.tokenizer.encode(text)
        assert output.text == llm.tokenizer.decode(output.token_ids)
        assert len(output.token_ids) == 5


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "hello"}]
    output = llm.chat([conversation], greedy(4))[0]
    assert output.prompt_token_ids == llm.tokenizer.apply_chat_template(conversation)
    assert llm.chat(conversation, greedy(4))[0].token_ids == output.token_ids


def test_eos_list_is_honoured(
    llm: LLM, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request stops at the first token of its eos set, unless ignore_eos."""
    config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    assert llm.tokenizer.eos_token_ids == frozenset(config["eos_token_id"])

    prompt = random_prompts(vocab(llm), [12], seed=8)[0]
    free_run = llm.generate([prompt], greedy(20))[0].token_ids
    # The random model never picks the real eos ids; declare two of its own picks eos instead.
    eos_list = [free_run[9], free_run[4]]
    monkeypatch.setattr(llm.tokenizer, "eos_token_ids", frozenset(eos_list))
    first_eos = min(free_run.index(token) for token in eos_list)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.token_ids == free_run[: first_eos + 1] and out.finish_reason == "stop"
    ignoring = llm.generate([prompt], greedy(20))[0]
    assert ignoring.token_ids == free_run and ignoring.finish_reason == "length"


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    prompt = random_prompts(vocab(llm), [10], seed=9)[0]
    free = llm.generate([prompt], greedy(24))[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"

    # A stop string made of the end of one token's text and the start of the next one's.
    pieces = [llm.tokenizer.decode([t]) for t in free.token_ids]
    boundary = next(i for i in range(3, 20) if pieces[i] and pieces[i + 1])
    stop = pieces[boundary][-1] + pieces[boundary + 1][:1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=stop))[0]
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert free.text.startswith(out.text) and free.text[len(out.text) :].startswith(stop)


def test_stream_never_sends_half_a_character(llm: LLM) -> None:
    """Every streamed prefix is final: a half-sent character would later change."""
    prompt = llm.tokenizer.encode("你好 😀 café")
    streamed, outputs = "", []
    for output in llm.stream(prompt, greedy(60)):
        streamed += output.delta_text
        outputs.append((streamed, output))
    final = outputs[-1][1]
    assert final.finished
    full_text = llm.tokenizer.decode(final.token_ids)
    assert streamed == final.text == full_text
    multi_byte_tokens = 0
    for text_so_far, output in outputs:
        assert full_text.startswith(text_so_far)
        decoded = llm.tokenizer.decode(output.token_ids)
        multi_byte_tokens += decoded.endswith("\ufffd")
    assert multi_byte_tokens > 0, "the stream never ended inside a character; test is vacuous"


def test_closing_a_stream_aborts_and_frees_pages(llm: LLM) -> None:
    stream = llm.stream(random_prompts(vocab(llm), [40], seed=10)[0], greedy(100))
    next(stream)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_cache"]["pages_used"] == 0
    assert llm.stats()["requests"]["finished"]["abort"] >= 1


def test_a_stream_can_be_closed_while_its_prompt_is_prefilled(model_dir: str) -> None:
    llm = LLM(model_dir, device="cpu", chunk_size=16)
    prompt = random_prompts(vocab(llm), [100], seed=11)[0]
    stream = llm.stream(prompt, greedy(10))
    prefilling = [next(stream) for _ in range(3)]
    assert all(not output.delta_token_ids and not output.finished for output in prefilling)
    assert llm.engine.scheduler.running[0].num_computed_tokens == 48
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_cache"]["pages_used"] == 0

    # Left to run, the stream yields once per step: 7 chunks (the last one samples the
    # first token), then 9 decodes.
    llm.reset_prefix_cache()
    outputs = list(llm.stream(prompt, greedy(10)))
    assert [len(output.delta_token_ids) for output in outputs] == [0] * 6 + [1] * 10
    assert outputs[-1].token_ids == llm.generate([prompt], greedy(10))[0].token_ids


def test_max_model_len_finishes_with_length(model_dir: str) -> None:
    llm = LLM(model_dir, device="cpu", max_model_len=24)
    out = llm.generate([list(range(3, 23))], greedy(100))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 24
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=1.5), "min_p"),
    ],
)
def test_invalid_sampling_params_raise(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_bad_prompts_raise_before_anything_is_queued(llm: LLM) -> None:
    engine = llm.engine
    good = engine.add_request([5, 6, 7], greedy(3))
    too_long = [7] * engine.max_model_len
    for bad, message in [
        ("", "empty"),
        ([], "empty"),
        (too_long, "max_model_len"),
        ([vocab(llm) + 5], "token ids"),
        (3.5, "prompt must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(bad, greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], greedy(3), request_id=good)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], greedy(3))
    assert list(engine.requests) == [good]
    assert run_to_completion(engine)[good].finish_reason == "length"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(dtype="float8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(page_size=0), "page_size"),
    ],
)
def test_bad_engine_options_raise(qwen3_dir: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_dir, **{"device": "cpu", **options})


def test_cuda_without_cuda_is_a_clear_error(qwen3_dir: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(qwen3_dir, device="cuda")


def test_stats_report_the_kv_cache_size(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, device="cpu", num_pages=40, page_size=8)
    config = llm.engine.model_config
    stats = llm.stats()
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # K+V, float32
    assert stats["kv_cache"]["bytes"] == 40 * 8 * per_token
    assert stats["kv_cache"]["pages_total"] == 39  # one page is the scratch page


def test_memory_stats_add_up(qwen3_dir: str) -> None:
    """The KV bytes by page state sum to the usable pages' bytes, the weights are the
    parameters' bytes, and the process holds at least both."""
    engine = LLMEngine(qwen3_dir, device="cpu", num_pages=40, page_size=8)
    finished, running = random_prompts(engine.model_config.vocab_size, [20, 20], seed=5)
    engine.add_request(finished, greedy(4))
    run_to_completion(engine)  # its whole pages stay in the prefix cache
    engine.add_request(running, greedy(50))
    engine.step()  # its prefill holds pages
    stats = engine.stats()
    kv, memory = stats["kv_cache"], stats["memory"]
    config = engine.model_config  # K and V of 8 tokens, float32
    page_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * 8
    assert kv["pages_used"] > 0 and kv["pages_cached"] > 0
    for state in ("used", "cached", "free"):
        assert memory[f"kv_{state}_bytes"] == kv[f"pages_{state}"] * page_bytes
    parts = (memory[f"kv_{state}_bytes"] for state in ("used", "cached", "free"))
    assert sum(parts) == memory["kv_total_bytes"] == 39 * page_bytes
    weights = engine.runner.model.parameters()  # a tied embedding once
    assert memory["weight_bytes"] == sum(p.numel() * p.element_size() for p in weights)
    assert memory["resident_bytes"] > memory["weight_bytes"] + kv["bytes"]
    assert not any(key.startswith("cuda") for key in memory)  # on a GPU only


def test_a_failing_step_still_hands_over_what_it_finished(
    qwen2_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the scheduler finished for lack of memory in the same step as a failure
    must not vanish: its final output travels with the StepError."""
    engine = LLMEngine(qwen2_dir, device="cpu", num_pages=4, page_size=4)  # 12 token slots
    starved = engine.add_request(list(range(3, 12)), greedy(100))
    while engine.requests[starved].num_tokens <= 12:  # one more token than its pages hold
        engine.step()
    newcomer = engine.add_request([5, 6], greedy(3))  # admitted once `starved` gives up

    def broken_forward(inputs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    with pytest.raises(StepError) as raised:
        engine.step()
    [final] = raised.value.finished
    assert (final.request_id, final.finished, final.finish_reason) == (starved, True, "length")
    assert raised.value.request_ids == [newcomer]
    monkeypatch.undo()
    engine.abort(newcomer)
    check_page_accounting(engine)


@pytest.mark.parametrize("given", [None, "0"])
def test_importing_nanoqwen_lets_openmp_threads_spin_briefly(given: str | None) -> None:
    """Set before torch loads OpenMP (which reads it once), unless the environment chose;
    what the import set is on record."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    code = ("import nanoqwen, os, sys; print(os.environ['GOMP_SPINCOUNT'], "
            "sorted(nanoqwen.SET_ON_IMPORT), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    expected = "100000 ['GOMP_SPINCOUNT'] True" if given is None else f"{given} [] True"
    assert out.stdout.strip() == expected, out.stderr
