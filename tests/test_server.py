"""The OpenAI-compatible server over a real uvicorn on 127.0.0.1 (CPU, tiny-random): the
official client works, streamed and whole answers agree, echo scores match the runtime's,
stop strings are cut cleanly, and malformed requests get OpenAI-shaped 4xx errors."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from test_server_harness import KEY, Served, start_server

from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.generate import Generator
from qwen35_tvm.runtime.sampler import SamplingParams
from qwen35_tvm.server.stream import TextStream, held_back

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_random_artifact):
    with start_server(tiny_random_artifact) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_random_artifact) -> Generator:
    """The one-sequence runtime on its own copy of the artifact (the server's is in use)."""
    return Generator(Artifact(tiny_random_artifact))


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


def test_official_client_completion_and_chat(served: Served, client: openai.OpenAI):
    model = client.models.list().data[0].id
    whole = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, logprobs=3, **GREEDY
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 6 == whole.usage.completion_tokens
    assert all(len(t) >= 1 for t in choice.logprobs.top_logprobs)
    assert whole.usage.prompt_tokens == len(served.tokenizer.encode("The capital of France is"))
    parts = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in parts) == choice.text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    prompt = served.tokenizer.encode(served.server.renderer.render_messages(messages, None))
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    # The built-in Qwen3.5 template opens <think>: the answer streams as reasoning first.
    parts = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join((d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in parts)
    whole = chat.choices[0].message
    assert text == (whole.content or "") + (getattr(whole, "reasoning_content", None) or "")
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_echo_scores_equal_generator_score(served: Served, reference: Generator):
    ids = served.tokenizer.encode("Paris is the capital and largest city of France.")
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    got = served.post("/v1/completions", body).json()["choices"][0]
    reference = reference.score(ids, top_k=1)
    lp = got["logprobs"]
    assert got["text"] == served.tokenizer.decode(ids) and got["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], [s.logprob for s in reference[1:]])
    # lm-eval's is_greedy check: the top entry is the argmax, as the runtime finds it.
    for tops, score in zip(lp["top_logprobs"][1:], reference[1:], strict=True):
        assert max(tops.values()) == pytest.approx(score.top[0][1])
    # as lm-eval's local-completions sends it: text, max_tokens 1, the last token dropped
    text = served.post("/v1/completions", {**body, "prompt": "Paris is", "max_tokens": 1})
    first = text.json()["choices"][0]["logprobs"]
    assert len(first["tokens"]) == len(served.tokenizer.encode("Paris is")) + 1


@pytest.mark.parametrize("prompt", ["Once upon a time", [9419, 11, 1814, 0, 42]])
def test_greedy_text_is_the_same_streamed_or_not_and_with_logprobs(served, reference, prompt):
    base = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = served.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    echo = served.tokenizer.decode(ids)
    texts = set()
    for extra in ({}, {"logprobs": 2}, {"echo": True, "logprobs": 0}):
        whole = served.post("/v1/completions", {**base, **extra}).json()["choices"][0]
        streamed = served.stream("/v1/completions", {**base, **extra})
        assert "".join(c["choices"][0]["text"] for c in streamed) == whole["text"]
        texts.add(whole["text"].removeprefix(echo) if extra.get("echo") else whole["text"])
    tokens = reference.generate(ids, SamplingParams(temperature=0.0), 12, stop_ids=[])
    assert texts == {served.tokenizer.decode(list(tokens), skip_special=True)}


def test_n_choices_over_a_list_of_prompts_are_seeded_and_counted(served: Served):
    body = {"prompt": ["Hello", "World wide"], "n": 2, "max_tokens": 3, "seed": 5}
    body |= {"temperature": 1.0, "ignore_eos": True}
    first = served.post("/v1/completions", body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    encoded = served.tokenizer.encode("Hello") + served.tokenizer.encode("World wide")
    assert first["usage"] == {
        "prompt_tokens": len(encoded),
        "completion_tokens": 12,
        "total_tokens": len(encoded) + 12,
    }
    again = served.post("/v1/completions", body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in first["choices"]]


def test_stop_strings_are_cut_across_tokens_and_never_partly_sent(served: Served):
    base = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = served.post("/v1/completions", {**base, "logprobs": 0}).json()["choices"][0]
    tokens = full["logprobs"]["tokens"]
    # A stop string that starts inside token 3 and ends inside token 5.
    head = "".join(tokens[:3])
    stop = (head[-2:] if len(tokens[2]) > 1 else tokens[2]) + tokens[3] + tokens[4][:1]
    cut = full["text"].find(stop)
    assert cut >= 0
    whole = served.post("/v1/completions", {**base, "stop": [stop, "never-there"]}).json()
    assert whole["choices"][0]["text"] == full["text"][:cut]
    assert whole["choices"][0]["finish_reason"] == "stop"
    chunks = served.stream("/v1/completions", {**base, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"][:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_stream_holds_back_possible_stop_prefixes(served: Served):
    assert held_back("abc", ["cde"]) == 1 and held_back("abcd", ["cdx", "bcdy"]) == 3
    assert held_back("abc", ["xyz"]) == 0
    ids = served.tokenizer.encode("hello world, stop here please")
    stream = TextStream(served.tokenizer, ["stop here"])
    sent = "".join(stream.feed(t) for t in ids) + stream.finish()
    assert sent == "hello world, " and stream.stopped
    smile = served.tokenizer.encode("🙂 ok")  # byte-level pieces of one character
    stream = TextStream(served.tokenizer, [])
    pieces = [stream.feed(t) for t in smile] + [stream.finish()]
    assert "".join(pieces) == "🙂 ok" and all("\ufffd" not in p for p in pieces)


def test_models_health_and_metrics(served: Served):
    assert httpx.get(served.url + "/health").status_code == 200  # no key needed
    assert served.get("/v1/models").json()["data"][0]["id"] == served.server.model
    served.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    metrics = served.get("/metrics").text
    for name in (
        'qwen35_requests_total{route="/v1/completions",status="200"}',
        "qwen35_prompt_tokens_total",
        "qwen35_generation_tokens_total",
        "qwen35_time_to_first_token_seconds_bucket",
        "qwen35_time_per_output_token_seconds_count",
        "qwen35_e2e_request_latency_seconds_count",
        "qwen35_num_requests_running",
        "qwen35_num_requests_waiting",
        "qwen35_kv_pages_used",
        "qwen35_gdn_slots_used",
    ):
        assert name in metrics, name
    # one prefill step, then decode steps (the second token's)
    assert 'qwen35_engine_step_seconds_count{kind="prefill"}' in metrics
    assert 'qwen35_engine_step_seconds_count{kind="decode"}' in metrics


def test_serve_is_wired_into_the_cli(capsys):
    from qwen35_tvm.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert "--api-key" in capsys.readouterr().out
