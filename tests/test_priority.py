"""Priority scheduling: who runs first, who is preempted, that nothing starves, that none
of it changes a single output token or loses a page, and the server's `priority` field."""

import itertools
import random
from fractions import Fraction

import pytest
from cli_options import parse_engine_options
from hypothesis import given, settings
from hypothesis import strategies as st
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
from nanoqwen.config import EngineConfig
from nanoqwen.scheduling.request import Request, Status
from nanoqwen.scheduling.waiting_queue import PRIORITY_RANGE, Policy, WaitingQueue

VOCAB = 800


def urgency(policy: str, priority: int, arrival_step: int, arrival: int, aging_steps: int):
    """The key `policy` gives a request of `priority` arriving at `arrival_step`."""
    request = Request(f"r{arrival}", [1], greedy(1), priority=priority)
    return Policy(policy, aging_steps).urgency(request, arrival_step, arrival)


def finish_order(engine: LLMEngine) -> list[str]:
    """Step to the end; the request ids in the order they finished."""
    order = []
    while engine.has_unfinished_requests():
        order += [output.request_id for output in engine.step() if output.finished]
        check_page_accounting(engine)
    return order


# --------------------------------------------------------------------------- the key
@settings(max_examples=200)
@given(
    requests=st.lists(st.tuples(st.integers(-3, 6), st.integers(0, 50)), min_size=2, max_size=12),
    aging_steps=st.integers(1, 10),
    later=st.integers(0, 100),
)
def test_static_key_orders_like_aged_priority_at_every_step(
    requests: list[tuple[int, int]], aging_steps: int, later: int
) -> None:
    """The docstring's claim: sorting by the key computed at arrival is sorting by
    (priority - steps waited / aging_steps, arrival) at any later step."""
    now = max(step for _, step in requests) + later
    by_key = sorted(
        range(len(requests)),
        key=lambda i: urgency("priority", requests[i][0], requests[i][1], i, aging_steps),
    )
    by_aged_priority = sorted(
        range(len(requests)),
        key=lambda i: (requests[i][0] - Fraction(now - requests[i][1], aging_steps), i),
    )
    assert by_key == by_aged_priority


def test_key_without_aging_and_under_fcfs() -> None:
    assert urgency("priority", 3, 99, 7, 0) == (3, 7)
    # fcfs ignores aging and the arrival step (priorities are refused: all are 0).
    assert urgency("fcfs", 0, 99, 7, 16) == urgency("fcfs", 0, 0, 7, 16) == (0, 7)


@settings(max_examples=100)
@given(ops=st.lists(st.tuples(st.sampled_from(["push", "pop", "remove"]), st.integers(0, 30))))
def test_waiting_queue_pops_most_urgent_of_what_remains(ops: list[tuple[str, int]]) -> None:
    queue, model = WaitingQueue(), []
    for arrival, (op, value) in enumerate(ops):
        if op == "push":
            request = Request(f"r{arrival}", [1], greedy(1))
            request.urgency = (value, arrival)
            queue.push(request)
            model.append(request)
        elif op == "remove" and model:
            request = model.pop(value % len(model))
            queue.remove(request)
        elif op == "pop" and model:
            expected = min(model, key=lambda r: r.urgency)
            assert queue.peek() is expected
            assert queue.pop() is expected
            model.remove(expected)
        assert len(queue) == len(model)
    assert (queue.peek() is None) == (not model)


# --------------------------------------------------------------------------- the API
def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="m", device="cpu", scheduling_policy="lifo")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="priority_aging_steps"):
            EngineConfig(model="m", device="cpu", priority_aging_steps=bad)


