"""The policies beyond fcfs and priority (earliest deadline, shortest prompt, fair turns
between users), the cap per user, and deadlines counted: who runs first, that each keeps a
bounded wait, that none changes an output token or loses a page, and the server's `deadline`
and `user` fields."""

import pytest
from cli_options import parse_engine_options
from oracle import check_page_accounting, greedy, random_prompts, run_to_completion
from server_helpers import (
    GREEDY,
    LONG_RUNNING,
    MESSAGES,
    call,
    open_stream,
    running_server,
    scrape,
    slow_down,
    wait_until,
)

from nanoqwen import LLM, LLMEngine
from nanoqwen.config import SCHEDULING_POLICIES, EngineConfig
from nanoqwen.scheduling.policies import (
    EarliestDeadline,
    FairShare,
    PerUserCap,
    ShortestPrompt,
    UserLimitExceeded,
    make_policy,
)
from nanoqwen.scheduling.request import Request, Status

VOCAB = 800


def finish_order(engine: LLMEngine) -> list[str]:
    """Step to the end, checking the page accounting; the ids in the order they finished."""
    order = []
    while engine.has_unfinished_requests():
        order += [output.request_id for output in engine.step() if output.finished]
        check_page_accounting(engine)
    return order


def one_seat(model: str, policy: str, **options: object) -> LLMEngine:
    return LLMEngine(model, device="cpu", max_num_seqs=1, scheduling_policy=policy, **options)


# --------------------------------------------------------------------------- the keys
def test_earliest_deadline_keys_are_due_times() -> None:
    policy = EarliestDeadline(default_deadline=30.0)
    early = Request("a", [1], greedy(1), due=100.0)
    late = Request("b", [1], greedy(1), due=200.0)
    assert policy.urgency(early, 5, 0) < policy.urgency(late, 0, 1)
    # One without a deadline is due `default_deadline` after it arrives (now).
    undated = policy.urgency(Request("c", [1], greedy(1)), 0, 2)
    assert undated[0] > policy.urgency(Request("d", [1], greedy(1), due=1.0), 0, 3)[0]


def test_shortest_prompt_levels_are_log_lengths() -> None:
    policy = ShortestPrompt(aging_steps=10, cache=None)
    keys = [policy.urgency(Request(f"r{n}", [1] * n, greedy(1)), 0, n) for n in (1, 2, 8, 64)]
    assert [key[0] for key in keys] == [0, 10, 30, 60]  # one level per doubling
    # A 64-token prompt arriving 30 steps earlier ranks with an 8-token one.
    assert policy.urgency(Request("x", [1] * 64, greedy(1)), 0, 9)[0] == \
        policy.urgency(Request("y", [1] * 8, greedy(1)), 30, 10)[0]


def test_fair_levels_count_the_users_unfinished_requests() -> None:
    policy = FairShare(aging_steps=100)
    first = [Request(f"a{i}", [1], greedy(1), user="a") for i in range(3)]
    levels = [policy.urgency(r, 0, i)[0] for i, r in enumerate(first)]
    assert levels == [0, 100, 200]
    assert policy.urgency(Request("b0", [1], greedy(1), user="b"), 0, 3)[0] == 0
    first[0].status = first[1].status = Status.FINISHED
    assert policy.urgency(Request("a3", [1], greedy(1), user="a"), 0, 4)[0] == 100


def test_sjf_counts_only_what_the_prefix_cache_does_not_hold(qwen2_dir: str) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", scheduling_policy="sjf", page_size=4)
    prompt = random_prompts(VOCAB, [33], seed=60)[0]
    engine.add_request(prompt, greedy(1))
    finish_order(engine)
    # 32 of its 33 tokens are cached now: it ranks as a 1-token prompt, ahead of a 3-token one.
    again = engine.add_request(prompt, greedy(1))
    short = engine.add_request(random_prompts(VOCAB, [3], seed=61)[0], greedy(1))
    assert engine.requests[again].urgency < engine.requests[short].urgency
    finish_order(engine)


# --------------------------------------------------------------------------- the order
def test_deadline_serves_queued_requests_by_deadline(qwen2_dir: str) -> None:
    engine = one_seat(qwen2_dir, "deadline")
    running = engine.add_request(random_prompts(VOCAB, [9], seed=62)[0], greedy(6))
    engine.step()
    prompts = random_prompts(VOCAB, [5, 6, 7, 8], seed=63)
    by_deadline = {d: engine.add_request(p, greedy(3), deadline=d)
                   for p, d in zip(prompts, [400, 100, 300, 200])}
    order = finish_order(engine)
    assert order == [running] + [by_deadline[d] for d in (100, 200, 300, 400)]
    requests = engine.stats()["requests"]
    assert (requests["deadlines_met"], requests["deadlines_missed"]) == (4, 0)


