"""Sampling semantics end to end (CPU, fp32), against transformers' logits.

Semantics (cpp/backend/ops.h): logprobs are of the raw logits; penalties, then temperature, top_k,
top_p (smallest prefix reaching the mass), min_p (relative to the best), then a seeded draw that
depends only on (seed, draw index, token id) - never on the batch.
"""
from __future__ import annotations

import numpy as np
import pytest

import models as M
import qwen_rt

GREEDY = dict(temperature=0.0, ignore_eos=True)
NAME = "qwen3_mha_untied"


@pytest.fixture(scope="module")
def folder(build):
    return build(NAME)


@pytest.fixture(scope="module")
def gen(folder, make_gen):
    return make_gen(folder, max_batch_size=64)


def probs(logits, temperature=1.0):
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    return p / p.sum()


def allowed(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, tol=1e-4):
    """(set of tokens that may be drawn per ops.h step 6, whether the cut is within tol)."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = order
    close = False
    if top_k:
        kth = x[order[top_k - 1]]
        keep = order[x[order] >= kth]
        if top_k < len(order) and kth - x[order[top_k]] < tol:
            close = True
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p)
        n = int(np.searchsorted(cum, top_p - 1e-12) + 1)
        if np.min(np.abs(cum[max(n - 2, 0):n + 1] - top_p)) < tol:
            close = True
        keep, p = keep[:n], p[:n] / p[:n].sum()
    if min_p > 0.0:
        thr = min_p * p.max()
        if np.min(np.abs(p - thr)) < tol * p.max():
            close = True
        m = p >= thr
        keep = keep[m]
    return {int(t) for t in keep}, close


def _sample_first(gen, prompt, n, **kw):
    """First generated token of n requests with seeds 0..n-1."""
    reqs = [gen.submit(prompt, max_tokens=1, seed=s, ignore_eos=True, **kw) for s in range(n)]
    return [r.result().token_ids[0] for r in reqs]


def _well_spread_token(folder, k=5, t1=1.5, t0=1.0, min_tv=0.15):
    """A one-token prompt whose top-k distribution at t1 is far (TV >= min_tv) from the one at
    t0, with a clear gap after the k-th logit: a wrong temperature or top_k would show."""
    info = M.model_info(folder)
    best = None
    for t in range(3, info["vocab_size"]):
        if t in info["specials"]:
            continue
        lg = M.hf_logits(folder, [t])
        s = np.sort(lg)[::-1]
        if s[k - 1] - s[k] < 0.05:
            continue
        a, b = probs(s[:k], t1), probs(s[:k], t0)
        tv = 0.5 * np.abs(a - b).sum()
        if tv >= min_tv:
            return t
        best = max(best or 0, tv)
    raise AssertionError(f"fixture: no well-spread one-token prompt (best TV {best})")


# --- greedy equivalences ------------------------------------------------------------------------------

def test_top_k_1_is_greedy(folder, gen):
    n = 12
    for i, p in enumerate(M.pick_prompts(folder, seed=500, lengths=[3, 17, 40], max_new=n)):
        (c,) = gen.generate([p], max_tokens=n, temperature=1.0, top_k=1, seed=i, ignore_eos=True)
        msg = M.greedy_mismatch(folder, p, c.token_ids, n)
        assert not msg, msg


def test_generation_config_defaults(build, folder, fresh_gen, tmp_path):
    """Fields left None take generation_config.json's value: top_k=1 there makes it greedy."""
    n = 12
    (p,) = M.pick_prompts(folder, seed=501, lengths=[9], max_new=n)
    ref = M.hf_greedy(folder, p, n)
    g0 = fresh_gen(folder, max_batch_size=2)
    (c,) = g0.generate([p], max_tokens=n, seed=3, ignore_eos=True)  # temperature 1, no top_k
    assert c.token_ids != ref
    f2 = M.copy_folder(folder, tmp_path / "m")
    M.edit_json(f2 / "generation_config.json", lambda c: c.update(top_k=1, temperature=1.0,
                                                                   do_sample=True))
    g1 = fresh_gen(f2, max_batch_size=2)
    (c,) = g1.generate([p], max_tokens=n, seed=3, ignore_eos=True)
    assert c.token_ids == ref


