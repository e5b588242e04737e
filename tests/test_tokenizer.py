import itertools
import json
import random

import pytest

from qwen_rt.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? naïve façade über straße",
    "你好，世界。今天天气很好。",
    "emoji 🙂 🚀 🇫🇷 and symbols € £ ¥ — “quotes”",
    "def f(x):\n    return x * 2\n\n",
    "Tell me a joke about tokenizers.",
] * 20

# Qwen3-style ChatML template: namespace, reversed loop, tools | tojson, thinking, whitespace control.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Plain ChatML without "-" whitespace control: depends on trim_blocks / lstrip_blocks; uses loopcontrols,
# eos_token and raise_exception.
CHATML_TEMPLATE = """{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
  {% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
  {% if message.get('skip') %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}{{ (' (' + message['name'] + ')') if 'name' in message else '' }}
{{ message['content'] }}<|im_end|>
  {% if message.get('last') %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}{% if eos_in_prompt is defined %}{{ eos_token }}{% endif %}"""


def _train(tmp_path, template=QWEN3_TEMPLATE, config_extra=None, jinja_file=None):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "rstrip": False,
                         "normalized": False, "single_word": False, "special": True}, "unk_token": None,
           "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(config_extra or {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return Tokenizer.from_dir(tmp_path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    _train(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_basics(tok, tok_dir):
    from tokenizers import Tokenizer as HFTok

    ref = HFTok.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    assert tok.eos_token_ids == [ref.token_to_id("<|im_end|>")]
    assert tok.pad_token_id == ref.token_to_id("<|endoftext|>")
    text = "héllo wörld 你好 🙂<|im_end|>"
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False).ids
    assert ids[-1] == tok.eos_token_ids[0]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "héllo wörld 你好 🙂"


def test_from_dir_without_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
    assert Tokenizer.from_dir(None) is None


def test_eos_as_dict_and_missing_config(tmp_path):
    t = _train(tmp_path, config_extra={"eos_token": {"content": "<|endoftext|>"}})
    assert t.eos_token_ids == [t.token_to_id("<|endoftext|>")]
    (tmp_path / "tokenizer_config.json").unlink()
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == [] and t.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


# -- incremental detokenization ----------------------------------------------------------------------

def _stream(tok, ids, chunks, skip=True):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out, i, max_window = [], 0, 0
    for n in chunks:
        piece = det.push(ids[i:i + n])
        i += n
        out.append(piece)
        max_window = max(max_window, len(det.ids) - det.prefix_offset)
    assert i == len(ids)
    out.append(det.flush())
    return out, max_window


MULTIBYTE = "héllo wörld 你好 🙂"


