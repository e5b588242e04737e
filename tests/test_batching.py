"""Continuous batching: concurrency, preemption, cancellation, batch invariance (CPU, fp32)."""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import qwen_rt

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _workload(folder, count, seed, plen=(1, 60), mt=(1, 20)):
    """`count` (prompt, max_tokens) pairs of random lengths, well conditioned for exact match."""
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(plen[0], plen[1] + 1, size=count)]
    mts = [int(x) for x in rng.integers(mt[0], mt[1] + 1, size=count)]
    prompts = M.pick_prompts(folder, seed=seed + 1, lengths=lens, max_new=max(mts))
    return list(zip(prompts, mts))


def _run_threads(fns):
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in ts), "a client thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen2_bias_gqa2_tied"])
def test_concurrent_threads_match_alone(build, make_gen, idle, name):
    """64 requests from 4 threads at once (generate, submit, stream) give each one's own tokens."""
    folder = build(name)
    gen = make_gen(folder, max_batch_size=8, max_num_batched_tokens=32)
    work = _workload(folder, 64, seed=100)
    got: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    shares = [list(range(k, 64, 4)) for k in range(4)]

    def by_generate():
        for i in shares[0]:
            p, mt = work[i]
            (c,) = gen.generate([p], max_tokens=mt, **GREEDY)
            got[i], reasons[i] = c.token_ids, c.finish_reason

    def by_generate_list():
        # Groups of requests with the same max_tokens go through one generate() call.
        groups: dict[int, list[int]] = {}
        for i in shares[1]:
            groups.setdefault(work[i][1], []).append(i)
        for mt, idx in groups.items():
            outs = gen.generate([work[i][0] for i in idx], max_tokens=mt, **GREEDY)
            for i, c in zip(idx, outs):
                got[i], reasons[i] = c.token_ids, c.finish_reason

    def by_submit():
        reqs = [(i, gen.submit(work[i][0], max_tokens=work[i][1], **GREEDY)) for i in shares[2]]
        for i, r in reqs:
            c = r.result()
            got[i], reasons[i] = c.token_ids, c.finish_reason

    def by_stream():
        for i in shares[3]:
            p, mt = work[i]
            ds = list(gen.stream(p, max_tokens=mt, **GREEDY))
            got[i] = [t for d in ds for t in d.token_ids]
            reasons[i] = ds[-1].finish_reason

    _run_threads([by_generate, by_generate_list, by_submit, by_stream])
    assert sorted(got) == list(range(64))
    for i, (p, mt) in enumerate(work):
        assert reasons[i] == "length", i
        msg = M.greedy_mismatch(folder, p, got[i], mt)
        assert not msg, f"request {i}: {msg}"
    s = idle(gen)
    assert s["free_slots"] == s["total_slots"] == 8
    assert s["free_pages"] == s["total_pages"]


def test_preemption_keeps_tokens(build, fresh_gen, idle):
    """A pool of 1.5 full-length requests with 8 slots, and outputs far longer than the prompts: admission
    reserves only part of the growth, so requests are preempted and recomputed, and every request still
    gets exactly its own greedy tokens."""
    folder = build("qwen3_gqa4")
    pages = 6  # 96 tokens; every request ends at 52..64 tokens = 4 pages
    gen = fresh_gen(folder, max_batch_size=8, max_model_len=64,
                    kv_cache_memory=M.kv_bytes(folder, pages, 16))
    s = gen.stats()
    assert 4 <= s["total_pages"] <= pages, s
    work = _workload(folder, 16, seed=200, plen=(8, 16), mt=(44, 48))
    reqs = [gen.submit(p, max_tokens=mt, **GREEDY) for p, mt in work]
    outs = [r.result() for r in reqs]
    for (p, mt), c in zip(work, outs):
        assert c.finish_reason == "length"
        msg = M.greedy_mismatch(folder, p, c.token_ids, mt)
        assert not msg, msg
    s = idle(gen)
    assert s["preemptions"] > 0, s
    assert s["free_pages"] == s["total_pages"] and s["free_slots"] == s["total_slots"], s


