"""The scheduler with a fake model: budgets, chunking, preemption, stops, aborts."""

from __future__ import annotations

from aserve.config import SchedulerConfig
from aserve.engine.kv_cache_manager import KVCacheManager
from aserve.engine.request import Request
from aserve.engine.scheduler import Scheduler
from aserve.wire.worker_messages import RunnerOutput
from aserve.sampling_params import SamplingParams
from aserve.wire.messages import EngineCoreRequest, FinishReason


def make_scheduler(*, blocks=64, block_size=4, budget=64, max_seqs=8, max_model_len=256) -> Scheduler:
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, max_model_len=max_model_len)


def add(sched: Scheduler, rid: str, n_prompt: int, *, priority=0, arrival=0.0, first=10, **params) -> Request:
    """Request ``rid``: prompt tokens ``first``, ``first`` + 1, ... (the same prompt
    start hits the prefix cache)."""
    req = Request(EngineCoreRequest(rid, list(range(first, first + n_prompt)), SamplingParams(**params), eos_token_ids=[1],
                                    arrival_time=arrival, priority=priority), max_model_len=sched.max_model_len)
    sched.add_request(req)
    return req


def run_step(sched: Scheduler, token: int = 7):
    """One step with a fake model that samples ``token`` for every request that reaches its end."""
    out = sched.schedule()
    sampled = [rid for rid in out.num_scheduled_tokens if sched.requests[rid].num_inflight]
    return out, sched.update_from_output(out, RunnerOutput(sampled, [token] * len(sampled), {}, {}))


def test_budget_chunks_long_prompts():
    sched = make_scheduler(budget=10)
    add(sched, "a", 25, max_tokens=2)
    steps = [run_step(sched)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert steps == [10, 10, 5]
    assert sched.requests["a"].num_output_tokens == 1


def test_running_requests_come_first_and_share_the_budget():
    sched = make_scheduler(budget=12)
    add(sched, "a", 8, max_tokens=5)
    run_step(sched)
    add(sched, "b", 20, max_tokens=5)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 11}
    assert [r.req_id for r in out.new_requests] == ["b"]
    assert [r.req_id for r in out.cached_requests] == ["a"]


def test_a_split_prompts_last_chunk_does_not_wait_for_the_next_prompts_first():
    # Budget 10 beside one decoding request: "a" (12 tokens) is split 9 + 3. The step
    # of a's last 3 tokens does not start b (12 tokens, 6 would fit): a's first token
    # would wait for that chunk. b starts in the next step; c (3 tokens, whole) may
    # join a step like that.
    sched = make_scheduler(budget=10)
    add(sched, "d", 2, max_tokens=20)
    run_step(sched)
    add(sched, "a", 12, max_tokens=5)
    add(sched, "b", 12, max_tokens=5, first=100)
    steps = [run_step(sched)[0].num_scheduled_tokens for _ in range(3)]
    assert steps == [{"d": 1, "a": 9}, {"d": 1, "a": 3}, {"d": 1, "a": 1, "b": 8}]
    assert sched.requests["a"].num_output_tokens == 2  # its first token came with its last chunk
    add(sched, "c", 3, max_tokens=5, first=200)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"d": 1, "a": 1, "b": 4, "c": 3}


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_seqs=2)
    for rid in "abc":
        add(sched, rid, 3)
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert sched.num_waiting == 1


def test_length_and_eos_and_stop_token_finish():
    sched = make_scheduler()
    add(sched, "len", 3, max_tokens=2)
    add(sched, "eos", 3, max_tokens=9)
    add(sched, "stop", 3, max_tokens=9, stop_token_ids=[7])
    _, outs = run_step(sched, token=5)
    assert all(o.finish_reason is None for o in outs)
    _, outs = run_step(sched, token=7)
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs}
    assert reasons["len"] == (FinishReason.LENGTH, None)
    assert reasons["stop"] == (FinishReason.STOP, 7)
    assert reasons["eos"] == (None, None)
    _, outs = run_step(sched, token=1)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("eos", FinishReason.STOP)]
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == 63


def test_min_tokens_defers_stops():
    sched = make_scheduler()
    add(sched, "a", 3, max_tokens=9, min_tokens=2)
    _, outs = run_step(sched, token=1)
    assert outs[0].finish_reason is None
    _, outs = run_step(sched, token=1)
    assert outs[0].finish_reason is None  # 2 tokens: min_tokens just reached
    _, outs = run_step(sched, token=1)
    assert outs[0].finish_reason == FinishReason.STOP