@pytest.mark.parametrize("skip", [True, False])
def test_detok_multibyte_every_token(tok, skip):
    text = MULTIBYTE + "<|im_end|> again: 🇫🇷€ done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multibyte chars span several tokens
    pieces, _ = _stream(tok, ids, [1] * len(ids), skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    # nothing incomplete is ever emitted before the end
    assert not any("\ufffd" in p for p in pieces)
    # every emitted prefix is a prefix of the full text
    full = tok.decode(ids, skip_special_tokens=skip)
    acc = ""
    for p in pieces:
        acc += p
        assert full.startswith(acc)


def test_detok_each_split_point(tok):
    ids = tok.encode(MULTIBYTE)
    full = tok.decode(ids)
    for k in range(len(ids) + 1):
        pieces, _ = _stream(tok, ids, [k, len(ids) - k])
        assert "".join(pieces) == full


def test_detok_random_streams(tok):
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(0, 40)
        ids = [rng.randrange(tok.vocab_size) for _ in range(n)]  # includes lone bytes and specials
        chunks = []
        left = n
        while left:
            c = min(left, rng.choice([1, 1, 1, 2, 3, 5]))
            chunks.append(c)
            left -= c
        skip = bool(trial % 2)
        pieces, _ = _stream(tok, ids, chunks, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), (ids, chunks)


def test_detok_window_is_bounded(tok):
    text = " ".join(CORPUS[:6]) * 10
    ids = tok.encode(text)
    assert len(ids) > 500
    calls = []
    orig = tok.decode

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return orig(ids, skip_special_tokens=skip_special_tokens)

    det = IncrementalDetokenizer(Spy())
    out = [det.push([i]) for i in ids] + [det.flush()]
    assert "".join(out) == tok.decode(ids)
    assert max(calls) <= 12  # never the whole sequence


class _Bytes:
    """A byte-level tokenizer stub: id i decodes to PIECES[i]; a decode joins the bytes and replaces what is not
    UTF-8 with U+FFFD (as byte-level BPE decoders do)."""
    PIECES = [b"STO", b"P\xc3", b"\xa9!", b"\xe4", b"\xbd", b"\xa0", b"ok", b"\xc3", b"\xf0\x9f", b"\x99\x82", b"\x80"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_detok_emits_complete_characters_before_an_incomplete_one():
    det = IncrementalDetokenizer(_Bytes())
    # "P" arrives with the token that also starts "é": it is emitted with that token, not one later.
    assert [det.push([i]) for i in (0, 1, 2)] == ["STO", "P", "é!"]
    det = IncrementalDetokenizer(_Bytes())
    assert [det.push([i]) for i in (6, 3, 4, 5, 6)] == ["ok", "", "", "你", "ok"]
    assert det.flush() == "" and det.text == "ok你ok"
    det = IncrementalDetokenizer(_Bytes())
    assert [det.push([i]) for i in (1, 7)] == ["P", ""]
    assert det.flush() == "\ufffd\ufffd" and det.text == _Bytes().decode([1, 7])


def _byte_stub_streams(rng, trials, max_len):
    """Random id streams of _Bytes pushed one id at a time: each emitted prefix is a prefix of the full decode,
    and everything emitted is the full decode."""
    stub = _Bytes()
    for _ in range(trials):
        ids = [rng.randrange(len(_Bytes.PIECES)) for _ in range(rng.randint(0, max_len))]
        full = stub.decode(ids)
        det, acc = IncrementalDetokenizer(stub), ""
        for i in ids:
            acc += det.push([i])
            assert full.startswith(acc), (ids, acc)
        assert acc + det.flush() == full, ids


def test_detok_byte_stub_random_streams():
    _byte_stub_streams(random.Random(1), 2000, 12)


def test_detok_bytes_that_never_form_utf8_keep_the_window_short():
    """A stream whose text always ends in U+FFFD (lone continuation bytes) is emitted as it comes, and each push
    decodes a short window, not the whole stream."""
    calls, stub = [], _Bytes()

    class Spy:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return stub.decode(ids)

    det = IncrementalDetokenizer(Spy())
    ids = [10] * 3000  # b"\x80" each
    out = [det.push([i]) for i in ids]
    assert len(det.text) >= 3000 - IncrementalDetokenizer.HELD_IDS - 1  # emitted while streaming, not at flush
    out.append(det.flush())
    assert "".join(out) == stub.decode(ids)
    assert max(calls) <= 2 * IncrementalDetokenizer.HELD_IDS + 4


@pytest.mark.parametrize("held", [0, 1, 3])
def test_detok_settling_keeps_the_text_of_a_full_decode(tok, monkeypatch, held):
    """With the settling threshold at its smallest, random streams (lone bytes, characters split across ids,
    specials) still emit exactly a full decode's text, each emitted prefix a prefix of it."""
    monkeypatch.setattr(IncrementalDetokenizer, "HELD_IDS", held)
    rng = random.Random(2 + held)
    _byte_stub_streams(rng, 1500, 30)
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        skip = bool(trial % 2)
        pieces, _ = _stream(tok, ids, [1] * len(ids), skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


def test_stop_string_seen_at_the_token_that_completes_it():
    # The stop "STOP" ends inside token 1, whose bytes also start "é": the stream stops at token 1.
    det, m = IncrementalDetokenizer(_Bytes()), StopMatcher(["STOP"])
    seen = [m.feed(det.push([i])) for i in (0, 1)]
    assert seen == [("", False), ("", True)]


# -- stop strings --------------------------------------------------------------------------------------

def _reference_stop(text, stops):
    # The stop whose first occurrence ends earliest (ties: longest); text before it.
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end - len(s)], True
    return text, False


def _feed_all(stops, parts):
    m = StopMatcher(stops)
    out, stopped = [], False
    for p in parts:
        o, stopped = m.feed(p)
        out.append(o)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


STOP_CASES = [
    ("Hello world. User: hi", ["User:"]),
    ("abcabcabd tail", ["abd"]),
    ("aaaab", ["aab"]),
    ("no stop here at all", ["STOP", "\n\n"]),
    ("ends with a partial sto", ["stop"]),
    ("x abcd y", ["abcd", "bc"]),
    ("x abcd y", ["cd", "abcd"]),
    ("multi\n\nline", ["\n\n", "line"]),
    ("你好🙂世界", ["🙂世", "界"]),
    ("stop at start", ["stop"]),
]


@pytest.mark.parametrize("text,stops", STOP_CASES)
def test_stop_every_split(text, stops):
    expect = _reference_stop(text, stops)
    assert _feed_all(stops, [text]) == expect
    n = len(text)
    for i, j in itertools.combinations(range(n + 1), 2):
        assert _feed_all(stops, [text[:i], text[i:j], text[j:]]) == expect, (i, j)
    assert _feed_all(stops, list(text)) == expect
    if expect[1]:
        assert not any(s in expect[0] for s in stops)


def test_stop_random():
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5))))
        parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _feed_all(stops, parts) == _reference_stop(text, stops), (text, stops, parts)


