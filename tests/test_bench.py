"""The GPU bench's side-by-side table (pure Python: no GPU)."""
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