def test_priority_is_checked_before_anything_is_queued(qwen2_dir: str) -> None:
    fcfs = LLM(qwen2_dir, device="cpu")
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        fcfs.engine.add_request([5, 6, 7], greedy(2), priority=1)
    assert fcfs.generate([[5, 6, 7]], greedy(2), priority=[0])[0].finish_reason == "length"
    llm = LLM(qwen2_dir, device="cpu", scheduling_policy="priority")
    for bad in (1.5, "1", None, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.engine.add_request([5, 6, 7], greedy(2), priority=bad)
    with pytest.raises(ValueError, match="priority must be a list of 3"):
        llm.generate([[5], [6], [7]], greedy(2), priority=[0, 1])
    with pytest.raises(ValueError, match="priority must be a list of 2"):
        llm.generate([[5], [6]], greedy(2), priority=1)
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate([[5], [6]], greedy(2), priority=[0, "high"])
    # Bounded, so that aging bounds every wait: a client cannot outrank everyone forever.
    for bad in (PRIORITY_RANGE[0] - 1, PRIORITY_RANGE[-1] + 1, -(2**40)):
        with pytest.raises(ValueError, match=r"priority must be in \[-10, 10\]"):
            llm.engine.add_request([5, 6, 7], greedy(2), priority=bad)
    assert not llm.engine.has_unfinished_requests()
    for edge in (PRIORITY_RANGE[0], PRIORITY_RANGE[-1]):
        assert llm.generate([[5, 6, 7]], greedy(2), priority=[edge])[0].finish_reason == "length"


def test_stream_and_chat_take_a_priority(qwen2_dir: str) -> None:
    llm = LLM(qwen2_dir, device="cpu", scheduling_policy="priority")
    prompt = random_prompts(VOCAB, [9], seed=40)[0]
    stream = llm.stream(prompt, greedy(4), priority=-2)
    first = next(stream)
    assert llm.engine.requests[first.request_id].priority == -2
    streamed = [first, *stream][-1]
    assert streamed.token_ids == llm.generate([prompt], greedy(4))[0].token_ids
    messages = [{"role": "user", "content": "hello"}]
    assert llm.chat([messages, messages], greedy(3), priority=[2, 1])[1].finish_reason == "length"


def test_command_line_options() -> None:
    code, seen = parse_engine_options(["--scheduling-policy", "priority",
                                       "--priority-aging-steps", "8"])
    assert code == 0
    assert (seen["scheduling_policy"], seen["priority_aging_steps"]) == ("priority", 8)
    code, seen = parse_engine_options([])
    assert (seen["scheduling_policy"], seen["priority_aging_steps"]) == ("fcfs", 1024)
    assert parse_engine_options(["--scheduling-policy", "lifo"])[0] == 2
    assert parse_engine_options(["--priority-aging-steps", "-1"])[0] == 2


# --------------------------------------------------------------------------- order
@pytest.mark.parametrize("aging_steps", [0, 1024])
def test_one_seat_serves_waiting_requests_by_priority(qwen2_dir: str, aging_steps: int) -> None:
    engine = LLMEngine(
        qwen2_dir, device="cpu", max_num_seqs=1, scheduling_policy="priority", priority_aging_steps=aging_steps
    )
    long_prompt, *prompts = random_prompts(VOCAB, [12, 5, 6, 7, 8], seed=41)
    long_running = engine.add_request(long_prompt, greedy(30))
    engine.step()
    by_priority = {
        priority: engine.add_request(prompt, greedy(3), priority=priority)
        for prompt, priority in zip(prompts, [3, 2, 1, 0])
    }
    assert finish_order(engine) == [long_running] + [by_priority[p] for p in (0, 1, 2, 3)]
    # The priority-0 newcomer ties the running request's priority and arrived later.
    assert engine.stats()["requests"]["preemptions"] == 0


def test_only_a_more_urgent_request_takes_a_seat(qwen2_dir: str) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", max_num_seqs=3, scheduling_policy="priority")
    prompts = iter(random_prompts(VOCAB, [10, 11, 12, 6, 7, 8, 9], seed=42))
    low = engine.add_request(next(prompts), greedy(20), priority=2)
    engine.step()
    middle = [engine.add_request(next(prompts), greedy(20), priority=1) for _ in range(2)]
    engine.step()
    running = {low, *middle}
    later = [engine.add_request(next(prompts), greedy(3), priority=q) for q in (2, 3)]
    for _ in range(3):
        assert {output.request_id for output in engine.step()} == running
    assert engine.stats()["requests"]["preemptions"] == 0
    # The least urgent request gives up its seat, though it was admitted first; then the
    # latest arrival among the equally urgent. Each newcomer gets a token at once.
    urgent = []
    for victim in (low, middle[1]):
        urgent.append(engine.add_request(next(prompts), greedy(3), priority=0))
        running = running - {victim} | {urgent[-1]}
        assert {output.request_id for output in engine.step()} == running
        assert engine.requests[victim].status is Status.WAITING
    stats = engine.stats()
    assert stats["requests"]["preemptions_by_cause"] == {"kv_pages": 0, "max_num_seqs": 2}
    assert stats["requests"]["preemptions"] == 2
    # The waiting ones resume by urgency: each gets its next token in a later step.
    resumed: dict[str, int] = {}
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            resumed.setdefault(output.request_id, step)
    queue = [middle[1], low, *later]
    assert sorted(queue, key=resumed.__getitem__) == queue
    assert len({resumed[i] for i in queue}) == len(queue)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_earlier_arrival_of_equal_priority_does_not_take_a_seat(
    qwen2_dir: str, policy: str
) -> None:
    engine = LLMEngine(qwen2_dir, device="cpu", max_num_seqs=2, scheduling_policy=policy)
    first, other = random_prompts(VOCAB, [40, 7], seed=49)
    sharing = first[:32] + [3, 4, 5]
    ids = [engine.add_request(p, greedy(6)) for p in (first, sharing, other)]
    # `sharing` waits a step for the pages `first` is computing; `other`, which arrived
    # after it, takes the second seat meanwhile and keeps it.
    engine.step()
    engine.step()
    assert [engine.requests[i].status for i in ids] == [
        Status.RUNNING, Status.WAITING, Status.RUNNING
    ]
    final = run_to_completion(engine)
    assert engine.stats()["requests"]["preemptions"] == 0
    assert final[ids[1]].num_cached_tokens == 32
    plain = LLM(qwen2_dir, device="cpu", enable_prefix_cache=False)
    expected = plain.generate([first, sharing, other], greedy(6))
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in expected]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_request_takes_pages_only_under_priority(qwen2_dir: str, policy: str) -> None:
    # 8 usable pages of 4 tokens. Each background request peaks at 15 computed tokens, 4
    # pages, so together they fill the pool and never need to preempt each other.
    engine = LLMEngine(qwen2_dir, device="cpu", num_pages=9, page_size=4, scheduling_policy=policy)
    prompts = random_prompts(VOCAB, [9, 9, 6], seed=43)
    background = [engine.add_request(p, greedy(7)) for p in prompts[:2]]
    while engine.requests[background[0]].num_tokens < 14:  # 13 computed: 4 pages
        engine.step()
    stats = engine.stats()
    assert stats["kv_cache"]["pages_free"] + stats["kv_cache"]["pages_cached"] == 0
    urgent = engine.add_request(prompts[2], greedy(3), priority=-1 if policy == "priority" else 0)
    moved = {output.request_id for output in engine.step()}
    if policy == "priority":
        assert urgent in moved and background[1] not in moved
        preemptions = engine.stats()["requests"]["preemptions_by_cause"]
        assert preemptions == {"kv_pages": 1, "max_num_seqs": 0}
    else:
        assert urgent not in moved
    final = run_to_completion(engine)
    plain = LLM(qwen2_dir, device="cpu", enable_prefix_cache=False)
    expected = plain.generate(prompts, [greedy(7)] * 2 + [greedy(3)])
    assert [final[i].token_ids for i in [*background, urgent]] == [o.token_ids for o in expected]
    assert engine.stats()["requests"]["preemptions"] == (1 if policy == "priority" else 0)


