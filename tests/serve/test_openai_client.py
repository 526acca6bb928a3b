"""`k3 serve` through the official openai client on the tiny model: chat and completions,
streaming, sampling parameters, 16 concurrent clients, cancellation, malformed requests and
/metrics. The tiny model's text is noise, so results are compared with each other (stream vs
non-stream, concurrent vs sequential, same seed), not with fixed strings."""
import concurrent.futures
import json
import random
import re
import socket
import time

import pytest

openai = pytest.importorskip("openai")

from conftest import MODEL  # noqa: E402

NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def chat(client, content, **kw):
    extra = dict(NO_THINK, **kw.pop("extra_body", {}))
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], extra_body=extra, **kw)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.raw("GET", "/health")[0] == 200


def test_chat_non_streaming(client):
    r = chat(client, "Hello there", max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_completion_non_streaming(client):
    r = client.completions.create(model=MODEL, prompt="The Kimi K3 model", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and isinstance(r.choices[0].text, str)
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_stream_equals_non_stream(client, thinking):
    kw = dict(max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": thinking}})
    full = chat(client, "Tell me a story", **kw)
    chunks = list(chat(client, "Tell me a story", stream=True,
                       stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)
    msg = full.choices[0].message
    assert content == (msg.content or "")
    assert reasoning == (getattr(msg, "reasoning_content", None) or "")
    assert content or reasoning
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    # include_usage: the last chunk has no choices and the usage of the whole request.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_and_stop(client):
    r = chat(client, "Count", max_completion_tokens=3, temperature=0,
             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"

    base = dict(model=MODEL, prompt="A B C", max_tokens=32, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    stop = next(text[i:i + 2] for i in range(6, len(text) - 2) if text[i:i + 2].strip())
    cut = client.completions.create(stop=[stop, "never-appears"], **base)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.usage.completion_tokens < 32


def test_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="Random", max_tokens=16, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=42, **kw).choices[0].text
    b = client.completions.create(seed=42, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others != {a}
    # top_p / top_k are accepted and sampling stays reproducible with them.
    kw2 = dict(kw, top_p=0.9, extra_body={"ignore_eos": True, "top_k": 20})
    assert (client.completions.create(seed=7, **kw2).choices[0].text ==
            client.completions.create(seed=7, **kw2).choices[0].text)


def test_sixteen_concurrent_clients_match_sequential(server, client):
    def one(i):
        if i % 2:
            r = client.completions.create(model=MODEL, prompt=f"Request number {i}:",
                                          max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text, r.usage.completion_tokens
        r = chat(client, f"Question {i}?", max_tokens=16, temperature=0,
                 extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage.completion_tokens

    sequential = [one(i) for i in range(16)]
    before = server.metrics()["k3_generation_tokens_total"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        concurrent_ = list(pool.map(one, range(16)))
    assert concurrent_ == sequential
    assert all(n == 16 for _, n in concurrent_)
    assert server.metrics()["k3_generation_tokens_total"] - before == 16 * 16


def wait_idle(server, seconds=5.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        m = server.metrics()
        if m["k3_requests_running"] == 0 and m["k3_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"requests still running after {seconds}s: {server.metrics()}")


def test_stream_cancellation_frees_the_request(server, client):
    aborted = server.metrics()['k3_request_success_total{finished_reason="abort"}']
    stream = client.completions.create(model=MODEL, prompt="Long", max_tokens=3000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()["k3_requests_running"] == 1
    stream.close()
    m = wait_idle(server)
    assert m['k3_request_success_total{finished_reason="abort"}'] == aborted + 1
    r = client.completions.create(model=MODEL, prompt="after", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_non_stream_disconnect_cancels(server):
    aborted = server.metrics()['k3_request_success_total{finished_reason="abort"}']
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True})
    s = socket.create_connection((server.host, server.port))
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    time.sleep(0.5)
    assert server.metrics()["k3_requests_running"] == 1
    s.close()
    m = wait_idle(server)
    assert m['k3_request_success_total{finished_reason="abort"}'] == aborted + 1


def assert_error(status_body, status, param=None, part=None):
    code, body = status_body
    assert code == status, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if part is not None:
        assert part in err["message"], err["message"]


def test_malformed_requests_get_openai_errors(server, client):
    raw = server.raw
    assert_error(raw("POST", "/v1/chat/completions", "{not json"), 400, part="not valid JSON")
    assert_error(raw("POST", "/v1/completions", "[1, 2]"), 400)
    assert_error(raw("POST", "/v1/completions", ""), 400)
    assert_error(raw("POST", "/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    assert_error(raw("POST", "/v1/chat/completions", {"messages": [{"role": 1}]}), 400, "messages")
    assert_error(raw("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400,
                 "temperature")
    assert_error(raw("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}), 400,
                 "max_tokens")
    assert_error(raw("POST", "/v1/completions", {"prompt": "x", "n": 2}), 400, "n",
                 "n > 1 is not supported")
    assert_error(raw("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**7}), 400,
                 part="maximum context length")
    assert_error(raw("POST", "/v1/completions", {"prompt": [10**9]}), 400, "prompt")
    assert_error(raw("POST", "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, "model")
    assert_error(raw("GET", "/v1/nothing-here"), 404)
    assert_error(raw("GET", "/v1/completions"), 405)
    assert_error(raw("POST", "/v1/completions", "x" * (17 << 20)), 413)
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        chat(client, "hi", n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    # Unknown fields are accepted and ignored.
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"some_future_option": {"a": [1]}, "user": "u"})
    assert r.usage.completion_tokens >= 1


def test_random_bodies_never_crash_the_server(server):
    rng = random.Random(1234)
    atoms = [None, True, -1, 0, 2**63, 1.5, -1e308, "", "x", "\u00e9\ud7ff", [], {}]
    keys = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "n",
            "stream", "stream_options", "seed", "model", "tools", "logprobs", "ignore_eos"]

    def value(depth=0):
        if depth < 2 and rng.random() < 0.3:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 2 and rng.random() < 0.2:
            return {rng.choice(keys + ["role", "content"]): value(depth + 1)}
        return rng.choice(atoms)

    for i in range(150):
        body = {k: value() for k in rng.sample(keys, rng.randint(0, 6))}
        body["max_tokens"] = body.get("max_tokens", 2) if i % 3 else 2
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        code, out = server.raw("POST", path, body)
        assert code < 500, (path, body, out)
        if code != 200 and not (isinstance(out, str) and out.startswith("data:")):
            assert "error" in out, (path, body, out)
    deep = b'{"prompt": "x", "tools": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    for junk in [b"\xff\xfe\x00", b"{\"prompt\": \"\xff\"}", b"null", b"{" * 10000, deep]:
        assert server.raw("POST", "/v1/completions", junk)[0] == 400
    assert server.raw("GET", "/health")[0] == 200
    wait_idle(server)


def test_metrics_are_prometheus_text(server):
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"\})? (\S+)$')
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            m = sample.match(line)
            assert m, line
            float(m.group(3))
    for name in ("k3_time_to_first_token_seconds", "k3_time_per_output_token_seconds"):
        assert types[name] == "histogram"
    for name in ("k3_prompt_tokens_total", "k3_generation_tokens_total",
                 "k3_request_success_total"):
        assert types[name] == "counter"
    assert types["k3_requests_running"] == types["k3_requests_waiting"] == "gauge"
    m = server.metrics()
    ttft = "k3_time_to_first_token_seconds"
    assert m[ttft + '_bucket{le="+Inf"}'] == m[ttft + "_count"] > 0
    assert m["k3_generation_tokens_total"] > 0 and m["k3_prompt_tokens_total"] > 0
    assert m['k3_request_success_total{finished_reason="length"}'] > 0
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"k3_time_to_first_token_seconds", "k3_requests_running"} <= names