def test_preemption_frees_the_latest_and_resumes_it_with_its_tokens():
    sched = make_scheduler(blocks=7, block_size=4)  # 6 usable blocks
    add(sched, "a", 8, arrival=1.0, max_tokens=20, ignore_eos=True)
    b = add(sched, "b", 8, arrival=2.0, max_tokens=20, ignore_eos=True)
    run_step(sched)  # both prefilled: 4 blocks
    for _ in range(4):
        run_step(sched)  # 12 tokens each: 6 blocks, full
    out, _ = run_step(sched)  # a needs a 4th block: b (the later) is preempted
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(out.num_scheduled_tokens) == ["a"]
    assert out.freed_req_ids == ["b"]  # the runner forgets b before running this step
    out, _ = run_step(sched)
    # b comes back as a new request carrying its output tokens, and whole blocks of
    # it still in the prefix cache (here a's identical ones) are not recomputed.
    resumed = [r for r in out.new_requests if r.req_id == "b"]
    assert resumed and resumed[0].token_ids == b.all_token_ids[: len(resumed[0].token_ids)]
    assert len(resumed[0].token_ids) == 13
    assert resumed[0].num_computed_tokens == 12
    assert resumed[0].block_ids[:3] == sched.kv.block_ids("a")[:3]


def test_priority_orders_the_waiting_queue():
    sched = make_scheduler(max_seqs=1)
    add(sched, "low", 3, priority=5, arrival=1.0)
    add(sched, "high", 3, priority=-1, arrival=2.0)
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == ["high"]


def test_abort_frees_blocks_and_tells_the_runner():
    sched = make_scheduler()
    add(sched, "a", 9, max_tokens=9)
    add(sched, "w", 9, max_tokens=9)
    run_step(sched)
    outs = sched.abort_requests(["a", "w", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ABORT), ("w", FinishReason.ABORT)]
    assert sched.kv.pool.num_free_blocks == 63
    out = sched.schedule()
    assert sorted(out.freed_req_ids) == ["a", "w"]
    assert out.is_empty


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler()
    add(sched, "a", 12, max_tokens=1)
    run_step(sched)
    add(sched, "b", 12, max_tokens=1)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"b": 4}
    assert out.new_requests[0].num_computed_tokens == 8


class FakeRunner:
    """The model runner's bookkeeping without a model: it keeps each request's tokens,
    appends what it samples, and samples ``token_at(req_id, position)``."""

    def __init__(self, token_at):
        self.token_at = token_at
        self.tokens: dict[str, list[int]] = {}

    def run(self, out) -> RunnerOutput:
        for rid in out.freed_req_ids:
            self.tokens.pop(rid, None)
        for new in out.new_requests:
            self.tokens[new.req_id] = list(new.token_ids)
        starts = {r.req_id: r.num_computed_tokens for r in [*out.new_requests, *out.cached_requests]}
        sampled, tokens = [], []
        for rid, n in out.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            assert starts[rid] + n <= len(toks), "scheduled a token whose input the runner does not have"
            if starts[rid] + n == len(toks):
                token = self.token_at(rid, len(toks))
                toks.append(token)
                sampled.append(rid)
                tokens.append(token)
        return RunnerOutput(sampled, tokens, {}, {})


def run_engine(sched: Scheduler, token_at, depth: int, *, abort_at: dict[int, str] | None = None):
    """Drive the scheduler as EngineCore.step does with ``depth`` steps in flight; returns
    each request's (tokens, finish reason) and the number of rows the runner computed."""
    runner = FakeRunner(token_at)
    inflight = []
    results: dict[str, list] = {}
    rows = 0
    steps = 0
    while sched.has_unfinished_requests() or inflight:
        if len(inflight) < depth:
            out = sched.schedule()
            if not out.is_empty or out.freed_req_ids:
                inflight.append((out, runner.run(out)))
                rows += len(out.num_scheduled_tokens)
                if len(inflight) < depth:
                    continue
        out, result = inflight.pop(0)
        outputs = sched.update_from_output(out, result)
        steps += 1
        if abort_at and steps in abort_at:
            outputs += sched.abort_requests([abort_at[steps]])
        for o in outputs:
            entry = results.setdefault(o.request_id, [[], None])
            entry[0].extend(o.new_token_ids)
            if o.finish_reason is not None:
                entry[1] = o.finish_reason
    return results, rows


def _token_at(rid: str, position: int) -> int:
    if rid == "eos" and position == 9:
        return 1  # EOS
    if rid == "stop" and position == 11:
        return 3  # a stop token
    return 10 + (position * 7 + ord(rid[0])) % 40


def _add_mix(sched: Scheduler) -> None:
    add(sched, "eos", 5, max_tokens=20)
    add(sched, "stop", 6, max_tokens=20, stop_token_ids=[3])
    add(sched, "len", 7, max_tokens=6, ignore_eos=True)
    add(sched, "long", 30, max_tokens=12, ignore_eos=True)


def test_async_scheduling_gives_the_same_tokens_as_sync():
    sync = make_scheduler(budget=16)
    _add_mix(sync)
    expected, sync_rows = run_engine(sync, _token_at, depth=1)
    pipelined = make_scheduler(budget=16)
    _add_mix(pipelined)
    got, async_rows = run_engine(pipelined, _token_at, depth=2)
    assert got == expected
    assert expected["eos"][1] == FinishReason.STOP and expected["eos"][0][-1] == 1
    assert expected["stop"][1] == FinishReason.STOP and expected["stop"][0][-1] == 3
    assert expected["len"] == [[_token_at("len", p) for p in range(7, 13)], FinishReason.LENGTH]
    # A stop on a token in flight costs one wasted row each (eos, stop); a length limit,
    # known in advance, none.
    assert async_rows == sync_rows + 2
    assert pipelined.kv.pool.num_free_blocks == sync.kv.pool.num_free_blocks == 63
    assert not pipelined.requests