def test_sjf_serves_queued_requests_by_prompt_length(qwen2_dir: str) -> None:
    engine = one_seat(qwen2_dir, "sjf")
    # Shorter than any that come: none outranks it for its seat.
    running = engine.add_request(random_prompts(VOCAB, [3], seed=64)[0], greedy(6))
    engine.step()
    lengths = [30, 5, 17, 9, 60]
    by_length = {n: engine.add_request(p, greedy(3))
                 for n, p in zip(lengths, random_prompts(VOCAB, lengths, seed=65))}
    assert finish_order(engine) == [running] + [by_length[n] for n in sorted(lengths)]


def test_fair_alternates_between_users(qwen2_dir: str) -> None:
    """One user queues four requests before another queues two: they take turns."""
    engine = one_seat(qwen2_dir, "fair")
    prompts = iter(random_prompts(VOCAB, [6] * 6, seed=66))
    alice = [engine.add_request(next(prompts), greedy(3), user="alice") for _ in range(4)]
    bob = [engine.add_request(next(prompts), greedy(3), user="bob") for _ in range(2)]
    assert finish_order(engine) == [alice[0], bob[0], alice[1], bob[1], alice[2], alice[3]]


def test_a_fair_newcomer_takes_a_seat_from_a_wide_request(qwen2_dir: str) -> None:
    """Two seats, both held by one user's samples: another user's request is served at once,
    and the seat goes back when it is done."""
    engine = LLMEngine(qwen2_dir, device="cpu", max_num_seqs=2, scheduling_policy="fair")
    prompt, other = random_prompts(VOCAB, [8, 5], seed=67)
    wide = [engine.add_request(prompt, greedy(20), user="batch") for _ in range(4)]
    engine.step()
    newcomer = engine.add_request(other, greedy(2), user="chat")
    assert newcomer in {output.request_id for output in engine.step()}
    assert engine.stats()["requests"]["preemptions_by_cause"]["max_num_seqs"] == 1
    order = finish_order(engine)
    assert order.index(newcomer) < min(order.index(i) for i in wide)


def test_aging_bounds_the_wait_of_a_long_prompt_under_sjf(qwen2_dir: str) -> None:
    """A 64-token prompt (level 6) behind a stream of 2-token ones (level 1): with one level
    worth 2 steps, it ranks first once it has waited 10 steps more than a newcomer."""
    engine = one_seat(qwen2_dir, "sjf", priority_aging_steps=2)
    long_one = engine.add_request(random_prompts(VOCAB, [64], seed=68)[0], greedy(2))
    short = iter(random_prompts(VOCAB, [2] * 40, seed=69))
    finished: dict[str, int] = {}
    arrived_after: list[str] = []
    for step in range(40):
        request_id = engine.add_request(next(short), greedy(2))
        if step >= 10:
            arrived_after.append(request_id)
        finished.update({o.request_id: step for o in engine.step() if o.finished})
    assert long_one in finished
    assert all(finished.get(i, 99) >= finished[long_one] for i in arrived_after)
    finish_order(engine)


def test_a_request_without_a_deadline_is_due_after_the_default(qwen2_dir: str) -> None:
    engine = one_seat(qwen2_dir, "deadline", default_deadline=50)
    prompts = iter(random_prompts(VOCAB, [5] * 4, seed=70))
    running = engine.add_request(next(prompts), greedy(4), deadline=5)
    engine.step()
    later = engine.add_request(next(prompts), greedy(2), deadline=100)
    undated = engine.add_request(next(prompts), greedy(2))
    sooner = engine.add_request(next(prompts), greedy(2), deadline=10)
    assert finish_order(engine) == [running, sooner, undated, later]


OUTPUT_PROMPTS = random_prompts(VOCAB, [40, 33, 50, 21, 45, 38], seed=71)


@pytest.fixture(scope="module")
def unhurried_outputs(qwen2_dir: str) -> list[list[int]]:
    """An fcfs run with room for everyone: the outputs every policy must give."""
    return [o.token_ids for o in LLM(qwen2_dir, device="cpu").generate(OUTPUT_PROMPTS, greedy(16))]


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_no_policy_changes_an_output(
    qwen2_dir: str, unhurried_outputs: list[list[int]], policy: str
) -> None:
    """Greedy outputs under every policy, through preemptions for pages, equal an
    unhurried fcfs run's."""
    engine = LLMEngine(qwen2_dir, device="cpu", scheduling_policy=policy, num_pages=8, chunk_size=48,
                       max_num_seqs=4, priority_aging_steps=8)
    ids = [engine.add_request(prompt, greedy(16), deadline=deadline, user=user)
           for prompt, deadline, user in zip(OUTPUT_PROMPTS, [30, 10, 20, None, 5, 40],
                                              ["a", "b", "a", "a", None, "b"])]
    final = run_to_completion(engine)  # checking the page accounting after every step
    assert [final[i].token_ids for i in ids] == unhurried_outputs
    assert engine.stats()["requests"]["preemptions"] > 0


