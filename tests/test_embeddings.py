"""Embeddings: the last prompt token's final hidden state, through the same engine.

transformers' last hidden state (after the final norm) is the oracle, whatever path the
request takes: chunked prefill, a prefix-cache hit, a batch shared with generation, or a
step shaped like a padded decode.
"""

from __future__ import annotations

import pytest
import torch
from server_helpers import MODEL, assert_error_shape, call, client_for, running_server
from transformers import AutoModelForCausalLM

from nanoqwen import LLM, PoolingParams, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", page_size=8, num_pages=128, max_num_seqs=4)
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog and then it sleeps", "😀"]


def reference(model_dir: str, token_ids: list[int], normalize: bool = True) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1]
    vector = hidden[0, -1]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def test_embeddings_match_transformers(model_dir: str) -> None:
    # Chunks of 8 tokens, and decode-shaped steps padded to buckets for one-token prompts.
    llm = LLM(model_dir, chunk_size=8, decode_buckets=[1, 2, 4], **ENGINE)
    outputs = llm.embed(TEXTS)
    for output in outputs:
        assert output.finish_reason == "stop" and output.token_ids == [] and output.text == ""
        expected = reference(model_dir, output.prompt_token_ids)
        assert torch.tensor(output.embedding) == pytest.approx(expected, abs=1e-5)
        assert sum(x * x for x in output.embedding) == pytest.approx(1.0, abs=1e-5)
    [raw] = llm.embed(TEXTS[1], PoolingParams(normalize=False))
    expected = reference(model_dir, raw.prompt_token_ids, normalize=False)
    assert torch.tensor(raw.embedding) == pytest.approx(expected, abs=1e-4)
    # The prompt's pages are cached now: the same vector from a shorter computation.
    [again] = llm.embed(TEXTS[1])
    assert again.num_cached_tokens > 0
    assert again.embedding == pytest.approx(outputs[1].embedding, abs=1e-5)
    assert llm.stats()["kv_cache"]["pages_used"] == 0
    [one_token] = llm.embed([[5]])
    assert torch.tensor(one_token.embedding) == pytest.approx(reference(model_dir, [5]), abs=1e-5)


def test_embeddings_share_batches_with_generation(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, chunk_size=16, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(TEXTS[1], params)[0]
    engine = llm.engine
    generating = engine.add_request(TEXTS[1], params)
    embedding = engine.add_request(TEXTS[0], PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert finished[generating].token_ids == alone.token_ids
    alone_vector = llm.embed(TEXTS[0])[0].embedding
    assert finished[embedding].embedding == pytest.approx(alone_vector, abs=1e-5)
    # no token for embeddings
    assert engine.stats()["tokens"]["generated"] == 2 * len(alone.token_ids)


def test_embedding_requests_are_not_speculated(qwen3_dir: str) -> None:
    # A prompt that repeats itself: the n-gram proposer would find drafts for its end.
    repetitive = [7, 8, 9, 10] * 6
    expected = LLM(qwen3_dir, **ENGINE).embed([repetitive])[0].embedding
    speculative = LLM(qwen3_dir, speculative="ngram", **ENGINE)
    got = speculative.embed([repetitive])[0].embedding
    assert got == pytest.approx(expected, abs=1e-5)
    assert speculative.stats()["speculative"]["proposed_tokens"] == 0


def test_embeddings_route(qwen3_dir: str) -> None:
    offline = LLM(qwen3_dir, **ENGINE).embed(TEXTS)
    with running_server(qwen3_dir) as server, client_for(server) as client:
        by_default = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
        as_floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        for response in (by_default, as_floats):
            assert [item.index for item in response.data] == [0, 1, 2]
            for item, expected in zip(response.data, offline):
                assert item.embedding == pytest.approx(expected.embedding, abs=1e-6)
            assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)
        by_ids = client.embeddings.create(model=MODEL, input=offline[1].prompt_token_ids,
                                          encoding_format="float")
        assert by_ids.data[0].embedding == pytest.approx(offline[1].embedding, abs=1e-6)
        for extra, param in (({"dimensions": 8}, "dimensions"),
                             ({"encoding_format": "int8"}, "encoding_format"),
                             ({"input": ""}, "input"), ({"input": 3}, "input")):
            status, _, body = call(server, "POST", "/v1/embeddings", {"input": "hi", **extra})
            assert status == 400 and body["error"]["param"] == param, body
            assert_error_shape(body)
