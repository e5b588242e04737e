"""Hostile or broken input that once crashed, hung or ran out of memory: non-finite logits and weights, models too
big for the machine, an interpreter exit or a fork() while requests run. Cases that could kill the process run in
a subprocess with a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import models as M
import qwen_rt
from qwen_rt import _core

TESTS = Path(__file__).resolve().parent


def run_isolated(code: str, timeout: float = 120.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (tests/ on the path); returns the finished process."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=str(TESTS), env={**os.environ, **(env or {})})


# --- the sampler, for any logits ------------------------------------------------------------------------------

def nonfinite_rows(vocab: int, rng) -> tuple[np.ndarray, list[bool]]:
    """Logit rows, and whether each one's log_softmax is defined."""
    base = rng.normal(0, 2, size=vocab).astype(np.float32)
    rows, defined = [], []

    def add(x, ok):
        rows.append(x.astype(np.float32))
        defined.append(ok)

    add(np.full(vocab, np.nan), False)
    x = base.copy(); x[::7] = np.nan; add(x, False)                  # some NaN
    x = base.copy(); x[3] = np.inf; add(x, False)                    # one +inf
    x = base.copy(); x[[2, 9]] = np.inf; x[5] = np.nan; add(x, False)
    add(np.full(vocab, -np.inf), False)                              # no mass at all
    x = base.copy(); x[:: 2] = -np.inf; add(x, True)                 # -inf is a valid logit
    add(np.full(vocab, np.inf), False)
    add(base.copy(), True)
    return np.stack(rows), defined


PARAMS = [dict(temperature=0.0), dict(temperature=0.7, top_k=20, top_p=0.8), dict(temperature=1.0, top_p=0.5),
          dict(temperature=1.0, top_k=5), dict(temperature=0.6, min_p=0.1, top_p=0.9),
          dict(temperature=1.0, repetition_penalty=1.5, seen_tokens=[0, 1, 2, 3], presence_penalty=1e38,
               frequency_penalty=-3e38, output_tokens=[4, 5], output_counts=[2, 3], banned_tokens=[6]),
          dict(temperature=0.0, banned_tokens=[0, 1], num_logprobs=3), dict(temperature=1e-6, top_k=2, num_logprobs=2)]


def check_sampled(res, logits, defined, params):
    vocab = logits.shape[1]
    toks = np.asarray(res["tokens"])
    lps = np.asarray(res["logprobs"], np.float64)
    assert toks.shape == (len(defined),)
    assert np.all((toks >= 0) & (toks < vocab)), toks
    for i, ok in enumerate(defined):
        assert np.isnan(lps[i]) != ok, (i, params, lps[i])
        if ok:  # a defined row samples as before: never a -inf logit
            assert np.isfinite(logits[i, toks[i]]), (i, params)
        elif np.any(logits[i] == np.inf) and params.get("temperature", 1.0) > 0 and not params.get("seen_tokens"):
            assert logits[i, toks[i]] == np.inf, (i, params)  # the +inf tokens hold all the mass