# --- seeds --------------------------------------------------------------------------------------------

def test_same_seed_same_tokens_any_batch(folder, gen):
    n = 12
    p, q = M.pick_prompts(folder, seed=502, lengths=[6, 25], max_new=2)
    kw = dict(max_tokens=n, temperature=1.0, top_p=0.95, seed=77, ignore_eos=True)
    (alone,) = gen.generate([p], **kw)
    outs = gen.generate([p, q, p, q, p], **kw)  # duplicates in one batch, same seed
    assert outs[0].token_ids == outs[2].token_ids == outs[4].token_ids == alone.token_ids
    assert outs[1].token_ids == outs[3].token_ids
    mixed = [gen.submit(q, max_tokens=n, temperature=1.0, seed=s, ignore_eos=True)
             for s in range(6)]
    r = gen.submit(p, **kw)
    assert r.result().token_ids == alone.token_ids
    for m in mixed:
        m.result()


def test_different_seeds_differ(folder, gen):
    (p,) = M.pick_prompts(folder, seed=503, lengths=[8], max_new=2)
    outs = [tuple(gen.generate([p], max_tokens=10, temperature=1.0, seed=s,
                               ignore_eos=True)[0].token_ids) for s in range(8)]
    assert len(set(outs)) >= 7, outs
    firsts = {o[0] for o in outs}
    assert len(firsts) >= 3, firsts


# --- distributions ------------------------------------------------------------------------------------

def test_temperature_top_k_distribution(folder, gen):
    """2000 seeded draws of the first token at temperature 1.5, top_k 5, against
    softmax(logits / 1.5) over the top 5 (total variation < 0.05; sampling noise is ~0.02, a
    sampler that ignored the temperature would be >= 0.15 away)."""
    T, K, N = 1.5, 5, 2000
    t = _well_spread_token(folder, K, T)
    lg = M.hf_logits(folder, [t])
    top = [int(i) for i in np.argsort(-lg, kind="stable")[:K]]
    expect = probs(lg[top], T)
    toks = _sample_first(gen, [t], N, temperature=T, top_k=K)
    assert set(toks) <= set(top), set(toks) - set(top)
    freq = np.array([toks.count(i) for i in top]) / N
    tv = 0.5 * np.abs(freq - expect).sum()
    assert tv < 0.05, (tv, freq.round(3), expect.round(3))


def test_top_p_nucleus(folder, gen):
    t = _well_spread_token(folder)
    lg = M.hf_logits(folder, [t])
    p = np.sort(probs(lg))[::-1]
    cum = np.cumsum(p)
    top_p = float((cum[1] + cum[2]) / 2)  # nucleus = the best 3 tokens
    nucleus, close = allowed(lg, top_p=top_p)
    assert len(nucleus) == 3 and not close
    toks = _sample_first(gen, [t], 400, temperature=1.0, top_p=top_p)
    assert set(toks) <= nucleus, set(toks) - nucleus
    assert set(toks) == nucleus  # each has >= 1/4 of the kept mass: all appear in 400 draws
    expect = p[:3] / p[:3].sum()
    order = [int(i) for i in np.argsort(-lg, kind="stable")[:3]]
    freq = np.array([toks.count(i) for i in order]) / len(toks)
    assert 0.5 * np.abs(freq - expect).sum() < 0.1, (freq, expect)


def _check_multi_step(folder, gen, prompt, n_seeds, steps, **kw):
    """Every sampled token lies in the allowed set computed from transformers' logits of its
    own prefix (steps whose cut is within tolerance are not judged); returns judged count."""
    judged = 0
    reqs = [gen.submit(prompt, max_tokens=steps, seed=s, ignore_eos=True, **kw)
            for s in range(n_seeds)]
    for r in reqs:
        toks = r.result().token_ids
        assert len(toks) == steps
        all_lg = M.hf_logits(folder, list(prompt) + toks[:-1], all_positions=True)
        for i, tok in enumerate(toks):
            lg = all_lg[len(prompt) - 1 + i]
            ok, close = allowed(lg, kw.get("temperature", 1.0), kw.get("top_k", 0),
                                kw.get("top_p", 1.0), kw.get("min_p", 0.0))
            if close:
                continue
            judged += 1
            assert tok in ok, (i, tok, sorted(ok))
    return judged