def test_stop_holds_back_only_prefixes():
    m = StopMatcher(["</answer>"])
    assert m.feed("result: 42 <") == ("result: 42 ", False)
    assert m.feed("/ans") == ("", False)
    assert m.feed("wer-ish") == ("</answer-ish", False)
    assert m.feed("</answer> trailing") == ("", True)
    assert m.matched == "</answer>"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""
    m = StopMatcher(["END"])
    assert m.feed("the EN") == ("the ", False)
    assert m.flush() == "EN"


def test_stop_no_stops_and_bad_input():
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False) and m.flush() == ""
    with pytest.raises(ValueError):
        StopMatcher([""])


# -- chat templates --------------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo 你好 🙂"}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "tool", "content": "sunny"},
     {"role": "assistant", "content": "21 and sunny", "reasoning_content": "it said so", "tool_calls": None}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _hf(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("agp", [True, False])
def test_chat_template_matches_transformers(tok, tok_dir, conv, agp):
    hf = _hf(tok_dir)
    msgs = CONVERSATIONS[conv]
    for kw in ({}, {"enable_thinking": False}, {"tools": TOOLS}, {"tools": TOOLS, "enable_thinking": True}):
        ours = tok.apply_chat_template(msgs, add_generation_prompt=agp, **kw)
        ref = hf.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False, **kw)
        assert ours == ref, kw


def test_continue_final_message_matches_transformers(tok, tok_dir):
    """continue_final_message=True ends the prompt inside the last message (no end of turn), as transformers
    does, also where the content has whitespace around it; NumPy values in template variables are plain ones."""
    import numpy as np
    hf = _hf(tok_dir)
    for final in ("The answer is", "  spaced  ", "line\n", "end", "|>", "im_"):  # also text the markup holds
        for msgs in ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": final}],
                     [{"role": "user", "content": final}]):
            ours = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
            ref = hf.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True,
                                         tokenize=False)
            assert ours == ref, (final, msgs)
    with pytest.raises(ValueError, match="exclude"):
        tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, continue_final_message=True)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    assert tok.apply_chat_template(msgs, continue_final_message=True).endswith("Sure,")  # no generation prompt
    msgs = CONVERSATIONS[0]
    assert tok.apply_chat_template(msgs, enable_thinking=np.False_) == tok.apply_chat_template(
        msgs, enable_thinking=False)


