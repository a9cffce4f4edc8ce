"""The runner's CPU thread count follows the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
from server_helpers import wait_until

from nanoqwen.runner import cpu_threads
from nanoqwen.runner.cpu_threads import (
    CoreTimes,
    CpuThreads,
    busy_seconds,
    task_seconds,
    thread_seconds,
    threads_for,
)

STAT = """cpu  900 0 90 9000 9 0 0 0 0 0
cpu0 100 5 10 1000 7 1 2 3 0 0
cpu1 800 0 80 8000 2 0 0 0 0 0
intr 12345
ctxt 678
"""


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_busy_seconds_counts_all_but_idle_and_iowait_of_the_chosen_cores() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(STAT, {0}) == pytest.approx((100 + 5 + 10 + 1 + 2 + 3) / tick)
    assert busy_seconds(STAT, {1}) == pytest.approx(880 / tick)
    assert busy_seconds(STAT, {0, 1}) == pytest.approx(1001 / tick)
    assert busy_seconds(STAT, {5}) == 0  # the aggregate "cpu" line is never read


@pytest.mark.parametrize(("cores", "others", "most", "expected"), [
    (2, 0.0, 2, 2),     # quiet: every core
    (2, 0.2, 2, 2),     # daemons' crumbs leave a core ours
    (2, 0.4, 2, 1),     # a core 40% taken is not
    (2, 1.0, 2, 1),     # one busy process: the other core
    (2, 2.0, 2, 1),     # both busy: never fewer than one thread
    (8, 1.0, 4, 4),     # never more than the count it was given
    (8, 3.0, 8, 5),
])
def test_threads_for_leaves_the_cores_others_use(cores: int, others: float, most: int,
                                                 expected: int) -> None:
    assert threads_for(cores, others, most) == expected


def with_fake_reads(monkeypatch: pytest.MonkeyPatch, cpus: set[int],
                    reads: list[CoreTimes]) -> CpuThreads:
    """A `CpuThreads` over `cpus` whose reads of the cores are `reads`, from a first one
    of zeros. Their clock is far behind the real one, so every step is due for a read."""
    threads = CpuThreads(torch.device("cpu"))
    if not threads.enabled:
        pytest.skip("needs /proc/stat")
    threads.cpus = cpus
    threads.last = CoreTimes(wall=0.0, busy=0.0, ours=0.0)
    queue = iter(reads)
    monkeypatch.setattr(threads, "_read", lambda: next(queue))
    return threads


def threads_in_a_step(threads: CpuThreads) -> int:
    with threads.step():
        return torch.get_num_threads()


def test_a_step_leaves_the_cores_others_used_and_gives_the_count_back(
        monkeypatch: pytest.MonkeyPatch, restore_threads: None) -> None:
    torch.set_num_threads(2)
    threads = with_fake_reads(monkeypatch, {0, 1}, [
        CoreTimes(wall=1.0, busy=2.0, ours=1.9),   # both cores busy, nearly all of it ours
        CoreTimes(wall=2.0, busy=4.0, ours=2.9),   # another process took a core
        CoreTimes(wall=3.0, busy=5.0, ours=3.9),   # ... and left it
    ])
    assert threads_in_a_step(threads) == 2
    assert threads_in_a_step(threads) == 1
    assert torch.get_num_threads() == 2  # outside the step, torch's count as it was
    assert threads.stats_group()["cpu"] == {
        "cores": 2, "threads": 1, "others_cores": pytest.approx(1.0),
        "reduced_steps": 1,
    }
    assert threads_in_a_step(threads) == 2
    assert threads.stats_group()["cpu"]["threads"] == 2
    assert threads.stats_group()["cpu"]["reduced_steps"] == 1  # a count, not a state


def test_torch_thread_count_is_the_most_a_step_uses(monkeypatch: pytest.MonkeyPatch,
                                                    restore_threads: None) -> None:
    threads = with_fake_reads(monkeypatch, set(range(8)),
                              [CoreTimes(wall=1.0, busy=0.0, ours=0.0)])  # all idle
    torch.set_num_threads(3)
    assert threads_in_a_step(threads) == 3
    torch.set_num_threads(1)
    assert threads_in_a_step(threads) == 1  # one thread: nothing to share, nothing read


def test_a_step_off_a_cpu_keeps_torch_thread_count(restore_threads: None) -> None:
    torch.set_num_threads(2)
    threads = CpuThreads(torch.device("meta"))
    assert not threads.enabled
    assert threads_in_a_step(threads) == 2
    assert threads.stats_group() == {}  # no `cpu` group in the engine's stats


needs_proc = pytest.mark.skipif(not cpu_threads.PROC_STAT.is_file(), reason="needs /proc")


# The readings below are of real cores, and other processes may use them too: each test
# checks only what a known consumer adds, which holds however busy the machine is, and
# waits for that consumer to have run, not for a time. (`threads_for` and the fake reads
# above check the choice made from them.) Both clocks count in ticks: allow a few.
TICKS = 5 / os.sysconf("SC_CLK_TCK")


@needs_proc
def test_a_busy_process_on_our_cores_counts_as_others_use() -> None:
    threads = CpuThreads(torch.device("cpu"))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {min(threads.cpus)})
        child = psutil.Process(busy.pid)
        before = threads._read()
        started = sum(child.cpu_times()[:2])
        wait_until(lambda: sum(child.cpu_times()[:2]) >= started + 0.5, timeout=600)
        ran = sum(child.cpu_times()[:2]) - started
        after = threads._read()
    finally:
        busy.kill()
        busy.wait()
    others = (after.busy - before.busy) - (after.ours - before.ours)
    assert others >= ran - TICKS


@needs_proc
def test_a_busy_thread_of_this_process_counts_as_others_use_and_the_stepping_one_not() -> None:
    """A server's handler thread that keeps a core busy (parsing, tokenizing) counts as
    another process would; the thread that runs the steps does not."""
    threads = CpuThreads(torch.device("cpu"))
    spun, done = threading.Event(), threading.Event()
    side_seconds: list[float] = []

    def handler() -> None:
        spin_for(0.3)
        side_seconds.append(time.thread_time())
        spun.set()
        done.wait()  # alive at the second reading: an ended thread's time is missed

    before = threads._read()
    side = threading.Thread(target=handler)
    side.start()
    try:
        assert spun.wait(timeout=600)
        stepping = time.thread_time()
        spin_for(0.3)
        stepping = time.thread_time() - stepping
        after = threads._read()
    finally:
        done.set()
        side.join()
    ours = after.ours - before.ours
    assert stepping - TICKS <= ours <= stepping + 0.1  # the handler's 0.3 s are not ours
    assert (after.busy - before.busy) - ours >= side_seconds[0] - TICKS


def spin_for(seconds: float) -> None:
    """Keep one core busy for `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_task_seconds_add_user_and_system_time_after_any_thread_name() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    fields = "S 1 2 3 4 5 6 7 8 9 10 300 45 0 0 20 0 1 0"  # state, ..., utime 300, stime 45
    assert task_seconds(f"42 (python) {fields}".encode()) == pytest.approx(345 / tick)
    assert task_seconds(f"42 (a) b ) c) {fields}".encode()) == pytest.approx(345 / tick)
    assert task_seconds(b"") is None


def test_thread_seconds_reads_this_thread_and_ends_with_it() -> None:
    if not cpu_threads.PROC_STAT.is_file():
        pytest.skip("needs /proc")
    spin_for(0.3)
    seconds = thread_seconds(threading.get_native_id())
    assert seconds is not None and seconds == pytest.approx(time.thread_time(), abs=0.05)
    finished = threading.Thread(target=lambda: None)
    finished.start()
    finished.join()
    # `join` returns once the thread's Python work is done; the kernel lets its task go a
    # moment later, and until then it reads 0.
    wait_until(lambda: thread_seconds(finished.native_id) is None, timeout=600)


def test_busy_seconds_include_this_process() -> None:
    """What this process runs is counted busy on its cores (so subtracting it is right)."""
    if not cpu_threads.PROC_STAT.is_file():
        pytest.skip("needs /proc/stat")
    cpus = os.sched_getaffinity(0)
    before_busy, before_ours = busy_seconds(cpu_threads.PROC_STAT.read_text(), cpus), sum(
        os.times()[:2])
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    busy = busy_seconds(cpu_threads.PROC_STAT.read_text(), cpus) - before_busy
    ours = sum(os.times()[:2]) - before_ours
    assert ours >= 0.45
    assert busy >= ours - 0.05  # a tick or so of rounding


def test_every_forward_runs_in_a_step(monkeypatch: pytest.MonkeyPatch, qwen3_dir: str,
                                      restore_threads: None) -> None:
    from nanoqwen import LLM, SamplingParams

    torch.set_num_threads(2)
    seen = []
    original = CpuThreads.step

    def step(self: CpuThreads):  # noqa: ANN202 (a context manager, as the original)
        seen.append(self)
        return original(self)

    monkeypatch.setattr(CpuThreads, "step", step)
    llm = LLM(qwen3_dir, device="cpu")
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(seen) >= 5  # a prefill and four decodes, at least
    assert all(threads is llm.engine.runner.cpu_threads for threads in seen)
    assert torch.get_num_threads() == 2
    if seen[0].enabled:  # the engine reports its runner's choices
        assert llm.engine.stats()["cpu"] == seen[0].stats_group()["cpu"]