def test_admission_control_avoids_preemption_storms(build, fresh_gen, idle):
    """Many requests whose outputs outgrow the pool: the scheduler admits by expected growth, so requests
    are not preempted and readmitted over and over (greedy admission preempted at almost every step)."""
    folder = build("qwen3_gqa4")
    gen = fresh_gen(folder, max_batch_size=8, max_model_len=80,
                    kv_cache_memory=M.kv_bytes(folder, 12, 16))  # 12 pages: three requests at full length
    work = _workload(folder, 12, seed=210, plen=(18, 22), mt=(40, 40))
    reqs = [gen.submit(p, max_tokens=mt, **GREEDY) for p, mt in work]
    outs = [r.result() for r in reqs]
    for (p, mt), c in zip(work, outs):
        assert len(c.token_ids) == mt
        msg = M.greedy_mismatch(folder, p, c.token_ids, mt)
        assert not msg, msg
    s = idle(gen)
    assert s["preemptions"] <= 4, s


def test_cancellation_frees_everything(build, fresh_gen, idle):
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=4, max_model_len=512)
    long = 450
    (p,) = M.pick_prompts(folder, seed=300, lengths=[40], max_new=8)
    ref = M.hf_greedy(folder, p, 8)

    # Cancelled at once (some still waiting: 6 requests, 4 slots).
    reqs = [gen.submit(p, max_tokens=long, **GREEDY) for _ in range(6)]
    for r in reqs[:3]:
        r.cancel()
    # Cancelled after their first delta.
    for r in reqs[3:]:
        it = iter(r)
        first = next(it)
        assert first.finish_reason is None
        r.cancel()
    for r in reqs:
        c = r.result()
        assert c.finish_reason == "cancelled"
        assert len(c.token_ids) < long
        k = min(len(c.token_ids), 8)
        assert c.token_ids[:k] == ref[:k]
    s = idle(gen)
    assert s["free_slots"] == s["total_slots"] and s["free_pages"] == s["total_pages"], s
    assert s["running"] == 0 and s["waiting"] == 0, s

    # Breaking out of a stream cancels its request.
    n = 0
    for d in gen.stream(p, max_tokens=long, **GREEDY):
        n += len(d.token_ids)
        if n >= 2:
            break
    s = idle(gen)
    assert s["free_slots"] == s["total_slots"] and s["free_pages"] == s["total_pages"], s

    # Cancelling a finished request changes nothing; the generator still serves requests.
    r = gen.submit(p, max_tokens=8, **GREEDY)
    c = r.result()
    r.cancel()
    assert c.finish_reason == "length" and c.token_ids == ref
    assert r.result().finish_reason == "length"


def test_request_independent_of_batch(build, make_gen, fresh_gen):
    """A request's tokens (greedy, and sampled with a fixed seed) are the same alone, in a
    batch of others, and under another batch size / token budget."""
    folder = build("qwen2_gqa4_untied")
    gen = make_gen(folder, max_batch_size=8, max_num_batched_tokens=32)
    (p,) = M.pick_prompts(folder, seed=400, lengths=[21], max_new=16)
    others = _workload(folder, 10, seed=401, plen=(1, 50), mt=(4, 16))
    sampled = dict(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)

    alone_s = gen.generate([p], **sampled)[0].token_ids
    alone_g = gen.generate([p], max_tokens=16, **GREEDY)[0].token_ids
    assert alone_g == M.hf_greedy(folder, p, 16)
    assert len(alone_s) == 16

    # In a crowd: others before and after, some sampled with other seeds, some greedy.
    reqs = []
    for j, (q, mt) in enumerate(others[:5]):
        reqs.append(gen.submit(q, max_tokens=mt, temperature=0.8 if j % 2 else 0.0,
                               seed=j, ignore_eos=True))
    rs = gen.submit(p, **sampled)
    rg = gen.submit(p, max_tokens=16, **GREEDY)
    for j, (q, mt) in enumerate(others[5:]):
        reqs.append(gen.submit(q, max_tokens=mt, temperature=1.0, seed=50 + j, ignore_eos=True))
    assert rs.result().token_ids == alone_s
    assert rg.result().token_ids == alone_g
    for r in reqs:
        r.result()

    # Another generator: batch of 2, 8-token budget (other chunking, other batch rows).
    gen2 = fresh_gen(folder, max_batch_size=2, max_num_batched_tokens=8)
    outs = gen2.generate([others[0][0], p, others[1][0]], **sampled)
    assert outs[1].token_ids == alone_s
    # Sampling really samples here (the seed matters).
    assert alone_s != alone_g