@pytest.mark.parametrize("agp", [True, False])
def test_chatml_template_whitespace_and_loopcontrols(tmp_path, agp):
    tok = _train(tmp_path, template=CHATML_TEMPLATE)
    hf = _hf(tmp_path)
    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "yo", "name": "bot"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "a", "skip": True},
         {"role": "user", "content": "b", "last": True}, {"role": "assistant", "content": "never"}],
    ]
    for msgs in convs:
        for kw in ({}, {"eos_in_prompt": True}):
            ours = tok.apply_chat_template(msgs, add_generation_prompt=agp, **kw)
            assert ours == hf.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False, **kw)
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                + ("<|im_start|>assistant\n" if agp else ""))
    assert tok.apply_chat_template(convs[0], add_generation_prompt=agp) == expected
    assert tok.apply_chat_template(convs[0], add_generation_prompt=agp, eos_in_prompt=1).endswith("<|im_end|>")
    with pytest.raises(ValueError, match="bad role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TypeError):
        tok.apply_chat_template("not a list")
    with pytest.raises(TypeError):
        tok.apply_chat_template(["not a dict"])


def test_template_sources(tmp_path):
    # a list of named templates: "default" is used
    t = _train(tmp_path, template=[{"name": "tool_use", "template": "TOOLS"},
                                   {"name": "default", "template": "DEFAULT{{ messages|length }}"}])
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT1"
    # chat_template.jinja wins over tokenizer_config.json
    t = _train(tmp_path, template="FROM CONFIG", jinja_file="FROM FILE {{ add_generation_prompt }}")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "FROM FILE True"
    assert t.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == \
        "FROM FILE False"


def test_tojson_and_sandbox(tmp_path):
    t = _train(tmp_path, template="{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
                                  "{{ strftime_now('%Y') | length }}")
    out = t.apply_chat_template([{"role": "user", "content": "ü<b>"}])
    a, b, c = out.split("|")
    assert a == '{"role": "user", "content": "ü<b>"}'
    assert b == json.dumps({"role": "user", "content": "ü<b>"}, ensure_ascii=False, indent=2)
    assert c == "4"
    import jinja2
    t = _train(tmp_path, template="{{ messages.__class__ }}{% set x = messages.append(1) %}")
    with pytest.raises(ValueError, match="SecurityError") as info:
        t.apply_chat_template([{"role": "user", "content": "x"}])
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)


# -- named templates, tools, roles -------------------------------------------------------------------

NAMED_TEMPLATES = [
    {"name": "default", "template": "D{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"},
    {"name": "tool_use", "template": "T{{ tools | length }}{% for m in messages %}[{{ m.role }}]{% endfor %}"},
]


def test_named_chat_templates_are_picked_as_transformers_picks_them(tmp_path):
    """A list of named templates: "default" without tools, "tool_use" with tools, and a chat_template argument
    that names one picks it (any other string is a template)."""
    import enum

    tok = _train(tmp_path, template=NAMED_TEMPLATES)
    hf = _hf(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kw in ({}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools}, {"chat_template": "default"},
               {"chat_template": "X{{ messages | length }}"}):
        ours = tok.apply_chat_template(msgs, add_generation_prompt=False, **kw)
        assert ours == hf.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False, **kw), kw
    assert tok.apply_chat_template(msgs, tools=tools).startswith("T1")

    class Role(str, enum.Enum):
        USER = "user"

    assert tok.apply_chat_template([{"role": Role.USER, "content": "hi"}]) == "D[user:hi]"

    with pytest.raises(TypeError, match="tools must be a list of JSON-schema dicts or Python functions"):
        tok.apply_chat_template(msgs, tools=["get_weather"])


@pytest.mark.parametrize("extra", [False, True])
def test_template_files_replace_the_configs_templates(tmp_path, extra):
    """chat_template.jinja (and additional_chat_templates/*.jinja) replace tokenizer_config's named templates,
    as transformers loads them: with only the file, tools do not pick the config's "tool_use"."""
    _train(tmp_path, template=NAMED_TEMPLATES, jinja_file="F{% for m in messages %}<{{ m.content }}>{% endfor %}")
    if extra:
        (tmp_path / "additional_chat_templates").mkdir()
        (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("FT{{ tools | length }}")
    tok = Tokenizer.from_dir(tmp_path)
    hf = _hf(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kw in ({}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools}):
        if "chat_template" in kw and not extra:
            continue  # with one template there are no names to pick
        ours = tok.apply_chat_template(msgs, add_generation_prompt=False, **kw)
        assert ours == hf.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False, **kw), kw
    assert tok.apply_chat_template(msgs, tools=tools).startswith("FT1" if extra else "F<hi>")