def test_sampler_defined_for_any_logits():
    """Every logit row (NaN, +inf, all -inf) under every parameter mix gives a token in range; a row whose
    log_softmax is undefined says so with a NaN logprob. (All-NaN logits with top_k and top_p crashed the CPU
    sampler: the top_p pass read the first of no kept tokens.)"""
    p = run_isolated("""
        import json, numpy as np
        from qwen_rt import _core
        import test_hardening as T
        h = _core.OpHarness("cpu", "float32")
        for vocab in (50, 1000):
            logits, defined = T.nonfinite_rows(vocab, np.random.default_rng(vocab))
            for params in T.PARAMS:
                rows = [dict(params, seed=i, draw=i) for i in range(len(logits))]
                T.check_sampled(h.sample(logits, rows), logits, defined, params)
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout[-2000:], p.stderr[-2000:])


def test_sampler_infinite_maximum_is_deterministic():
    """+inf logits take all the mass: the lowest id of them, whatever the seed (ops.h)."""
    h = _core.OpHarness("cpu", "float32")
    x = np.zeros((1, 64), np.float32)
    x[0, [40, 17, 33]] = np.inf
    for params in (dict(temperature=1.0), dict(temperature=0.5, top_p=0.3), dict(temperature=2.0, top_k=10, top_p=0.9)):
        toks = [h.sample(x, [dict(params, seed=s, draw=s)])["tokens"][0] for s in range(8)]
        assert toks == [17] * 8, (params, toks)


@pytest.mark.cuda
def test_cuda_sampler_matches_cpu_for_any_logits():
    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    cpu, gpu = _core.OpHarness("cpu", "float32"), _core.OpHarness("cuda:0", "float32")
    for vocab in (50, 1000, 151936):
        logits, defined = nonfinite_rows(vocab, np.random.default_rng(vocab))
        for params in PARAMS:
            rows = [dict(params, seed=i, draw=i) for i in range(len(logits))]
            a, b = cpu.sample(logits, rows), gpu.sample(logits, rows)
            check_sampled(b, logits, defined, params)
            lb, la = np.asarray(b["logprobs"]), np.asarray(a["logprobs"])
            assert np.array_equal(np.isnan(lb), np.isnan(la)), params
            ok = np.array(defined)
            assert list(np.asarray(b["tokens"])[ok]) == list(np.asarray(a["tokens"])[ok]), params


# --- non-finite weights and logits ------------------------------------------------------------------------------

UNTIED = "qwen3_mha_untied"  # the LM head is not the embedding: a NaN embedding row poisons only prompts with it
UNTIED_CUDA = "qwen3_hd64_gqa4"  # the same, in head sizes the CUDA kernels take
GREEDY = dict(temperature=0.0, ignore_eos=True)


def poisoned(build, tmp_path, name: str, edit) -> Path:
    """A copy of fixture model `name` whose state dict `edit` changes in place (dtype kept)."""
    f = M.copy_folder(build(name), tmp_path / "m")
    st = M.load_state(f)
    edit(st)
    M.save_state(f, st)
    return f


@pytest.mark.parametrize("tensor,where,value,dtype", [
    ("model.layers.1.mlp.down_proj.weight", (3, 5), float("nan"), torch.float32),
    ("model.layers.0.self_attn.q_proj.weight", (0, 0), float("inf"), torch.bfloat16),
    ("model.norm.weight", (7,), float("-inf"), torch.float16),
    ("model.embed_tokens.weight", (-1, -1), float("nan"), torch.bfloat16),
])
def test_check_weights_names_the_tensor(build, tmp_path, tensor, where, value, dtype):
    def edit(st):
        for k in st:
            st[k] = st[k].to(dtype)
        st[tensor][where] = value
    f = poisoned(build, tmp_path, UNTIED, edit)
    kw = M.base_kwargs(f, max_batch_size=2, dtype="float32")
    with pytest.raises(ValueError, match=rf"tensor '{tensor}' holds a NaN or inf"):
        qwen_rt.Generator(str(f), **kw)
    with qwen_rt.Generator(str(f), **kw, check_weights=False) as g:  # the caller's choice: it loads
        try:
            assert g.generate([[5, 6]], max_tokens=1, **GREEDY)[0].finish_reason == "length"
        except RuntimeError as e:  # and a request that meets the value fails alone
            assert "non-finite logits" in str(e)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_nonfinite_logits_fail_only_their_request(build, tmp_path, device):
    """A NaN in one embedding row: a request whose prompt holds that token fails with a RuntimeError naming
    non-finite logits; the requests beside it in the same steps get transformers' tokens, and the engine serves
    on."""
    if device == "cuda" and _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    name = UNTIED_CUDA if device == "cuda" else UNTIED
    src = build(name)
    good = M.pick_prompts(src, seed=281, lengths=[9, 12], max_new=8)
    refs = [M.hf_greedy(src, p, 8) for p in good]
    bad_token = next(t for t in range(3, 100) if all(t not in p + r for p, r in zip(good, refs)))
    f = poisoned(build, tmp_path, name, lambda st: st["model.embed_tokens.weight"][bad_token].fill_(float("nan")))
    with qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=4, device=device), check_weights=False) as g:
        for params in (GREEDY, dict(temperature=0.7, top_k=20, top_p=0.8, ignore_eos=True)):
            reqs = [g.submit(good[0], max_tokens=8, **GREEDY), g.submit([5, bad_token, 6], max_tokens=8, **params),
                    g.submit(good[1], max_tokens=8, **GREEDY)]
            with pytest.raises(RuntimeError, match="non-finite logits"):
                reqs[1].result()
            assert reqs[1].finish_reason == "error"
            assert [reqs[0].result().token_ids, reqs[2].result().token_ids] == refs
        assert [c.token_ids for c in g.generate(good, max_tokens=8, **GREEDY)] == refs
        assert g.stats()["running"] == 0


# --- memory: estimated before anything is allocated -------------------------------------------------------------

def peak_rss_of(code: str, timeout: float = 120.0) -> tuple[subprocess.CompletedProcess, int]:
    """Runs code isolated; returns the process and its peak resident memory in bytes. (/proc's VmHWM: getrusage's
    ru_maxrss keeps the forking test process's peak across exec, so it failed whenever that one was large.)"""
    peak = "int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024"
    p = run_isolated("import re\n" + textwrap.dedent(code) + f"\nprint('rss', {peak})", timeout)
    rss = [int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("rss ")]
    return p, (rss[0] if rss else -1)


def huge_dummy_folder(tmp_path) -> Path:
    """A config-only folder of a Qwen3-32B with 2,048 layers (~1.6e12 parameters): more than any device holds."""
    cfg = json.loads((Path(qwen_rt.__file__).parent / "configs" / "qwen3-32b.json").read_text())
    cfg["num_hidden_layers"] = 2048
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "huge"


def refused_quickly(folder: Path, device: str) -> str:
    """The ValueError a dummy load of folder on device raises, in a subprocess whose time and memory are bounded."""
    p, rss = peak_rss_of(f"""
        import qwen_rt, time
        t = time.monotonic()
        try:
            qwen_rt.Generator({str(folder)!r}, load_format="dummy", device={device!r}, progress=False)
        except ValueError as e:
            print("refused", round(time.monotonic() - t, 3), e)
    """)
    assert "refused" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    msg = p.stdout.split("refused", 1)[1]
    assert float(msg.split()[0]) < 30, msg
    # Nothing of the model's size is taken; the CUDA plugin's own libraries (cuBLAS, NCCL) take ~2 GB on the host.
    assert rss < (4 << 30 if device == "cuda" else 2 << 30), rss
    return msg


def test_too_big_for_the_machine_is_refused_up_front(tmp_path):
    """A model whose weights cannot fit is refused at once, with what it needs and what the device has (dummy
    qwen3-8b on a 24 GiB machine ran for minutes into "cpu: out of memory")."""
    msg = refused_quickly(huge_dummy_folder(tmp_path), "cpu")
    assert "needs at least" in msg and "bytes available" in msg, msg
    weights = int(msg.split("weights ")[1].split(",")[0])
    assert weights > 1.5e12, msg  # ~1e12 parameters in bf16


@pytest.mark.cuda
def test_too_big_for_the_gpu_is_refused_up_front(tmp_path):
    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    msg = refused_quickly(huge_dummy_folder(tmp_path), "cuda")
    assert "needs at least" in msg and "cuda:0 has" in msg, msg


@pytest.mark.cuda
def test_check_weights_on_cuda(build, tmp_path):
    """The GPU path scans each piece before its upload."""
    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    def edit(st):
        st["model.layers.1.mlp.up_proj.weight"][5, 6] = float("nan")
    f = poisoned(build, tmp_path, UNTIED_CUDA, edit)
    kw = dict(device="cuda", max_batch_size=2, max_model_len=64, progress=False)
    with pytest.raises(ValueError, match="tensor 'model.layers.1.mlp.up_proj.weight' holds a NaN or inf"):
        qwen_rt.Generator(str(f), **kw)
    with qwen_rt.Generator(str(f), **kw, check_weights=False) as g:
        with pytest.raises(RuntimeError, match="non-finite logits"):
            g.generate([[5, 6, 7]], max_tokens=2, temperature=0.0)
        assert g.stats()["running"] == 0


def test_config_sizes_are_checked_against_the_checkpoint_before_allocating(build, tmp_path):
    """vocab_size 1e7 over a 1000-row embedding: the shape error comes before any allocation (it came after
    2.5 GB)."""
    f = M.copy_folder(build(UNTIED), tmp_path / "m")
    M.edit_json(f / "config.json", lambda c: c.update(vocab_size=10_000_000))
    p, rss = peak_rss_of(f"""
        import qwen_rt
        try:
            qwen_rt.Generator({str(f)!r}, device="cpu", max_batch_size=2, progress=False)
        except ValueError as e:
            print("refused", e)
    """)
    assert "refused" in p.stdout and "model.embed_tokens.weight' has shape" in p.stdout, p.stdout + p.stderr[-2000:]
    assert rss < 1 << 30, rss


def test_huge_max_position_embeddings_is_capped_by_the_pool(build, tmp_path):
    """max_position_embeddings 1e8: the RoPE table and page tables are sized by what the KV pool can hold (the
    table was built for every position first: 40 s and 12.5 GB)."""
    f = M.copy_folder(build(UNTIED), tmp_path / "m")
    M.edit_json(f / "config.json", lambda c: c.update(max_position_embeddings=100_000_000))
    kv = M.kv_bytes(f, 64)
    p, rss = peak_rss_of(f"""
        import qwen_rt, time
        t = time.monotonic()
        g = qwen_rt.Generator({str(f)!r}, device="cpu", max_batch_size=4, kv_cache_memory={kv}, progress=False)
        print("len", g.max_model_len, round(time.monotonic() - t, 2))
        print("out", g.generate([[5, 6, 7]], max_tokens=4, temperature=0.0)[0].finish_reason)
        g.close()
    """)
    assert "len 1025 " in p.stdout and "out length" in p.stdout, p.stdout + p.stderr[-2000:]
    assert float(p.stdout.split("len 1025 ")[1].split()[0]) < 10
    assert rss < 2 << 30, rss


@pytest.mark.parametrize("name,kw", [(UNTIED, dict(dtype="float32")), ("qwen2_bias_gqa2_tied", dict(dtype="float32")),
                                     (UNTIED, dict(dtype="bfloat16")), (UNTIED, dict(tensor_parallel_size=2)),
                                     ("qwen35_hybrid", dict(dtype="float32")),
                                     ("qwen35_mixed_tied", dict(dtype="bfloat16")),
                                     ("qwen35_hybrid", dict(tensor_parallel_size=2))])
def test_footprint_is_what_the_model_allocates(build, make_gen, name, kw):
    """The estimate's weights are exactly the bytes the model holds (model/footprint.cpp mirrors its loading)."""
    f = build(name)
    g = make_gen(f, max_batch_size=4, **kw)
    from qwen_rt.config import native_config
    n = kw.get("tensor_parallel_size", 1)
    wdt = kw.get("dtype", "float32")
    fp = _core.footprint(native_config(g.config), n, wdt, "float32", "float32", False, 2048, 4, 32, 16)
    assert int(fp["weights"]) == g.stats()["weight_bytes"]


# --- the process: exit and fork while requests run ---------------------------------------------------------------

def test_exit_while_daemon_threads_wait(build):
    """Daemon threads inside generate(), stream() and Request.result() when the main thread ends: the process exits
    0 (it aborted, "terminate called without an active exception": a thread ended inside a native wait). torch is
    imported, as its slower teardown is what let the waits time out during finalization."""
    f = build(UNTIED)
    p = run_isolated(f"""
        import threading, time, torch, qwen_rt
        g = qwen_rt.Generator({str(f)!r}, device="cpu", dtype="float32", max_batch_size=4, progress=False,
                              kv_cache_memory=1 << 26)
        n = g.max_model_len - 4
        def gen(): g.generate([[5, 6, 7]] * 64, max_tokens=n, ignore_eos=True)
        def stream():
            for _ in g.stream([5, 6, 7], max_tokens=n, ignore_eos=True): pass
        def result(): g.submit([5, 6, 7], max_tokens=n, ignore_eos=True).result()
        threads = [threading.Thread(target=fn, daemon=True) for fn in (gen, gen, stream, result)]
        for t in threads:  # generate()'s 128 requests first: the stream's and result()'s wait behind them
            t.start()
            time.sleep(0.05)
        time.sleep(0.3)
        print("alive", sum(t.is_alive() for t in threads))
    """, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "alive 4" in p.stdout and "terminate" not in p.stderr and "leaked" not in p.stderr, (p.stdout, p.stderr)


def test_fork_child_gets_a_clear_error(build):
    """generate() in a fork()ed child hung forever (the engine's threads stay in the parent): a RuntimeError that
    says so; the child exits cleanly and the parent's Generator serves on."""
    f = build(UNTIED)
    p = run_isolated(f"""
        import os, qwen_rt
        g = qwen_rt.Generator({str(f)!r}, device="cpu", dtype="float32", max_batch_size=4, progress=False,
                              kv_cache_memory=1 << 22)
        before = g.generate([[5, 6, 7]], max_tokens=3, temperature=0.0)[0].token_ids
        import threading, time
        busy = threading.Thread(target=lambda: g.generate([[5, 6, 7]] * 8, max_tokens=20), daemon=True)
        busy.start()  # a thread inside a native wait while the process forks
        time.sleep(0.05)
        pid = os.fork()
        if pid == 0:
            try:
                g.generate([[5, 6, 7]], max_tokens=3)
                os._exit(3)
            except RuntimeError as e:
                ok = "fork" in str(e)
            r = None
            try:
                g.stats()
            except RuntimeError:
                r = "stats refused"
            g.close()  # leaks the parent's engine: no thread to join here
            if not (ok and r):
                os._exit(4)
            raise SystemExit(0)  # the interpreter's exit (atexit) in the child: prompt, not waiting for the parent's
        t = time.monotonic()
        busy.join()
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), "in", round(time.monotonic() - t, 1))
        print("same", g.generate([[5, 6, 7]], max_tokens=3, temperature=0.0)[0].token_ids == before)
        g.close()
    """, timeout=60)
    assert p.returncode == 0 and "child 0 in" in p.stdout and "same True" in p.stdout, (p.stdout, p.stderr[-3000:])
    assert float(p.stdout.split("child 0 in ")[1].split()[0]) < 5, p.stdout  # its exit waits for no parent thread


# --- config values and model files: ValueError naming the field -------------------------------------------------

def _yarn(factor):
    return lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": factor, "rope_theta": 1e6,
                                               "original_max_position_embeddings": 256})


def _qwen2_heads(c, heads):
    """A Qwen2 config (head_dim: hidden_size / heads) with `heads` attention heads."""
    c.pop("head_dim", None)
    c.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_attention_heads=heads)