def test_async_scheduling_with_preemption_and_abort_in_flight():
    def run(depth):
        sched = make_scheduler(blocks=9, block_size=4, budget=16)  # 8 usable blocks: preemption
        add(sched, "a", 8, arrival=1.0, max_tokens=14, ignore_eos=True)
        add(sched, "b", 8, arrival=2.0, max_tokens=14, ignore_eos=True)
        add(sched, "c", 5, arrival=3.0, max_tokens=14, ignore_eos=True)
        results, _ = run_engine(sched, _token_at, depth, abort_at={6: "c"})
        return results, sched

    expected, sync = run(1)
    got, pipelined = run(2)
    assert pipelined.num_preemptions >= 1
    for rid in "ab":  # preempted or not, the same tokens (they depend only on the position)
        assert got[rid] == expected[rid] == [[_token_at(rid, p) for p in range(8, 22)], FinishReason.LENGTH]
    assert got["c"][1] == FinishReason.ABORT
    assert got["c"][0] == [_token_at("c", p) for p in range(5, 5 + len(got["c"][0]))]
    assert pipelined.kv.pool.num_free_blocks == 8 and not pipelined.requests


def test_requests_waiting_past_max_queue_time_expire_and_scheduled_ones_do_not():
    sched = make_scheduler(max_seqs=1)
    reqs = {}
    for rid in "abc":
        reqs[rid] = Request(EngineCoreRequest(rid, [10, 11, 12], SamplingParams(max_tokens=50), eos_token_ids=[1],
                                              max_queue_time=5.0), max_model_len=sched.max_model_len)
        sched.add_request(reqs[rid])
    run_step(sched)  # "a" runs; "b" and "c" wait (one sequence at a time)
    start = reqs["a"].received_time
    assert sched.expire_queued(start + 4.0) == []
    expired = sched.expire_queued(start + 5.5)
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in expired] == [
        ("b", FinishReason.ABORT, "max_queue_time"), ("c", FinishReason.ABORT, "max_queue_time")]
    assert sched.num_waiting == 0 and set(sched.requests) == {"a"}  # the running one is left alone
    assert sched.expire_queued(start + 100.0) == []
    run_step(sched)
    assert sched.requests["a"].num_output_tokens == 2


def test_pipeline_batches_hold_different_requests_and_carry_their_tokens():
    """With pipeline stages (``pipeline_batches``) a request whose token is in flight is
    not in the next batch (a prompt's chunks may follow each other: every stage runs the
    batches in order), every batch carries the tokens it computes, and a stage that never samples
    (the first of two) has every input it is asked to compute; the tokens equal those
    of synchronous scheduling."""
    sync = make_scheduler(budget=16)
    _add_mix(sync)
    expected, _ = run_engine(sync, _token_at, depth=1)
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8), kv, max_model_len=256,
                      pipeline_batches=2)
    _add_mix(sched)
    last = FakeRunner(_token_at)
    first: dict[str, list[int]] = {}  # the first stage's tokens: never sampled there
    inflight, results, overlapped = [], {}, 0
    while sched.has_unfinished_requests() or inflight:
        if len(inflight) < 2:
            out = sched.schedule()
            if not out.is_empty or out.freed_req_ids:
                if inflight:
                    assert not set(out.num_scheduled_tokens) & set(inflight[0][1].req_ids)
                    overlapped += bool(out.num_scheduled_tokens)
                for rid in out.freed_req_ids:
                    first.pop(rid, None)
                for new in out.new_requests:
                    first[new.req_id] = list(new.token_ids)
                for cached in out.cached_requests:
                    start = cached.num_computed_tokens
                    first[cached.req_id][start : start + len(cached.new_token_ids)] = cached.new_token_ids
                    assert len(cached.new_token_ids) == out.num_scheduled_tokens[cached.req_id]
                for rid, n in out.num_scheduled_tokens.items():
                    start = next(r.num_computed_tokens for r in [*out.new_requests, *out.cached_requests]
                                 if r.req_id == rid)
                    assert start + n <= len(first[rid]), "the first stage lacks an input token"
                inflight.append((out, last.run(out)))
                if len(inflight) < 2:
                    continue
        out, result = inflight.pop(0)
        for o in sched.update_from_output(out, result):
            entry = results.setdefault(o.request_id, [[], None])
            entry[0].extend(o.new_token_ids)
            if o.finish_reason is not None:
                entry[1] = o.finish_reason
    assert results == expected
    assert overlapped > 5  # the long prompt's chunks and the others' decodes in different batches