def test_two_threads_waiting_on_one_request_take_its_output_in_turns(build, fresh_gen):
    """The engine's wait from two threads on one id: every token goes to exactly one of them, one sees the end
    (the other is told the id finished), and the next request is untouched by the stale waiter (its channel
    could take the erased one's memory)."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=4, max_model_len=256)
    eng = gen._engine
    n = 40
    (p,) = M.pick_prompts(folder, seed=400, lengths=[12], max_new=n)
    ref = M.hf_greedy(folder, p, n)
    opts = gen._native_sampling(gen._params(None, dict(max_tokens=n, **GREEDY)))
    for trial in range(12):
        rid = eng.submit(p, opts)
        got = {"A": [], "B": []}
        ends = []

        def waiter(name):
            try:
                while True:
                    o = eng.wait(rid, 0.5, trial % 2 == 0)
                    got[name] += list(o.tokens)
                    if o.finish_reason is not None:
                        ends.append((name, o.finish_reason))
                        return
            except ValueError as e:
                assert "finished" in str(e), e
                ends.append((name, "taken"))

        b = threading.Thread(target=waiter, args=("B",))
        b.start()
        waiter("A")
        rid2 = eng.submit(p, opts)  # may reuse the memory of rid's channel
        b.join(timeout=30)
        assert not b.is_alive()
        assert sorted(r for _, r in ends) == ["length", "taken"], ends
        assert len(got["A"]) + len(got["B"]) == n
        out2 = []
        while True:
            o = eng.wait(rid2, 5.0)
            out2 += list(o.tokens)
            if o.finish_reason is not None:
                assert o.finish_reason == "length"
                break
        assert out2 == ref, f"trial {trial}"


def test_cancelled_astream_leaves_later_requests_whole(build, fresh_gen, idle):
    """Cancelling an astream while its worker thread waits on the request (the task's finally cancels from the
    event loop's thread): later requests still get all their tokens, and everything is freed."""
    import asyncio

    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=4, max_model_len=512)
    (p, q) = M.pick_prompts(folder, seed=410, lengths=[30, 6], max_new=30)
    ref = M.hf_greedy(folder, q, 30)

    async def consume(started):
        async for _ in gen.astream(p, max_tokens=480, **GREEDY):
            started.set()

    async def main():
        for _ in range(6):
            started = asyncio.Event()
            task = asyncio.create_task(consume(started))
            await started.wait()  # its worker thread now waits for the next token
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            (c,) = gen.generate([q], max_tokens=30, **GREEDY)
            assert c.token_ids == ref and c.finish_reason == "length"

    asyncio.run(main())
    s = idle(gen)
    assert s["free_pages"] == s["total_pages"] and s["running"] == 0 and s["waiting"] == 0, s


def test_stats_after_cancels_of_waiting_requests_and_after_close(build, fresh_gen, idle):
    """Requests cancelled before the engine's loop takes them leave no count behind, and the engine's stats
    after close show nothing running or waiting and every page free."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=2, max_model_len=256)
    (p,) = M.pick_prompts(folder, seed=420, lengths=[20], max_new=8)
    for _ in range(100):
        gen.submit(p, max_tokens=100, **GREEDY).cancel()
    s = idle(gen)
    assert s["waiting"] == 0 and s["running"] == 0 and s["free_pages"] == s["total_pages"], s
    reqs = [gen.submit(p, max_tokens=200, **GREEDY) for _ in range(4)]  # 2 run, 2 wait
    next(iter(reqs[0]))
    eng = gen._engine
    gen.close()
    s = eng.stats()
    assert s["waiting"] == 0 and s["running"] == 0, s
    assert s["free_pages"] == s["total_pages"] and s["free_slots"] == s["total_slots"], s


def test_kv_cache_of_one_page_takes_a_request_that_fills_it(build, fresh_gen):
    """The last sampled token is never fed, so prompt + max_tokens - 1 rows must fit the pool (not + max_tokens):
    a 16-token prompt and one new token run in a 16-token pool; two new tokens are refused."""
    folder = build("qwen3_gqa4")
    gen = fresh_gen(folder, max_batch_size=1, max_model_len=64, kv_cache_memory=M.kv_bytes(folder, 1, 16))
    assert gen.stats()["total_pages"] == 1
    (p,) = M.pick_prompts(folder, seed=430, lengths=[16], max_new=1)
    (c,) = gen.generate([p], max_tokens=1, **GREEDY)
    assert c.token_ids == M.hf_greedy(folder, p, 1)
    with pytest.raises(ValueError, match="KV cache"):
        gen.generate([p], max_tokens=2, **GREEDY)


def _take_first_output(req):
    """Waits until the request's first tokens are taken (later ones keep arriving in the engine, untaken)."""
    while not req.token_ids:
        req._poll(0.2)