def _legacy_sliding(c, use):
    """A config without layer_types (before transformers 5), whose use_sliding_window is `use`."""
    c.pop("layer_types", None)
    c["use_sliding_window"] = use


# (config.json edit, what the message must name)
BAD_CONFIGS = [
    (lambda c: _qwen2_heads(c, 0), "num_attention_heads"),  # was ZeroDivisionError (hidden_size // heads)
    (lambda c: c.update(hidden_size=2**31), "hidden_size"),               # was nanobind's TypeError
    (lambda c: c.update(intermediate_size=2**40), "intermediate_size"),
    (lambda c: c.update(num_hidden_layers=2**31 - 1), "layers.3.input_layernorm"),  # the checkpoint has 3
    (lambda c: c.update(hidden_size=64.7), "hidden_size"),                # was truncated to 64
    (lambda c: c.update(hidden_size="64"), "hidden_size"),
    (lambda c: c.update(vocab_size=True), "vocab_size"),
    (lambda c: c.update(head_dim=7), "head_dim"),
    (lambda c: c.update(head_dim=2**30), "head_dim"),
    (lambda c: c.update(max_position_embeddings=-1), "max_position_embeddings"),
    (lambda c: c.update(tie_word_embeddings="false"), "tie_word_embeddings"),
    (lambda c: c.update(architectures=5), "architectures"),
    (lambda c: c.update(architectures=[["Qwen3ForCausalLM"]]), "architectures"),
    (lambda c: c.update(rms_norm_eps="x"), "rms_norm_eps"),
    (lambda c: c.update(rope_theta=1e39, rope_parameters=None), "rope_theta"),
    (_yarn(0), "factor"), (_yarn(-1), "factor"), (_yarn(float("nan")), "NaN|factor"), (_yarn(1e30), "factor"),
    (lambda c: c.update(eos_token_id="2"), "eos_token_id"),
    (lambda c: _legacy_sliding(c, "yes"), "use_sliding_window"),
    (lambda c: c.update(layer_types="full_attention"), "layer_types"),
]


