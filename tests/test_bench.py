"""The benches: the GPU side-by-side table, the CPU bench end to end (with and without torch), the plots (no GPU)."""
import pytest

from qwen_rt.bench_gpu import side_by_side


def test_side_by_side_takes_the_fastest_transformers_run_of_each_batch():
    decode = [
        {"model": "qwen3-8b", "tp": 1, "batch": 1, "e2e_tok_s": 240.0},
        {"model": "qwen3-8b", "tp": 1, "batch": 64, "e2e_tok_s": 7000.0},
        {"model": "qwen3-0.6b", "tp": 1, "batch": 1, "e2e_tok_s": 1100.0},  # no transformers run: left out
    ]
    hf = [
        {"model": "qwen3-8b", "impl": "transformers sdpa static", "batch": 1, "e2e_tok_s": 30.0},
        {"model": "qwen3-8b", "impl": "transformers sdpa static+compile", "batch": 1, "e2e_tok_s": 120.0},
        {"model": "qwen3-8b", "impl": "transformers sdpa static+compile", "batch": 64, "error": "RuntimeError: x"},
        {"model": "qwen3-8b", "impl": "transformers sdpa static", "batch": 64, "e2e_tok_s": 1400.0},
    ]
    rows = side_by_side(decode, hf)
    assert [(r["batch"], r["best_transformers"], r["ratio"]) for r in rows] == [
        (1, "sdpa static+compile", 2.0), (64, "sdpa static", 5.0)]
    assert rows[0]["qwen_rt_e2e_tok_s"] == 240.0 and rows[0]["transformers_e2e_tok_s"] == 120.0


def test_logprob_error_compares_the_tokens_in_both_top_lists():
    import numpy as np

    from qwen_rt.bench import LOGPROB_TOP, _logprob_error

    ref = np.log(np.full((1, 64), 1 / 64))
    ref[0, :LOGPROB_TOP] += 0.5                                  # the reference's top list: tokens 0..19
    top = {0: float(ref[0, 0]) - 0.25, 1: float(ref[0, 1]), 40: 0.0}  # 40: not in the reference's list
    assert _logprob_error([top], ref) == 0.25


def test_cpu_bench_runs_both_engines_and_measures_closeness(tmp_path, capsys):
    """`qwen-rt bench cpu` end to end on a short run: a record with both engines' rows, the ratios, and qwen_rt's
    float32 first-token log-probabilities equal to transformers' (bfloat16 only close)."""
    import json

    from qwen_rt import bench

    rec_path = tmp_path / "rec.jsonl"
    argv = ["cpu", "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--hf-attn", "sdpa",
            "--hf-cache", "dynamic", "--workdir", str(tmp_path / "w"), "--json", str(rec_path)]
    assert bench.main(argv) == 0
    rec = json.loads(rec_path.read_text().splitlines()[-1])
    engines = {(r["engine"], r["dtype"], r["batch"]) for r in rec["results"] if r.get("tok_s")}
    assert {("qwen_rt", d, b) for d in ("float32", "bfloat16") for b in (1, 2)} <= engines
    assert {("transformers", d, b) for d in ("float32", "bfloat16") for b in (1, 2)} <= engines
    assert set(rec["ratio_vs_best_hf"]) == {"1", "2"}
    err = rec["first_logprob_error_vs_hf_float32"]
    assert err["qwen_rt/float32"] < 1e-4
    assert err["qwen_rt/bfloat16"] < 0.2 and err["transformers/bfloat16"] < 0.2
    assert rec["greedy_agreement"]["float32/b2"]["min_common_prefix"] == 4


def test_cpu_bench_phases_times_prefill_and_decode(tmp_path):
    """`qwen-rt bench cpu --phases`: qwen_rt alone on random weights, a record with a prefill row and a decode row per
    batch size and dtype (fp8: the weights quantized at load), each with its time and rate."""
    import json

    from qwen_rt import bench

    rec_path = tmp_path / "rec.jsonl"
    # Four rounds: a decode step is a difference of two timings, which a loaded machine can make negative in one.
    argv = ["cpu", "--phases", "--layers", "2", "--vocab", "4096", "--prefill-len", "16", "--batch-sizes", "1,2",
            "--repeats", "4", "--dtype", "float32,bfloat16,fp8", "--json", str(rec_path)]
    assert bench.main(argv) == 0
    rec = json.loads(rec_path.read_text().splitlines()[-1])
    assert rec["bench"] == "cpu-phases" and rec["model"]["num_hidden_layers"] == 2
    phases = {(r["dtype"], r["phase"]): r for r in rec["rows"]}
    assert set(phases) == {(d, p) for d in ("float32", "bfloat16", "fp8")
                           for p in ("prefill 16", "decode b1", "decode b2")}
    assert all(r["time_ms"] > 0 and r["tok_s"] > 0 for r in rec["rows"])
    assert phases[("float32", "decode b2")]["mbu"] > 0 and phases[("bfloat16", "prefill 16")]["gflop_s"] > 0