def test_cancel_keeps_text_and_logprobs_with_the_tokens(build, fresh_gen, idle):
    """cancel() takes what is still in the engine the way result() does: token_ids, text and logprobs describe
    the same tokens, whether the request was running or had already ended (then its own reason stays)."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=2, max_model_len=512)
    (p,) = M.pick_prompts(folder, seed=420, lengths=[12], max_new=8)
    ref = M.hf_greedy(folder, p, 8)

    took_pending = 0
    for pause in (0.0, 0.001, 0.002, 0.005, 0.01):  # running: cancelled soon after its first output
        r = gen.submit(p, max_tokens=480, logprobs=2, **GREEDY)
        _take_first_output(r)
        n = len(r.token_ids)
        time.sleep(pause)  # more output waits in the engine, untaken
        r.cancel()
        c = r.result()
        took_pending += c.finish_reason == "cancelled" and len(c.token_ids) > n
        assert c.token_ids[:8] == ref[:min(8, len(c.token_ids))]
        assert len(c.logprobs) == len(c.token_ids)
        assert c.text == gen.tokenizer.decode(c.token_ids)
    assert took_pending, "no cancel found output waiting: the case is not tested"

    r = gen.submit(p, max_tokens=8, logprobs=2, **GREEDY)
    idle(gen)  # it has ended by length; nothing of it was taken yet
    r.cancel()
    c = r.result()
    assert c.finish_reason == "length" and c.token_ids == ref
    assert len(c.logprobs) == 8 and c.text == gen.tokenizer.decode(ref)


def test_stream_deltas_add_up_when_cancelled_mid_stream(build, fresh_gen, idle):
    """A stream cancelled inside its own loop, or by another thread while it waits, still yields what cancel()
    took from the engine: its deltas add up to the request's tokens and text, the last one has the finish reason."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=2, max_model_len=512)
    (p,) = M.pick_prompts(folder, seed=421, lengths=[10], max_new=4)

    def check(r, deltas):
        assert deltas[-1].finish_reason == r.finish_reason and r.finish_reason in ("cancelled", "length")
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert [t for d in deltas for t in d.token_ids] == r.token_ids
        assert "".join(d.text for d in deltas) == r.text

    took = 0
    for pause in (0.0, 0.005, 0.02):
        r = gen.submit(p, max_tokens=480, **GREEDY)
        deltas = []
        for d in r:  # the cancel inside the loop takes output this loop has not seen
            deltas.append(d)
            if len(deltas) == 1:
                time.sleep(pause)
                n = len(r.token_ids)
                r.cancel()
                took += len(r.token_ids) > n
        check(r, deltas)
    assert took, "no cancel found output waiting: the case is not tested"
    for _ in range(3):  # cancelled by another thread while the stream waits
        r = gen.submit(p, max_tokens=480, **GREEDY)
        deltas, first = [], threading.Event()

        def consume():
            for d in r:
                deltas.append(d)
                first.set()

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(30)
        r.cancel()
        t.join(30)
        assert not t.is_alive()
        check(r, deltas)
    idle(gen)