@pytest.mark.parametrize("i", range(len(BAD_CONFIGS)))
def test_bad_config_values_name_the_field(build, tmp_path, i):
    edit, name = BAD_CONFIGS[i]
    f = M.copy_folder(build(UNTIED), tmp_path / "m")
    kw = M.base_kwargs(f, max_batch_size=2)
    M.edit_json(f / "config.json", edit)
    with pytest.raises(ValueError, match=name):
        qwen_rt.Generator(str(f), **kw, progress=False)


@pytest.mark.parametrize("case", ["nested-config", "tokenizer-config-list", "template-not-utf8", "gen-temperature",
                                  "gen-eos"])
def test_bad_model_files_name_the_file(build, tmp_path, case):
    f = M.copy_folder(build(UNTIED), tmp_path / "m")
    kw = M.base_kwargs(f, max_batch_size=2)
    if case == "nested-config":  # was RecursionError
        (f / "config.json").write_text('{"a":' + "[" * 100000 + "]" * 100000 + "}")
        match = "config.json.*not valid JSON"
    elif case == "tokenizer-config-list":
        (f / "tokenizer_config.json").write_text("[1, 2]")
        match = "tokenizer_config.json: not a JSON object"
    elif case == "template-not-utf8":
        (f / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
        match = "chat_template.jinja: not UTF-8"
    elif case == "gen-temperature":
        M.edit_json(f / "generation_config.json", lambda c: c.update(temperature="0.7"))
        match = "generation_config.json: temperature"
    else:
        M.edit_json(f / "generation_config.json", lambda c: c.update(eos_token_id=[1, "2"]))
        match = "generation_config.json's eos_token_id"
    with pytest.raises(ValueError, match=match):
        qwen_rt.Generator(str(f), **kw, progress=False)


def test_bad_text_and_arguments(build, make_gen):
    f = build(UNTIED)
    g = make_gen(f, max_batch_size=4)
    with pytest.raises(ValueError, match=r"lone surrogate \(U\+D800 at index 2\)"):  # was the tokenizer's TypeError
        g.generate("ab\ud800c", max_tokens=2)
    with pytest.raises(ValueError, match=r"lone surrogate \(U\+DC00"):
        g.chat([{"role": "user", "content": "x\udc00"}], max_tokens=2)
    with pytest.raises(ValueError, match="num_threads must be <= 1024"):  # was an unrelated error
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2), num_threads=100000)
    assert g.generate([[5, 6]], max_tokens=2, temperature=0.0)[0].finish_reason == "length"


