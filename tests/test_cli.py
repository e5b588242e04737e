"""The command line: `qwen-rt` and `python -m qwen_rt` (the same parser), its tables and its errors."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import models as M
from qwen_rt import cli


def test_cli_info_prints_its_table(capsys):
    """`qwen-rt info`: the version, the native module, the CUDA backend's state and the packaged configs."""
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for item in ("version", "native module", "CUDA backend", "CUDA devices", "packaged configs", "qwen3-8b"):
        assert item in out, item


def test_python_m_qwen_rt_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "qwen_rt", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "packaged configs" in r.stdout


def test_cli_generate_and_its_errors(build, capsys, monkeypatch):
    """A greedy run prints the model's tokens; a value the engine cannot hold is one line naming it, exit code 1,
    not a traceback."""
    monkeypatch.setenv("QWEN_RT_PROGRESS", "1")  # the loading bar tells whether the model loaded
    folder = build("qwen3_gqa2_tied")
    (p,) = M.pick_prompts(folder, seed=700, lengths=[8], max_new=5)
    base = ["generate", "-", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
            "--max-batch-size", "2", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"]
    from qwen_rt.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(folder)
    prompt = tok.decode(p)
    ids = tok.encode(prompt)
    ref = M.hf_greedy(folder, ids, 5)

    def run(extra):
        stdin, sys.stdin = sys.stdin, io.StringIO(prompt)
        try:
            return cli.main(base + extra)
        finally:
            sys.stdin = stdin

    assert run([]) == 0
    out, err = capsys.readouterr()
    assert out == tok.decode(ref) + "\n"
    assert "output tokens" in err and "finish reason" in err
    # Bad flags fail before loading (no progress bar).
    for bad, name, loads in ((["--top-k", str(2**31)], "top_k", False), (["--temperature", "1e39"], "temperature", False),
                             (["--temperature", "1e-7"], "temperature", False),
                             (["--max-batch-size", str(2**31)], "max_batch_size", False),
                             (["--logprobs", "100000"], "logprobs", False)):
        assert run(bad) == 1
        err = capsys.readouterr().err
        assert ("loading weights" in err) == loads, err
        assert err.splitlines()[-1].split("\r")[-1].startswith("qwen-rt: error: ") and name in err, err
        assert "Traceback" not in err


def test_cli_token_ids(build, capsys, monkeypatch):
    """--token-ids: the prompt and the output are token ids (a packaged config has no tokenizer); a text prompt to
    a packaged config, or ids that are not integers, fail before anything loads."""
    monkeypatch.setenv("QWEN_RT_PROGRESS", "1")
    folder = build("qwen3_gqa2_tied")
    (p,) = M.pick_prompts(folder, seed=701, lengths=[6], max_new=4)
    ref = M.hf_greedy(folder, p, 4)
    base = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--max-batch-size", "2",
            "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    for sep, stream in ((" ", []), (",", ["--stream"])):
        assert cli.main(["generate", sep.join(map(str, p)), "--token-ids", "--model", str(folder)] + base + stream) == 0
        out, err = capsys.readouterr()
        assert out.split() == [str(t) for t in ref], out
        assert "output tokens" in err
    for argv, needle in ((["generate", "hello", "--model", "qwen3-0.6b", "--load-format", "dummy"], "--token-ids"),
                         (["generate", "1 2 x", "--token-ids", "--model", str(folder)], "integers"),
                         (["generate", "1 2", "--token-ids", "--chat", "--model", str(folder)], "--chat")):
        assert cli.main(argv + base) == 1
        err = capsys.readouterr().err
        assert err.startswith("qwen-rt: error: ") and needle in err, err
        assert "loading weights" not in err, err


def test_cli_chat_generates_from_the_template(build, capsys):
    """--chat wraps the prompt in the model's chat template (as transformers renders it, with the generation
    prompt): the greedy tokens printed are transformers' on those ids."""
    folder = build("qwen3_gqa2_tied")
    r = M.hf_tokenizer(str(folder)).apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                       add_generation_prompt=True, tokenize=True)
    ids = list(r if isinstance(r, list) else r["input_ids"])
    ref = M.hf_greedy(folder, ids, 4)
    assert cli.main(["generate", "Name a colour.", "--chat", "--model", str(folder), "--device", "cpu",
                     "--dtype", "float32", "--max-model-len", "128", "--max-tokens", "4", "--temperature", "0",
                     "--ignore-eos"]) == 0
    from qwen_rt.tokenizer import Tokenizer

    assert capsys.readouterr().out == Tokenizer.from_dir(folder).decode(ref) + "\n"