def test_completion_logprobs_are_its_own(build, fresh_gen, idle):
    """A Completion's logprobs are a copy: one taken mid-stream keeps matching its token_ids, and changing one
    result() leaves the next alone."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=2, max_model_len=512)
    r = gen.submit([5, 6, 7], max_tokens=400, logprobs=1, **GREEDY)
    it = iter(r)
    while not r.token_ids:
        next(it)
    snap = r.completion()
    for _ in it:
        pass
    assert len(snap.logprobs) == len(snap.token_ids) < 400
    c = r.result()
    c.logprobs.clear()
    assert len(r.result().logprobs) == len(r.result().token_ids) == 400
    idle(gen)


def test_close_from_several_threads_at_once(build, fresh_gen):
    """close() is safe to call from several threads together: each returns once the engine is freed. Requests it
    closes under end as cancelled with what they produced, whether read by result() or by a generate()."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=4, max_model_len=512)
    r = gen.submit([5, 6, 7], max_tokens=400, **GREEDY)
    got = []  # a generate() with stop strings (read by wait_any) running while the Generator closes
    gen_thread = threading.Thread(target=lambda: got.extend(
        gen.generate([[5, 6], [7, 8]], max_tokens=400, stop=["never in this text"], **GREEDY)))
    gen_thread.start()
    while gen.stats()["running"] < 3:
        time.sleep(0.001)
    errors, go = [], threading.Barrier(4)

    def close():
        go.wait()
        try:
            gen.close()
            assert gen._engine is None
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    gen_thread.join(60)
    assert [c.finish_reason for c in got] == ["cancelled", "cancelled"]
    assert r.result().finish_reason == "cancelled" and len(r.token_ids) < 400  # output not taken before is gone
    assert r.text == gen.tokenizer.decode(r.token_ids)
    with pytest.raises(qwen_rt.GeneratorClosed, match="closed"):
        gen.stats()


def test_dropped_request_stops_and_leaves_nothing_behind(build, fresh_gen, idle):
    """A Request dropped unfinished (neither result() nor cancel()) is stopped, its slot and pages are freed, and
    the engine keeps none of its output (wait on its id is refused); others are unaffected."""
    folder = build("qwen3_gqa2_tied")
    gen = fresh_gen(folder, max_batch_size=2, max_model_len=512)
    (p,) = M.pick_prompts(folder, seed=430, lengths=[10], max_new=6)
    ref = M.hf_greedy(folder, p, 6)
    eng = gen._engine
    steps = gen.stats()["steps"]
    ids = []
    for _ in range(3):  # 2 slots: one of them still waits when dropped
        r = gen.submit(p, max_tokens=480, **GREEDY)
        ids.append(r._rid)
        del r
    gc.collect()
    for _ in range(4):  # dropped while it runs, after its first output: its later tokens go nowhere
        r = gen.submit(p, max_tokens=480, **GREEDY)
        _take_first_output(r)
        ids.append(r._rid)
        del r
    s = idle(gen)
    assert s["free_slots"] == s["total_slots"] and s["free_pages"] == s["total_pages"], s
    assert s["steps"] - steps < 1000, s  # run to the end, the seven would take over 2000 steps
    for rid in ids:
        with pytest.raises(ValueError, match="unknown or finished"):
            eng.wait(rid, 0.0)
    # Dropped after it ended: its stored output goes too.
    r = gen.submit(p, max_tokens=6, **GREEDY)
    rid = r._rid
    idle(gen)
    del r
    with pytest.raises(ValueError, match="unknown or finished"):
        eng.wait(rid, 0.0)
    (c,) = gen.generate([p], max_tokens=6, **GREEDY)
    assert c.token_ids == ref


def test_generate_with_one_sampling_per_prompt(build, make_gen):
    """generate(prompts, sampling=[...]): each prompt gets its own SamplingParams (keyword arguments still
    apply to all), with the tokens each gets alone; a list of the wrong length or type is refused."""
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    gen = make_gen(folder, max_batch_size=4, max_model_len=256)
    p, q = M.pick_prompts(folder, seed=440, lengths=[9, 14], max_new=12)
    sp = [qwen_rt.SamplingParams(max_tokens=5, temperature=0.0),
          qwen_rt.SamplingParams(max_tokens=12, temperature=0.9, seed=77, logprobs=2)]
    both = gen.generate([p, q], sampling=sp, ignore_eos=True)
    alone = [gen.generate([x], sampling=s, ignore_eos=True)[0] for x, s in zip((p, q), sp)]
    assert [c.token_ids for c in both] == [c.token_ids for c in alone]
    assert both[0].token_ids == M.hf_greedy(folder, p, 5) and len(both[1].token_ids) == 12
    assert both[0].logprobs is None and len(both[1].logprobs) == 12
    with pytest.raises(ValueError, match="sampling has 1 entries for 2 prompts"):
        gen.generate([p, q], sampling=sp[:1])
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        gen.generate([p, q], sampling=[sp[0], {"max_tokens": 3}])