def test_cpu_bench_peer_needs_llama_cpp_and_its_converter(monkeypatch):
    """--peer llama.cpp without llama-cpp-python, or without the converter, is a ValueError saying what to give."""
    from qwen_rt import bench, bench_llama_cpp

    monkeypatch.delenv("LLAMA_CPP_CONVERTER", raising=False)
    argv = ["cpu", "--phases", "--layers", "2", "--vocab", "4096", "--prefill-len", "16", "--peer", "llama.cpp"]
    with pytest.raises(ValueError, match="llama"):
        bench.main(argv)
    monkeypatch.setattr(bench_llama_cpp, "missing", lambda: None)
    with pytest.raises(ValueError, match="--peer-converter"):
        bench.main(argv)
    with pytest.raises(ValueError, match="no convert_hf_to_gguf.py"):
        bench.main(argv + ["--peer-converter", "/nonexistent"])


def test_cpu_bench_against_llama_cpp(tmp_path):
    """Where llama-cpp-python and llama.cpp's converter ($LLAMA_CPP_CONVERTER) are present: both engines timed on
    the same weights, every phase, and the ratios recorded."""
    import json
    import os

    from qwen_rt import bench, bench_llama_cpp

    if bench_llama_cpp.missing() or not os.environ.get("LLAMA_CPP_CONVERTER"):
        pytest.skip("an optional peer: llama-cpp-python and $LLAMA_CPP_CONVERTER are not both here")
    rec_path = tmp_path / "rec.jsonl"
    argv = ["cpu", "--phases", "--layers", "2", "--vocab", "4096", "--prefill-len", "32", "--batch-sizes", "1,4",
            "--repeats", "2", "--dtype", "float32,bfloat16,fp8", "--peer", "llama.cpp", "--json", str(rec_path)]
    assert bench.main(argv) == 0
    rec = json.loads(rec_path.read_text().splitlines()[-1])
    engines = {(r["engine"], r["dtype"]) for r in rec["rows"]}
    assert {("llama.cpp", t) for t in ("F32", "BF16", "F16", "Q8_0")} <= engines
    pairs = {(r["qwen_rt"], r["llama.cpp"], r["phase"]) for r in rec["vs_peer"]}
    assert ("bfloat16", "F16", "decode b4") in pairs and ("float32", "F32", "prefill 32") in pairs
    assert ("fp8", "Q8_0", "decode b1") in pairs
    assert all(r["speed_ratio"] > 0 for r in rec["vs_peer"])


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cpu_bench_without_torch_measures_qwen_rt_alone_and_plots(tmp_path, monkeypatch, capsys):
    """Without torch (as after a plain `pip install .`) `qwen-rt bench cpu` runs qwen_rt on random weights it draws
    itself, says why transformers is not measured and how to install it, and draws its plot."""
    import json
    import sys

    from qwen_rt import bench

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    rec_path, png = tmp_path / "rec.jsonl", tmp_path / "cpu.png"
    argv = ["cpu", "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--workdir",
            str(tmp_path / "w"), "--json", str(rec_path), "--plot", str(png)]
    assert bench.main(argv) == 0
    assert "transformers is not measured beside qwen_rt: torch is not installed" in capsys.readouterr().err
    rec = json.loads(rec_path.read_text().splitlines()[-1])
    assert {(r["engine"], r["dtype"], r["batch"]) for r in rec["results"] if r.get("tok_s")} == \
        {("qwen_rt", d, b) for d in ("float32", "bfloat16") for b in (1, 2)}
    assert "download.pytorch.org/whl/cpu" in rec["reference_missing"] and rec["torch"] is None
    assert rec["model"]["params"] == 100_684_032  # the count transformers gives the bench model
    assert rec["limits"]["copy_bw"] > 1e8
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_gpu_record_plots_decode_against_its_roofline_and_prefill_mfu(tmp_path):
    from qwen_rt.bench_plot import _gpu_series, plot_record

    rec = {"device": "H100", "commit": "abc1234", "date": "2026-12-06",
           "decode": [{"model": "qwen3-8b", "batch": b, "decode_tok_s": t, "mbu": m}
                      for b, t, m in ((1, 187.5, 0.96), (64, 8791.0, 0.772))],
           "prefill": [{"model": "qwen3-8b", "prompt": n, "mfu": m} for n, m in ((1024, 0.70), (8192, 0.75))]}
    measured, roofline = _gpu_series(rec)
    assert measured["qwen3-8b"] == ([1, 64], [187.5, 8791.0])
    assert roofline["qwen3-8b roofline"][1] == pytest.approx([187.5 / 0.96, 8791.0 / 0.772])
    plot_record(rec, str(tmp_path / "gpu.png"))
    assert (tmp_path / "gpu.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="no decode or prefill figures"):
        plot_record({"decode": [], "prefill": []}, str(tmp_path / "empty.png"))


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys):
    import sys

    from qwen_rt import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        bench.main(["cpu", "--plot", "never.png"])
    assert "--plot: needs matplotlib, which is not installed (pip install matplotlib)" in capsys.readouterr().err