def test_cli_runtime_failure_is_one_line(build, capsys, monkeypatch):
    """What the runtime cannot do (out of memory while starting) is one `qwen-rt: error:` line, not a traceback."""
    import qwen_rt

    def no_memory(*a, **k):
        raise RuntimeError("cpu: out of memory")

    monkeypatch.setattr(qwen_rt, "Generator", no_memory)
    folder = build("qwen3_gqa2_tied")
    assert cli.main(["generate", "hi", "--model", str(folder), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "qwen-rt: error: cpu: out of memory", err


def test_cli_bad_flags_and_chat_without_tokenizer(build, capsys, monkeypatch):
    """A flag argparse cannot read, or --chat to a folder without tokenizer.json, is one `qwen-rt: error:` line and
    exit code 1, before anything loads."""
    monkeypatch.setenv("QWEN_RT_PROGRESS", "1")
    folder = build("qwen3_mha_untied+notok")
    for argv, needle in ((["generate", "hi", "--max-tokens", "abc", "--model", str(folder)], "--max-tokens"),
                         (["generate", "hi", "--no-such-flag", "--model", str(folder)], "--no-such-flag"),
                         (["generate", "hi"], "--model"),
                         (["generate", "hi", "--chat", "--model", str(folder)], "tokenizer")):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("qwen-rt: error: ") and needle in err and len(err.strip().splitlines()) == 1, err
        assert "loading weights" not in err, err



def test_cli_engine_flags_reach_the_generator(build, capsys):
    """--quantization, --kv-cache-dtype and --rope-scaling reach Generator: the tokens printed are those Generator
    gives with the same arguments (and the run's tokens differ without --rope-scaling); --sparse-attention with a
    budget above the context, --speculative-tokens 0 and a --kv-offload-memory tier with --kv-staging-pages leave
    them as they are; staging without a host tier and a --rope-scaling that is not JSON are one error line each."""
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    kw = dict(device="cpu", dtype="float32", max_model_len=64, max_batch_size=2, quantization="fp8",
              kv_cache_dtype="fp8")
    (p,) = M.pick_prompts(folder, seed=702, lengths=[40], max_new=4)
    with qwen_rt.Generator(str(folder), rope_scaling=yarn, **kw) as gen:
        want = gen.generate([p], max_tokens=4, temperature=0, ignore_eos=True)[0].token_ids
    argv = ["generate", " ".join(map(str, p)), "--token-ids", "--model", str(folder), "--device", "cpu", "--dtype",
            "float32", "--max-model-len", "64", "--max-batch-size", "2", "--max-tokens", "4", "--temperature", "0",
            "--ignore-eos", "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--rope-scaling", json.dumps(yarn)]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want]
    assert cli.main(argv + ["--sparse-attention", "2048", "--speculative-tokens", "0",
                            "--kv-cache-memory", str(8 << 20), "--kv-offload-memory", str(1 << 20),
                            "--kv-staging-pages", "4"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want]
    assert cli.main(argv + ["--kv-staging-pages", "4"]) == 1  # staging without a host tier: one error line
    err = capsys.readouterr().err
    assert "kv_staging_pages needs" in err and len(err.strip().splitlines()) == 1, err
    assert cli.main(argv[:-2]) == 0  # without --rope-scaling
    assert capsys.readouterr().out.split() != [str(t) for t in want]
    assert cli.main(argv[:-1] + ["{yarn"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qwen-rt: error: --rope-scaling") and len(err.strip().splitlines()) == 1, err
