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


def test_cli_info_prints_its_table(capsys):
    """`qwen-rt info`: the version, the native module, the CUDA backend's state and the packaged configs."""
    from qwen_rt import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for item in ("version", "native module", "CUDA backend", "CUDA devices", "packaged configs", "qwen3-8b"):
        assert item in out, item