def test_top_p_multi_step(folder, gen):
    (p,) = M.pick_prompts(folder, seed=504, lengths=[12], max_new=2)
    judged = _check_multi_step(folder, gen, p, 40, 6, temperature=0.9, top_p=0.3)
    assert judged >= 200


def test_min_p(folder, gen):
    t = _well_spread_token(folder)
    lg = M.hf_logits(folder, [t])
    p = np.sort(probs(lg))[::-1]
    min_p = float((p[2] + p[3]) / 2 / p[0])  # keeps exactly the best 3
    keep, close = allowed(lg, min_p=min_p)
    assert len(keep) == 3 and not close
    toks = _sample_first(gen, [t], 400, temperature=1.0, min_p=min_p)
    assert set(toks) == keep
    (q,) = M.pick_prompts(folder, seed=505, lengths=[20], max_new=2)
    judged = _check_multi_step(folder, gen, q, 40, 6, temperature=1.0, min_p=0.25)
    assert judged >= 200


# --- penalties ----------------------------------------------------------------------------------------

PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.0),
    dict(frequency_penalty=0.6),
    dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
]


@pytest.mark.parametrize("pen", PENALTIES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_penalties_exact(build, make_gen, pen):
    """Greedy under penalties equals the ops.h semantics applied to transformers' logits, and
    differs from plain greedy (the chosen prompt repeats tokens)."""
    folder = build("qwen2_bias_gqa2_tied")  # this fixture's greedy output repeats itself
    gen = make_gen(folder)
    n = 16
    info = M.model_info(folder)
    rng = np.random.default_rng(506)
    for _ in range(100):
        p = M.random_prompt(rng, int(rng.integers(4, 30)), info["vocab_size"], info["specials"])
        plain = M.hf_greedy(folder, p, n)
        ref = M.penalized_greedy(folder, p, n, **pen)
        if ref != plain and _penalized_margin_ok(folder, p, ref, pen):
            break
    else:
        raise AssertionError("fixture: no prompt where the penalty matters")
    (c,) = gen.generate([p], max_tokens=n, temperature=0.0, ignore_eos=True, **pen)
    assert c.token_ids == ref, (c.token_ids, ref, plain)


def _penalized_margin_ok(folder, prompt, ref, pen):
    """The penalized argmax has a gap >= MARGIN at every step."""
    ids = list(prompt)
    out = []
    for t in ref:
        x = M.hf_logits(folder, ids).copy()
        r = pen.get("repetition_penalty", 1.0)
        for s in set(ids):
            x[s] = x[s] / r if x[s] > 0 else x[s] * r
        for s in set(out):
            x[s] -= out.count(s) * pen.get("frequency_penalty", 0.0) + pen.get("presence_penalty", 0.0)
        srt = np.sort(x)[::-1]
        if srt[0] - srt[1] < M.MARGIN:
            return False
        ids.append(t)
        out.append(t)
    return True


def test_huge_presence_penalty_never_repeats(build, make_gen):
    folder = build("qwen2_bias_gqa2_tied")
    gen = make_gen(folder)
    n = 24
    prompts = M.pick_prompts(folder, seed=507, lengths=[5, 30], max_new=n)
    assert any(len(set(M.hf_greedy(folder, p, n))) < n for p in prompts)  # plain greedy repeats
    for p in prompts:
        (c,) = gen.generate([p], max_tokens=n, temperature=0.0, presence_penalty=50.0,
                            ignore_eos=True)
        assert len(c.token_ids) == n
        assert len(set(c.token_ids)) == n, c.token_ids
        (c,) = gen.generate([p], max_tokens=n, temperature=1.0, seed=1, presence_penalty=50.0,
                            ignore_eos=True)
        assert len(set(c.token_ids)) == n, c.token_ids


# --- stop strings ---------------------------------------------------------------------------------

def _stop_string_case(folder, n=12):
    """(prompt ids, greedy ids, stop string, index in text, token index i) where the stop string
    is the last 2 chars of token i + the first 2 of token i+1 and first occurs there."""
    tok = M.hf_tokenizer(str(folder))
    info = M.model_info(folder)
    rng = np.random.default_rng(508)
    cands = [tok.encode(s, add_special_tokens=False) for s in
             ("Once upon a time", "The weather is", "Tell me a joke", "In the middle of")]
    cands += [M.random_prompt(rng, int(rng.integers(2, 20)), info["vocab_size"], info["specials"])
              for _ in range(200)]
    for p in cands:
        if min(M.hf_greedy_margins(folder, p, n)) < M.MARGIN:
            continue
        g = M.hf_greedy(folder, p, n)
        if set(g) & set(info["specials"]):
            continue
        pieces = [tok.decode([t]) for t in g]
        text = tok.decode(g)
        if "".join(pieces) != text or "\ufffd" in text:
            continue
        for i in range(2, 8):
            a, b = pieces[i], pieces[i + 1]
            if len(a) < 2 or len(b) < 2:
                continue
            stop = a[-2:] + b[:2]
            idx = len("".join(pieces[:i + 1])) - 2
            if text.find(stop) == idx:
                return p, g, stop, idx, i
    raise AssertionError("fixture: no stop-string case")


def test_stop_string_across_tokens(folder, gen):
    p, g, stop, idx, i = _stop_string_case(folder)
    tok = M.hf_tokenizer(str(folder))
    text = tok.decode(g)
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    assert c.finish_reason == "stop"
    assert c.text == text[:idx]
    # token_ids end with the token that completed the stop string (at most): nothing generated
    # after the stop belongs to the output.
    assert i + 1 <= len(c.token_ids) <= i + 2 and c.token_ids == g[:len(c.token_ids)]
    # A str stop works like a one-element list; a stop string that never occurs changes nothing.
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0, ignore_eos=True, stop=stop)
    assert c.finish_reason == "stop" and c.text == text[:idx]
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0, ignore_eos=True,
                        stop=["\x00never\x00"])
    assert c.finish_reason == "length" and c.token_ids == g


