"""scripts/gpu/vllm/soak.py against a stand-in of `vllm serve` on loopback (the standard library's HTTP
server streaming `/v1/completions` as server-sent events, and the developer `/collective_rpc`): every
request is sent, cancelled ones stop reading after their first chunks, opted-out ones carry the flat
`vllm_xargs`, the drop totals come back, and `compare` pairs two runs' completed answers."""
from __future__ import annotations

import argparse
import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "vllm" / "soak.py"
spec = importlib.util.spec_from_file_location("soak", SCRIPT)
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


class FakeServe(BaseHTTPRequestHandler):
    bodies: list = []
    word = "tok"
    live = 0  # drop histories the fake server reports held

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/collective_rpc":
            payload = json.dumps({"results": [[{"rows_in": 10, "live_drop_histories": self.live}]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for i in range(body["max_tokens"]):  # one chunk per token; its text depends on the prompt
                text = f" {self.word}{len(body['prompt']) % 7}-{i}"
                self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture
def server():
    FakeServe.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServe)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_soak_run_sends_every_request_and_pairs_with_another(server, tmp_path, capsys):
    args = ["run", "--url", server, "--model", "m", "--requests", "40", "--concurrency", "4", "--min-len", "20",
            "--max-len", "400", "--max-tokens", "6", "--cancel", "0.25", "--opt-out", "0.25", "--vocab", "100",
            "--totals"]
    assert soak.main(args + ["--out", str(tmp_path / "a.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert len(records) == len(FakeServe.bodies) == 40 and summary["errors"] == 0
    planned = {item["id"]: item for item in soak.plan(argparse.Namespace(
        requests=40, min_len=20, max_len=400, cancel=0.25, opt_out=0.25, seed=0))}
    assert 0 < summary["cancelled"] < 40 and 0 < summary["opted_out"] < 40
    for r in records:
        item = planned[r["id"]]
        assert r["prompt_len"] == item["prompt_len"] and 20 <= r["prompt_len"] <= 400
        if r["cancelled"]:
            assert r["chunks"] == item["cancel_after"] < 6
        else:
            assert r["chunks"] == 6 and r["text"].count("tok") == 6
    opted = [b for b in FakeServe.bodies if b.get("vllm_xargs") == {"uniprefill": "off"}]
    assert len(opted) == summary["opted_out"] and all(b["stream"] and b["temperature"] == 0.0 and b["max_tokens"] == 6
                                                      for b in FakeServe.bodies)
    assert summary["drop_totals"] == [[{"rows_in": 10, "live_drop_histories": 0}]] and summary["live_drop_histories"] == 0

    FakeServe.live = 2  # histories still held after the last request (polled briefly): the run fails
    try:
        assert soak.main(args + ["--requests", "3", "--settle-seconds", "1", "--out", str(tmp_path / "leak.jsonl")]) == 1
    finally:
        FakeServe.live = 0
    assert json.loads((tmp_path / "leak.summary.json").read_text())["live_drop_histories"] == 2

    FakeServe.word = "other"  # the second run answers differently
    try:
        assert soak.main(args + ["--out", str(tmp_path / "b.jsonl")]) == 0
    finally:
        FakeServe.word = "tok"
    capsys.readouterr()
    assert soak.main(["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert compared["completed_in_both"] == summary["completed"] and compared["same_text"] == 0
    assert soak.main(["compare", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl"), "--out",
                      str(tmp_path / "same.json")]) == 0
    assert json.loads((tmp_path / "same.json").read_text())["same_text"] == summary["completed"]