# --------------------------------------------------------------------------- deadlines
def test_deadlines_are_counted_met_or_missed(qwen2_dir: str) -> None:
    llm = LLM(qwen2_dir, device="cpu")  # counted under every policy, fcfs too
    prompts = random_prompts(VOCAB, [5, 6, 7], seed=72)
    llm.generate(prompts, greedy(2), deadline=[1e-9, 3600, None])
    # Aborted in time: it did not finish, so it met nothing (late, it would count as missed).
    llm.engine.abort(llm.engine.add_request(prompts[0], greedy(2), deadline=3600))
    requests = llm.stats()["requests"]
    assert (requests["deadlines_met"], requests["deadlines_missed"]) == (1, 1)


# --------------------------------------------------------------------------- the API
def test_bad_scheduling_fields_queue_nothing(qwen2_dir: str) -> None:
    llm = LLM(qwen2_dir, device="cpu", scheduling_policy="fair")
    for bad in (0, -1, float("inf"), float("nan"), True, "10"):
        with pytest.raises(ValueError, match="deadline must be a positive number"):
            llm.engine.add_request([5, 6], greedy(1), deadline=bad)
    with pytest.raises(ValueError, match="user must be a string"):
        llm.engine.add_request([5, 6], greedy(1), user=7)
    with pytest.raises(ValueError, match="deadline must be a list of 2"):
        llm.generate([[5], [6]], greedy(1), deadline=[1.0])
    with pytest.raises(ValueError, match="user must be a list of 2"):
        llm.generate([[5], [6]], greedy(1), user="alice")
    with pytest.raises(ValueError, match="user must be a string"):
        llm.generate([[5], [6]], greedy(1), user=["alice", 3])
    assert not llm.engine.has_unfinished_requests()


def test_settings_are_validated() -> None:
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match="default_deadline"):
            EngineConfig(model="m", device="cpu", default_deadline=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_seqs_per_user"):
            EngineConfig(model="m", device="cpu", max_seqs_per_user=bad)


def test_a_user_past_the_cap_is_refused(qwen2_dir: str) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", max_seqs_per_user=2)
    prompts = iter(random_prompts(VOCAB, [5] * 6, seed=73))
    first = [engine.add_request(next(prompts), greedy(2), user="alice") for _ in range(2)]
    with pytest.raises(UserLimitExceeded, match="user 'alice' already has 2 unfinished"):
        engine.add_request(next(prompts), greedy(2), user="alice")
    engine.add_request(next(prompts), greedy(2), user="bob")
    engine.add_request(next(prompts), greedy(2))  # the shared user counts as one user
    engine.abort(first[0])  # a finished request stops counting
    engine.add_request(next(prompts), greedy(2), user="alice")
    assert len(engine.requests) == 4
    # Offline, a batch larger than the cap is refused whole.
    llm = LLM(qwen2_dir, device="cpu", max_seqs_per_user=1, scheduling_policy="sjf")
    with pytest.raises(UserLimitExceeded, match="the shared user already has 1"):
        llm.generate([[5], [6]], greedy(1))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5], [6]], greedy(1), user=["a", "b"])) == 2


def test_the_engine_picks_the_policy_class(qwen2_dir: str) -> None:
    """fcfs is the core's own (test_architecture checks that a plain engine imports no
    policy module); the others come from policies.py, capped per user when asked."""
    assert type(LLMEngine(qwen2_dir, device="cpu").scheduler.policy).__module__.endswith("waiting_queue")
    assert isinstance(LLMEngine(qwen2_dir, device="cpu", scheduling_policy="fair").scheduler.policy, FairShare)
    for policy, kind in (("deadline", EarliestDeadline), ("sjf", ShortestPrompt),
                         ("fair", FairShare)):
        assert isinstance(make_policy(policy, 8, 60.0, None, None), kind)
        capped = make_policy(policy, 8, 60.0, None, 2)
        assert isinstance(capped, PerUserCap) and isinstance(capped.policy, kind)


