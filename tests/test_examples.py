"""Every program in examples/ runs (on the CPU, on a tiny model with a tokenizer), and the OpenAI-compatible server
answers the official `openai` client as the Generator itself would."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODEL = "qwen3_gqa2_tied"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "QWEN_RT_PROGRESS": "0", "TOKENIZERS_PARALLELISM": "false"}


def run_example(name: str, *args: str) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=300,
                       env=ENV)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_generate(build):
    out = run_example("generate.py", "--model", str(build(MODEL)), "--device", "cpu", "--max-tokens", "5")
    assert "'The capital of France is' ->" in out and out.count("tokens)") == 2


def test_generate_with_a_packaged_config_and_random_weights():
    out = run_example("generate.py", "--model", "qwen3-0.6b", "--load-format", "dummy", "--device", "cpu",
                      "--max-tokens", "3")
    assert "[1, 2, 3] -> [" in out


def test_stream(build):
    out = run_example("stream.py", "Hello", "--model", str(build(MODEL)), "--device", "cpu", "--max-tokens", "6")
    assert out.rstrip().endswith(("[length]", "[stop]"))


def test_chat_tool_call(build):
    out = run_example("chat_tool_call.py", "--model", str(build(MODEL)), "--device", "cpu", "--max-tokens", "8")
    assert '"name": "get_temperature"' in out and "assistant:" in out


def test_async_generate(build):
    out = run_example("async_generate.py", "--model", str(build(MODEL)), "--device", "cpu", "--max-tokens", "5")
    assert "(streamed) ->" in out and out.count("->") == 3


def test_tensor_parallel_on_cpu_threads(build):
    out = run_example("tensor_parallel.py", "--model", str(build(MODEL)), "--tp", "2", "--max-tokens", "8")
    assert "tensor_parallel_size=2" in out and out.rstrip().endswith("same tokens")


# -- the OpenAI-compatible server --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, *args: str):
    """(base_url, process): examples/openai_server.py on 127.0.0.1 serving folder as "tiny", once it answers."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "openai_server.py"), "--model", str(folder),
                             "--served-model-name", "tiny", "--device", "cpu", "--port", str(port),
                             "--max-model-len", "512", "--max-batch-size", "8", *args],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return base, proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{proc.communicate()[0]}")
        time.sleep(0.2)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(build):
    """(base_url, model folder): the server on the tiny model, stopped after the module."""
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    folder = build(MODEL)
    base, proc = start_server(folder)
    try:
        yield base, folder
    finally:
        stop_server(proc)


def slow_model(tiny: Path, into: Path) -> Path:
    """The tiny model's tokenizer over a config large enough that a decode step takes milliseconds (random
    weights): what a disconnect must stop is then still running when the disconnect arrives."""
    import json
    import shutil

    into.mkdir()
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "generation_config")):
            shutil.copy(f, into / f.name)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128)
    (into / "config.json").write_text(json.dumps(cfg))
    return into


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(server, make_gen):
    """The same model in this process: what the server must answer, greedy."""
    return make_gen(server[1], max_model_len=512)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_and_its_stream_equal_the_generator(client, local):
    prompt = "The river flows"
    (want,) = local.generate([prompt], max_tokens=7, temperature=0, ignore_eos=True)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, **GREEDY)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 7 and got.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=7, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_its_stream_equal_the_generator(client, local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = local.chat(messages, max_tokens=6, temperature=0, ignore_eos=True)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **GREEDY)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_concurrent_requests_each_get_their_own_answer(client, local):
    prompts = [f"Story number {i}:" for i in range(6)]
    want = [c.text for c in local.generate(prompts, max_tokens=6, temperature=0, ignore_eos=True)]
    got = [None] * len(prompts)

    def ask(i):
        got[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=6, **GREEDY).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


def test_bad_requests_get_a_400_that_says_why(client, server):
    import openai

    cases = [
        (dict(prompt="hi", temperature=-1.0), "temperature"),
        (dict(prompt="hi", max_tokens=10_000), "max_model_len"),
        (dict(prompt="hi", n=2), "n must be 1"),
    ]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", **kwargs)
        assert e.value.status_code == 400 and words in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError, match="has no 'content'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user"}])
    import httpx

    r = httpx.post(server[0] + "/v1/completions", json={"model": "tiny", "max_tokens": "many"}, timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "prompt: Field required" in message and "max_tokens" in message, message
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="other", prompt="hi")


def test_a_client_that_disconnects_cancels_its_request(build, tmp_path):
    """A stream closed after its first chunk ends its request at once: the engine goes idle after a few of the 480
    steps it was asked for."""
    import httpx
    import openai

    base, proc = start_server(slow_model(build(MODEL), tmp_path / "slow"), "--load-format", "dummy")
    try:
        stats = lambda: httpx.get(base + "/stats", timeout=10).json()  # noqa: E731
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Count:", max_tokens=480, stream=True, **GREEDY)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 60
        while stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        s = stats()
        assert s["running"] == 0 and s["waiting"] == 0
        assert s["steps"] < 100, s
    finally:
        stop_server(proc)