def test_top20_divergence_compares_positions_while_greedy_tokens_agree():
    """The KL of the FP8 run's top-20 distribution from the reference's, per position until the tokens part."""
    import math
    from types import SimpleNamespace

    from qwen_rt.bench_gpu import top20_divergence

    la = {1: math.log(0.6), 2: math.log(0.4)}
    lb = {1: math.log(0.5), 2: math.log(0.5)}
    a = SimpleNamespace(token_ids=[1, 1, 2], logprobs=[la, la, la])
    b = SimpleNamespace(token_ids=[1, 1, 1], logprobs=[la, lb, lb])
    kls, gaps, agree, steps = top20_divergence(a, b)
    assert (agree, steps) == (2, 3) and len(kls) == 2 and kls[0] == 0.0
    assert math.isclose(kls[1], 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5))
    assert math.isclose(gaps[1], abs(math.log(0.6) - math.log(0.5)))


def test_gemm_shapes_are_the_fused_linears_the_runtime_stores():
    """--parts gemm times the linears as the runtime stores them: gated attention's q|k|v|gate, DeltaNet's
    q|k|v|z, gate|up (from the packaged configs)."""
    from qwen_rt.bench_gpu import gemm_shapes
    hybrid = dict((name, (n, k)) for name, n, k in gemm_shapes("qwen3.8-27b"))
    assert hybrid == {"attention q|k|v|gate": (24 * 256 * 2 + 2 * 4 * 256, 5120), "attention o": (5120, 6144),
                      "mlp gate|up": (2 * 17408, 5120), "mlp down": (5120, 17408),
                      "deltanet q|k|v|z": (2 * 16 * 128 + 2 * 48 * 128, 5120), "deltanet out": (5120, 48 * 128)}
    dense = dict((name, (n, k)) for name, n, k in gemm_shapes("qwen3-8b"))
    assert dense["attention q|k|v"] == (32 * 128 + 2 * 8 * 128, 4096) and "deltanet out" not in dense


def test_time_linear_times_bf16_and_fp8_weights_and_refuses_others():
    from qwen_rt import _core
    h = _core.OpHarness("cpu", "float32")
    assert h.time_linear(3, 48, 256, "fp8", 2) > 0 and h.time_linear(3, 48, 256, "act", 2) > 0
    with pytest.raises(ValueError, match="fp8 or act"):
        h.time_linear(3, 48, 256, "int4", 2)
    with pytest.raises(ValueError, match="positive"):
        h.time_linear(0, 48, 256, "fp8", 2)


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_longctx_bench_decodes_stand_in_contexts_through_the_host_tier(build, monkeypatch, name):
    """bench gpu's longctx part on the CPU (a tiny model in place of the GPU's): stand-in contexts beyond the
    max_position_embeddings (yarn), a host tier sized to each context behind a fixed device pool, sparse attention
    with and without staging; every row has its figures and the host tier holds what the device pool does not."""
    import json

    import numpy as np

    import models as M
    import qwen_rt
    from qwen_rt import bench_gpu

    folder = build(name)
    cfg = json.loads((folder / "config.json").read_text())
    monkeypatch.setattr(bench_gpu, "_text_config", lambda model: cfg)

    def gen(model, **kw):
        kw.pop("tensor_parallel_size", None), kw.pop("quantization", None)
        kw["max_num_batched_tokens"] = 64  # (8,192 on the GPU: a step's pages are held back in the device pool)
        return qwen_rt.Generator(str(folder), device="cpu", dtype="bfloat16", load_format="dummy", progress=False,
                                 **kw)

    monkeypatch.setattr(bench_gpu, "_gen", gen)
    # 120 pages' bytes: the summaries of the host tier's ~150 pages, the staging frames, ~90 device frames; the budget
    # holds the default sink (64 tokens) and window (512) and 4 chosen pages.
    device = M.kv_bytes(folder, 1, 16, 2) * 120
    rows = bench_gpu.bench_longctx("tiny", [2400], [640], 8, -1, np.random.default_rng(0), synthetic_from=2000,
                                   kv_memory=device, staging=(16, 0))
    assert [(r["attention"], r["staging_pages"] > 0) for r in rows] == [("full", False), ("sparse 640", True),
                                                                        ("sparse 640", False)]
    for r in rows:
        # (decode_tok_s: a difference of two timings, noise at this size)
        assert r["prefill_s"] == "synthetic" and r["rope"] == "yarn x5" and isinstance(r["step_ms"], float)
        assert r["pages_read_on_host"] > 0.1
    assert rows[1]["staged"] == 1.0 and 0 < rows[1]["staging_copied"] < 1 and rows[2]["staged"] == 0
    assert rows[1]["selected"] < 0.3