def test_chat_template_work_is_bounded(build, make_gen):
    """Nested range(100000) loops hung the caller: a ValueError once the template passes its loop bound."""
    import time
    g = make_gen(build(UNTIED), max_batch_size=4)
    msgs = [{"role": "user", "content": "hi" * 300}]
    for tpl in ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                "{% set r = range(1000) %}{% for a in r %}{% for b in r %}{% for c in r %}{% endfor %}{% endfor %}"
                "{% endfor %}",
                "{% for a in messages[0].content %}{% for b in messages[0].content %}{% for c in messages[0].content %}"
                "{% endfor %}{% endfor %}{% endfor %}",
                "{{ 'x' * 10 ** 9 }}", "{{ 2 ** 100000000 }}", "{% for i in range(9000) %}{{ 'y' * 10000 }}{% endfor %}",
                "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ range(10 ** 9) | list }}"):
        t = time.monotonic()
        with pytest.raises(ValueError, match="chat template failed"):
            g.chat_prompt(msgs, chat_template=tpl)
        assert time.monotonic() - t < 10, tpl
    # An ordinary template still renders.
    assert g.tokenizer.apply_chat_template(msgs, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                                           add_generation_prompt=False) == "hi" * 300


def test_many_stop_strings_cost_per_distinct_length():
    """100,000 stop strings cost 1.6 ms of matching a token when each was searched: now a set lookup per distinct
    length and character (a generous bound: 1,000 feeds in 0.5 s, they took 1.6 s)."""
    import time
    from qwen_rt.tokenizer import StopMatcher
    rng = np.random.default_rng(9)
    stops = ["".join(rng.choice(list("abcdefghij"), size=int(n))) + "#" for n in rng.integers(4, 12, size=100_000)]
    m = StopMatcher(stops)
    StopMatcher(stops)  # the index is built once per stop list
    t = time.monotonic()
    out = "".join(m.feed(" tok")[0] for _ in range(1000))
    assert time.monotonic() - t < 0.5
    assert out == " tok" * 1000 and not m.stopped
    piece, stopped = m.feed(" " + stops[123])
    assert stopped and m.matched == stops[123] and piece == " "
