"""`qwen35-tvm bench` against a real uvicorn on the tiny-random artifact: every request gets
exactly output-len tokens, the JSON and the PNG are written, and a server that refuses
(closed port, wrong key) shows up as failed requests with the reason and a non-zero exit,
never a traceback. The client itself is pure HTTP: it loads neither TVM nor the runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_server_harness import KEY, Served, free_port, start_server

from qwen35_tvm.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--input-len", "16", "--output-len", "4", "--num-prompts", "4"]
SERIES, STATS = ("ttft", "tpot", "itl", "e2e"), ("mean", "p50", "p99")
METRICS = [f"{stat}_{name}_ms" for name in SERIES for stat in STATS]


@pytest.fixture(scope="module")
def served(tiny_random_artifact):
    with start_server(tiny_random_artifact) as s:
        yield s


def bench(url: str, *args: str) -> None:
    main(["bench", "--url", url, *args])


def check_all_completed(level: dict, num_prompts: int, output_len: int) -> None:
    assert level["completed"] == num_prompts and level["failed"] == 0, level["errors"]
    assert level["errors"] == {}
    assert all(r["ok"] and r["output_tokens"] == output_len for r in level["requests"])
    assert level["total_output_tokens"] == num_prompts * output_len
    for key in ["duration_s", "request_throughput", "output_throughput", *METRICS]:
        assert level[key] is not None and level[key] > 0, key
    assert level["total_token_throughput"] > level["output_throughput"]
    assert level["p99_ttft_ms"] >= level["p50_ttft_ms"]


def test_bench_writes_the_table_json_and_png(served: Served, tmp_path: Path, capsys):
    out, png = tmp_path / "results.json", tmp_path / "results.png"
    bench(served.url, "--api-key", KEY, "--concurrency", "1,2", *TINY, "--out", str(out))
    assert "TTFT p99 (ms)" in capsys.readouterr().out
    bench(served.url, "--api-key", KEY, "--concurrency", "1,2", *TINY, "--plot", str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC

    report = json.loads(out.read_text())
    config = report["config"]
    assert config["model"] == served.server.model  # found through /v1/models
    assert config["url"] == served.url and config["request_rate"] is None
    assert "api_key" not in config and config["date"]
    assert [lv["concurrency"] for lv in report["results"]] == [1, 2]
    for level in report["results"]:
        check_all_completed(level, 4, 4)
    assert served.idle()


def test_bench_with_a_request_rate_and_per_token_chunks(served: Served, tmp_path: Path):
    out = tmp_path / "rate.json"
    name = served.server.model
    args = ["--api-key", KEY, "--model", name, "--concurrency", "4", "--request-rate", "50"]
    bench(served.url, *args, *TINY, "--logprobs", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["config"]["request_rate"] == 50.0
    level = report["results"][0]
    check_all_completed(level, 4, 4)
    # With logprobs the server sends one chunk per token, so ITL is per token.
    assert level["tokens_per_chunk"] == 1.0
    assert all(r["chunks"] == 4 for r in level["requests"])
    # The timeline: each stream's send and chunk times, ordered and within the level
    for r in level["requests"]:
        times = [r["sent_ms"], *r["chunk_ms"]]
        assert len(times) == 5 and times == sorted(times) and times[0] >= 0, times
        assert times[-1] <= level["duration_s"] * 1e3
        gaps = np.diff(r["chunk_ms"])
        assert np.isclose(r["chunk_ms"][0] - r["sent_ms"], r["ttft_ms"], atol=0.01)
        assert 0 < gaps.sum() <= r["e2e_ms"] - r["ttft_ms"] + 0.01  # [DONE] comes last


def test_bench_sends_sampled_settings(served: Served, tmp_path: Path):
    """Sampled traffic (Qwen3.5's suggested settings): every request completes, and the report
    records the settings; a bad one is refused before any request."""
    out = tmp_path / "sampled.json"
    sampled = ["--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]
    bench(served.url, "--api-key", KEY, "--concurrency", "2", *TINY, *sampled, "--out", str(out))
    report = json.loads(out.read_text())
    assert (report["config"]["temperature"], report["config"]["top_p"]) == (0.7, 0.8)
    assert report["config"]["top_k"] == 20
    check_all_completed(report["results"][0], 4, 4)
    with pytest.raises(SystemExit, match="top-p must be in"):
        bench(served.url, "--concurrency", "2", *TINY, "--top-p", "1.5")


def test_the_request_body_carries_the_sampling_settings(monkeypatch):
    import asyncio

    from qwen35_tvm.cli import bench as client

    sent = []

    async def capture(_client, _cfg, _headers, body):
        sent.append(body)

    monkeypatch.setattr(client, "_stream", capture)
    base = dict(url="u", concurrency=[1], input_len=2, output_len=2, num_prompts=1)
    for cfg in (
        client.BenchConfig(**base),
        client.BenchConfig(**base, temperature=0.7, top_k=20),
        client.BenchConfig(**base, temperature=1.0, min_p=0.05),
    ):
        asyncio.run(client.one_request(None, cfg, None, {}, [5, 6]))
    assert sent[0]["temperature"] == 0.0 and not {"top_k", "top_p", "min_p"} & set(sent[0])
    assert (sent[1]["temperature"], sent[1]["top_k"]) == (0.7, 20) and "top_p" not in sent[1]
    assert sent[2]["min_p"] == 0.05 and "min_p" not in sent[1]
    with pytest.raises(ValueError, match="min-p must be in"):
        client.BenchConfig(**base, min_p=1.0)


def test_a_wrong_api_key_fails_every_request_with_the_reason(served: Served, tmp_path, capsys):
    out = tmp_path / "denied.json"
    with pytest.raises(SystemExit) as exit_info:
        bench(served.url, "--api-key", "wrong", "--concurrency", "2", *TINY, "--out", str(out))
    assert "4 request(s) failed" in str(exit_info.value.code)
    printed = capsys.readouterr().out
    assert "HTTP 401: invalid or missing API key" in printed
    level = json.loads(out.read_text())["results"][0]
    assert level["completed"] == 0 and level["failed"] == 4
    [(message, count)] = level["errors"].items()
    assert message.startswith("HTTP 401") and count == 4


def test_a_closed_port_fails_cleanly_from_the_command_line(tmp_path: Path):
    out, png = tmp_path / "closed.json", tmp_path / "closed.png"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cmd = ["bench", "--url", url, "--concurrency", "1,2", *TINY, "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "qwen35_tvm.cli.main", *cmd, "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stdout + run.stderr
    assert "8 request(s) failed" in run.stderr
    assert "ConnectError" in run.stdout
    levels = json.loads(out.read_text())["results"]
    assert [lv["failed"] for lv in levels] == [4, 4]
    assert all("ConnectError" in r["error"] for lv in levels for r in lv["requests"])
    assert png.read_bytes()[:8] == PNG_MAGIC  # still drawn, with empty latency panels


def test_the_client_loads_neither_tvm_nor_the_runtime():
    code = (
        "import sys, qwen35_tvm.cli.bench\n"
        "heavy = ('tvm', 'qwen35_tvm.runtime', 'qwen35_tvm.compile', 'qwen35_tvm.server')\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'tvm' or m.startswith(heavy)])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_timeline_tool_groups_arrivals_into_steps(capsys):
    """benchmarks/itl_timeline.py: arrivals within the window are one step, first tokens and
    sends between steps are counted, and the slowest gap is listed first."""
    from benchmark_module import load

    tool = load("itl_timeline")
    a = {"ok": True, "sent_ms": 0.0, "chunk_ms": [10.0, 14.0, 18.0, 30.0, 34.0]}
    b = {"ok": True, "sent_ms": 20.0, "chunk_ms": [30.5, 34.4]}  # its first token at 30.5
    level = {"concurrency": 2, "requests": [a, b]}
    steps = tool.steps_of(level, 2.0)
    assert [(s["at"], s["streams"], s["firsts"]) for s in steps] == [
        (10.0, 1, 1), (14.0, 1, 0), (18.0, 1, 0), (30.0, 2, 1), (34.0, 2, 0),
    ]  # fmt: skip
    tool.report(level, 2.0, top=1)
    out = capsys.readouterr().out
    assert "steps with a first token: 1, gap median 12.00 ms" in out
    assert out.strip().splitlines()[-1].split() == ["30.0", "12.00", "2", "1", "1"]