def test_stop_string_streaming(folder, gen):
    p, g, stop, idx, i = _stop_string_case(folder)
    text = M.hf_tokenizer(str(folder)).decode(g)
    deltas = list(gen.stream(p, max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    got = "".join(d.text for d in deltas)
    assert got == text[:idx]
    assert stop not in got
    assert deltas[-1].finish_reason == "stop"
    toks = [t for d in deltas for t in d.token_ids]
    assert i + 1 <= len(toks) <= i + 2 and toks == g[:len(toks)]


def test_min_tokens_delays_stop_strings(folder, gen):
    """A stop string ends a request only once it has min_tokens tokens, as a stop token id does."""
    p, g, stop, idx, i = _stop_string_case(folder)
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    (c,) = gen.generate([p], min_tokens=i + 2, **kw)  # the stop string ends in token i + 1: min_tokens reached
    assert c.finish_reason == "stop" and len(c.token_ids) == i + 2
    (c,) = gen.generate([p], min_tokens=i + 4, **kw)
    assert len(c.token_ids) >= i + 4 and c.token_ids == g[:len(c.token_ids)]
    assert c.text.startswith(M.hf_tokenizer(str(folder)).decode(g)[:idx + len(stop)])  # the stop string passed


def test_stop_string_ends_each_request_of_a_batch(folder, gen):
    """generate() reads every request with stop strings as its tokens come: a request whose stop string comes
    early ends then, in the engine too, while one before it in the list runs on (read in list order, both ran
    to max_tokens)."""
    import threading
    p, g, stop, idx, i = _stop_string_case(folder)
    (other,) = M.pick_prompts(folder, seed=515, lengths=[5], max_new=4)
    n = 480
    params = [qwen_rt.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
              qwen_rt.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=[stop])]
    outs = []
    t = threading.Thread(target=lambda: outs.extend(gen.generate([other, p], params)))
    t.start()
    seen = set()
    while t.is_alive():
        seen.add(gen.stats()["running"])
        t.join(0.001)
    assert [c.finish_reason for c in outs] == ["length", "stop"] and len(outs[1].token_ids) <= i + 2
    assert 1 in seen, seen  # the stopped request left the batch before the other ended


def test_stop_strings_need_a_tokenizer(build, make_gen):
    gen = make_gen(build("qwen3_mha_untied+notok"))
    assert gen.tokenizer is None
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        gen.generate([[1, 2, 3]], max_tokens=2, stop=["x"])
    (c,) = gen.generate([[1, 2, 3]], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.token_ids) == 2


# --- logprobs -------------------------------------------------------------------------------------

def _check_logprobs(folder, prompt, c, N):
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    all_lg = M.hf_logits(folder, list(prompt) + c.token_ids[:-1], all_positions=True)
    for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
        ref = M.log_softmax(all_lg[len(prompt) - 1 + i])
        keys = {int(k) for k in d}
        assert tok in keys
        top = [int(t) for t in np.argsort(-ref, kind="stable")[:N]]
        assert len(d) == (N if tok in top else N + 1), (i, len(d))
        if np.sort(ref)[::-1][N - 1] - np.sort(ref)[::-1][N] > 1e-4:
            assert set(top) <= keys, (i, top, keys)
        for k, lp in d.items():
            assert abs(lp - ref[int(k)]) < 1e-4, (i, k, lp, ref[int(k)])


def test_logprobs_every_step(folder, gen):
    N = 3
    for p in M.pick_prompts(folder, seed=509, lengths=[2, 33], max_new=8):
        (c,) = gen.generate([p], max_tokens=8, logprobs=N, **GREEDY)
        assert c.token_ids == M.hf_greedy(folder, p, 8)
        assert all(len(d) == N for d in c.logprobs)
        _check_logprobs(folder, p, c, N)
        # Sampled: the chosen token may fall outside the top N (then N + 1 entries). The values
        # are logprobs of the raw logits, whatever the temperature.
        (c,) = gen.generate([p], max_tokens=8, logprobs=N, temperature=1.7, seed=4,
                            ignore_eos=True)
        _check_logprobs(folder, p, c, N)
    (c,) = gen.generate([p], max_tokens=3, **GREEDY)
    assert c.logprobs is None


# --- min_tokens -----------------------------------------------------------------------------------

def test_min_tokens_bans_stop_tokens(folder, gen):
    info = M.model_info(folder)
    eos = set(json_eos(folder))
    n = 8
    for (p,) in (M.pick_prompts(folder, seed=510 + k, lengths=[7], max_new=n) for k in range(20)):
        g = M.hf_greedy(folder, p, n)
        banned = {g[0]} | eos
        ref = M.penalized_greedy(folder, p, n, banned_until=2, banned=tuple(banned))
        # The reference is clear: with the ban, the best tokens are no eos either way.
        ok = ref[0] != g[0] and not set(ref[:2]) & eos and _ban_margin_ok(folder, p, ref, banned)
        if ok:
            break
    else:
        raise AssertionError("fixture: no min_tokens case")
    (c,) = gen.generate([p], max_tokens=n, temperature=0.0, min_tokens=2, stop_token_ids=[g[0]])
    assert len(c.token_ids) >= 2
    assert c.token_ids[0] != g[0]
    assert c.token_ids == ref[:len(c.token_ids)]
    stop_at = next((k for k in range(2, n) if ref[k] in banned), None)
    if stop_at is None:
        assert c.finish_reason == "length" and c.token_ids == ref
    else:
        assert c.finish_reason == "stop" and stop_at <= len(c.token_ids) <= stop_at + 1
    # Without min_tokens the same request stops at once.
    (c,) = gen.generate([p], max_tokens=n, temperature=0.0, stop_token_ids=[g[0]])
    assert c.finish_reason == "stop" and c.token_ids in ([], [g[0]])


def json_eos(folder):
    import json
    from pathlib import Path

    e = json.loads((Path(folder) / "generation_config.json").read_text())["eos_token_id"]
    return e if isinstance(e, list) else [e]


def _ban_margin_ok(folder, prompt, ref, banned):
    ids = list(prompt)
    for k, t in enumerate(ref):
        x = M.hf_logits(folder, ids).copy()
        if k < 2:
            x[list(banned)] = -np.inf
        s = np.sort(x)[::-1]
        if s[0] - s[1] < M.MARGIN:
            return False
        ids.append(t)
    return True