def test_command_line_options() -> None:
    code, seen = parse_engine_options(["--scheduling-policy", "fair", "--max-seqs-per-user", "3",
                                       "--default-deadline", "2.5"])
    assert code == 0
    assert (seen["scheduling_policy"], seen["max_seqs_per_user"]) == ("fair", 3)
    assert seen["default_deadline"] == 2.5
    code, seen = parse_engine_options([])
    assert "max_seqs_per_user" not in seen and seen["scheduling_policy"] == "fcfs"
    for bad in (["--scheduling-policy", "edf"], ["--max-seqs-per-user", "0"],
                ["--default-deadline", "0"]):
        assert parse_engine_options(bad)[0] == 2


# --------------------------------------------------------------------------- the server
def test_server_takes_deadline_and_user_fields(qwen2_dir: str) -> None:
    completion = {"prompt": "the quick brown fox", **GREEDY}
    chat = {"messages": MESSAGES, **GREEDY}
    responses = {"input": "the quick brown fox", "max_output_tokens": 4}
    routes = {"/v1/completions": completion, "/v1/chat/completions": chat,
              "/v1/responses": responses}
    with running_server(qwen2_dir, scheduling_policy="deadline") as server:
        for path, body in routes.items():
            for field, bad in (("deadline", "1"), ("deadline", True), ("deadline", -1),
                               ("user", 5), ("user", ["a"])):
                status, _, error = call(server, "POST", path, {**body, field: bad})
                assert (status, error["error"]["param"]) == (400, field), error
            ok = {**body, "deadline": 600, "user": "alice"}
            assert call(server, "POST", path, ok)[0] == 200
        status, _, _ = call(server, "POST", "/v1/embeddings", {"input": "hi", "user": "bob"})
        assert status == 200
        call(server, "POST", "/v1/completions", {**completion, "deadline": 1e-9})
        samples = scrape(server)
        assert samples["nanoqwen_deadlines_missed_total"] == 1
        assert samples["nanoqwen_deadlines_met_total"] == 3


def test_server_caps_each_user(qwen2_dir: str) -> None:
    completion = {"prompt": "the quick brown fox", **GREEDY}
    with running_server(qwen2_dir, max_seqs_per_user=2) as server:
        slow_down(server)
        stream = open_stream(server, "/v1/completions",
                             {"prompt": "the quick", **LONG_RUNNING, "n": 2, "user": "alice"})
        wait_until(lambda: scrape(server)["nanoqwen_requests_running"] == 2)
        status, headers, error = call(server, "POST", "/v1/completions",
                                      {**completion, "user": "alice"})
        assert (status, error["error"]["code"]) == (429, "user_limit_exceeded"), error
        assert headers["Retry-After"] and "max_seqs_per_user=2" in error["error"]["message"]
        assert call(server, "POST", "/v1/completions", {**completion, "user": "bob"})[0] == 200
        # More samples than one user may have at all: never possible, so not a 429.
        status, _, error = call(server, "POST", "/v1/completions",
                                {**completion, "user": "carol", "n": 3})
        assert status == 400 and "2 per user" in error["error"]["message"]
        stream.close()


def test_server_users_default_to_the_api_key(qwen2_dir: str) -> None:
    key = {"Authorization": "Bearer sesame"}
    completion = {"prompt": "the quick brown fox", **GREEDY}
    with running_server(qwen2_dir, api_key="sesame", max_seqs_per_user=1) as server:
        slow_down(server)
        stream = open_stream(server, "/v1/completions", {"prompt": "the quick", **LONG_RUNNING},
                             headers=key)
        wait_until(lambda: server.engine_loop.call(lambda e: len(e.requests)) == 1)
        users = server.engine_loop.call(lambda e: [r.user for r in e.requests.values()])
        assert users[0].startswith("key-") and "sesame" not in users[0]
        status, _, error = call(server, "POST", "/v1/completions", completion, headers=key)
        assert status == 429, error
        status, _, _ = call(server, "POST", "/v1/completions", {**completion, "user": "bob"},
                            headers=key)
        assert status == 200
        stream.close()


def test_a_fair_server_serves_another_user_beside_a_wide_request(qwen2_dir: str) -> None:
    """The motivating case: one client's wide request holds every seat; another client's
    short request takes one at once instead of waiting for it to finish."""
    with running_server(qwen2_dir, scheduling_policy="fair", max_num_seqs=2) as server:
        slow_down(server)
        wide = open_stream(server, "/v1/completions",
                           {"prompt": "the quick", **LONG_RUNNING, "n": 3, "user": "batch"})
        wait_until(lambda: scrape(server)["nanoqwen_requests_running"] == 2)
        body = {"prompt": "the quick brown fox", **GREEDY, "user": "chat"}
        assert call(server, "POST", "/v1/completions", body)[0] == 200
        assert scrape(server)['nanoqwen_preemptions_by_cause_total{cause="max_num_seqs"}'] >= 1
        wide.close()