def _tool_functions():
    from typing import Literal, Optional, Union

    def get_weather(city: str, unit: Literal["c", "f"] = "c", days: Optional[int] = None, tags: list[str] = None,
                    weights: dict[str, float] = None, x: Union[int, str] = 1, pair: tuple[int, str] = None) -> str:
        """Get the weather.

        Several lines of description.

        Args:
            city: The city name,
                continued on a second line.
            unit: Unit of temperature (choices: ["c", "f"])
            days: How many days
            tags: Some tags
            weights: Weights
            x: An x
            pair: A pair

        Returns:
            The forecast.
        """

    def add(a: int, b: float, flag: bool = False):
        """Adds.

        Args:
            a: First
            b: Second
            flag: A flag
        """

    return [get_weather, add]


def test_python_functions_as_tools_give_transformers_schemas(tok, tok_dir):
    """A function given as a tool becomes the JSON schema transformers makes of it (type hints and the
    Google-style docstring), and the template renders the same text."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import get_json_schema

    from qwen_rt.tools import tool_schema

    funcs = _tool_functions()
    for f in funcs:
        assert tool_schema(f) == get_json_schema(f), f.__name__
    hf = _hf(tok_dir)
    msgs = [{"role": "user", "content": "weather?"}]
    assert (tok.apply_chat_template(msgs, tools=funcs)
            == hf.apply_chat_template(msgs, tools=funcs, add_generation_prompt=True, tokenize=False))

    def undocumented(a: int):
        pass

    def no_hint(a):
        """Does.

        Args:
            a: the a
        """

    for f, msg in ((undocumented, "no docstring"), (no_hint, "no type hint")):
        with pytest.raises(ValueError, match=msg):
            tool_schema(f)


# -- a Request's text when its end never arrives -----------------------------------------------------

class _Out:
    def __init__(self, tokens, finish_reason=None):
        self.tokens, self.finish_reason, self.error = tokens, finish_reason, ""
        self.top_n, self.top_ids, self.top_logprobs, self.logprobs = 0, [], [], [0.0] * len(tokens)
        self.cached_tokens = 0


class _ClosingGen:
    """Stands in for a Generator whose engine is closed after the first output."""

    _engine = None

    def __init__(self, tok):
        self.tokenizer, self.closed = tok, False

    def _engine_call(self, name, *args):
        if self.closed:
            raise RuntimeError("the Generator is closed")
        return _Out([])


@pytest.mark.parametrize("text,stop", [("hello STOP", ["STOPPED"]), ("ok 𝄞", None)])
def test_cancel_of_a_closed_request_keeps_the_held_back_text(tok, text, stop):
    """cancel() after the engine is gone: text the detokenizer (a character cut in two) or the stop matcher (a
    stop string's prefix) still held is added, so text matches token_ids."""
    from qwen_rt.generator import Request
    from qwen_rt.sampling import SamplingParams

    gen = _ClosingGen(tok)
    ids = tok.encode(text)
    taken = ids if stop else ids[:-1]
    r = Request(gen, 1, [1], SamplingParams(stop=stop))
    r._take(_Out(taken))
    assert r.text != tok.decode(taken)  # something is held back
    gen.closed = True
    r.cancel()
    assert r.finish_reason == "cancelled" and r.token_ids == taken
    assert r.text == tok.decode(taken)


def test_stop_unarmed_text_never_ends_a_request():
    """Text fed unarmed (before min_tokens) ends no stop string, even held back as the start of a longer one."""
    m = StopMatcher(["\n", "\n\n"])
    assert m.feed("abc\n", armed=False) == ("abc", False)
    assert m.feed("x") == ("\nx", False)
    assert m.feed("y\n") == ("y", True)
    m = StopMatcher(["ab"])
    assert m.feed("a", armed=False) == ("", False)
    assert m.feed("b") == ("", True)  # a stop that ends in armed text counts, wherever it began