# --------------------------------------------------------------------------- starvation
def run_stream_with_one_background_request(
    qwen2_dir: str, aging_steps: int, arrival: int, stream_steps: int
) -> tuple[dict[str, int], dict[str, int], str]:
    """One seat; a priority-0 request arrives before every step for `stream_steps` steps,
    each taking 2 steps to serve (so they pile up); a priority-5 request arrives before
    step `arrival`. Returns each request's arrival step, finish step, and the
    priority-5 request's id."""
    engine = LLMEngine(
        qwen2_dir, device="cpu", max_num_seqs=1, scheduling_policy="priority", priority_aging_steps=aging_steps
    )
    prompts = iter(random_prompts(VOCAB, [5] * (stream_steps + 1), seed=44))
    arrived, finished = {}, {}
    background = ""
    step = 0
    while step < stream_steps or engine.has_unfinished_requests():
        if step < stream_steps:
            arrived[engine.add_request(next(prompts), greedy(2))] = step
        if step == arrival:
            background = engine.add_request(next(prompts), greedy(2), priority=5)
            arrived[background] = step
        step += 1
        finished.update({o.request_id: step for o in engine.step() if o.finished})
    return arrived, finished, background


def test_aging_bounds_the_wait_behind_a_stream_of_urgent_requests(qwen2_dir: str) -> None:
    """The bound: with one seat and every request taking L = 2 steps, a priority-p request
    arriving at step a waits only for the requests whose aged priority beats its own:
    those arriving before it, and priority-0 ones arriving before step a + p * A. So it
    finishes by step a + L * (that many + 1); no priority-0 request arriving from a + p * A
    on starts before it finishes."""
    aging, arrival, stream_steps = 2, 6, 36
    arrived, finished, background = run_stream_with_one_background_request(
        qwen2_dir, aging, arrival, stream_steps
    )
    horizon = arrival + 5 * aging
    ahead = [
        i for i, step in arrived.items()
        if i != background and step < horizon and finished[i] > arrival
    ]
    assert finished[background] <= arrival + 2 * (len(ahead) + 1)
    behind = [i for i, step in arrived.items() if step >= horizon and i != background]
    assert all(finished[i] > finished[background] for i in behind)
    assert finished[background] < stream_steps  # served while the stream still flows
    # Without aging the same request waits for the whole stream to drain.
    arrived, finished, background = run_stream_with_one_background_request(
        qwen2_dir, 0, arrival, stream_steps // 2
    )
    assert finished[background] == max(finished.values())


# --------------------------------------------------------------------------- outputs
def test_priorities_and_preemptions_never_change_outputs(qwen2_dir: str) -> None:
    prompts = random_prompts(VOCAB, [40, 33, 50, 21, 45, 38, 29, 47], seed=45)
    priorities = [random.Random(46).randrange(4) for _ in prompts]
    options = dict(device="cpu", num_pages=12, chunk_size=48, max_num_seqs=4)
    fcfs = LLM(qwen2_dir, **options).generate(prompts, greedy(20))
    llm = LLM(qwen2_dir, scheduling_policy="priority", priority_aging_steps=8, **options)
    outputs = llm.generate(prompts, greedy(20), priority=priorities)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in fcfs]
    assert all(o.finish_reason == "length" for o in outputs)
    assert llm.stats()["requests"]["preemptions"] > 0


# --------------------------------------------------------------------------- the server
def test_server_takes_a_priority_on_both_routes(qwen2_dir: str) -> None:
    completion = {"prompt": "the quick brown fox", **GREEDY}
    chat = {"messages": MESSAGES, **GREEDY}
    routes = {"/v1/completions": completion, "/v1/chat/completions": chat}
    with running_server(qwen2_dir, scheduling_policy="priority", max_num_seqs=1) as server:
        for path, body in routes.items():
            for bad in ("1", 1.5, True, [0], -11, 11, -(2**62)):
                status, _, error = call(server, "POST", path, {**body, "priority": bad})
                assert (status, error["error"]["param"]) == (400, "priority"), error
            assert call(server, "POST", path, {**body, "priority": -3})[0] == 200
        # An urgent request takes the only seat from a background one, at once.
        slow_down(server)
        background = {"prompt": "the quick", **LONG_RUNNING, "priority": 5}
        stream = open_stream(server, "/v1/completions", background)
        wait_until(lambda: scrape(server)["nanoqwen_requests_running"] == 1)
        assert call(server, "POST", "/v1/completions", {**completion, "priority": 0})[0] == 200
        samples = scrape(server)
        assert samples['nanoqwen_preemptions_by_cause_total{cause="max_num_seqs"}'] == 1
        assert samples['nanoqwen_preemptions_by_cause_total{cause="kv_pages"}'] == 0
        assert samples["nanoqwen_preemptions_total"] == 1
        stream.close()
    with running_server(qwen2_dir) as fcfs_server:
        for path, body in routes.items():
            status, _, error = call(fcfs_server, "POST", path, {**body, "priority": 1})
            assert (status, error["error"]["param"]) == (400, "priority")
            assert "scheduling_policy" in error["error"]["message"]
            assert call(fcfs_server, "POST", path, {**body, "priority": 0})[0] == 200
