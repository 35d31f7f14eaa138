"""HTTP reward models against a real local http.server (a thread on 127.0.0.1 started here)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from libs.rewards.base import RewardError, RewardResult, build


class Stub:
    """A tiny JSON server: ``replies`` is a list of (status, body) served in order (the last one
    repeats); every request's path and JSON body is recorded."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests: list[tuple[str, dict, dict]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body, dict(self.headers)))
                status, reply = stub.replies[0] if len(stub.replies) == 1 else stub.replies.pop(0)
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


TRAJ = {
    "trajectory_id": "g1/0",
    "task": "chat",
    "prompt_text": "Say hi",
    "response_text": "hi!",
    "reference": json.dumps({"answer": "hi"}),
}
FAST = {"backoff_s": 0.01, "timeout_s": 5.0, "trust_env": False}


def test_json_endpoint_with_score_path_and_details():
    reply = {"result": {"scores": [0.8], "parts": {"helpful": 0.9, "safe": 1}}}
    with Stub([(200, reply)]) as s:
        fn = build(
            "http",
            {"url": s.url + "/rm", "score_path": "result.scores.0", "details_path": "result.parts", "scale": 2.0,
             "offset": -1.0, "extra": {"model": "rm-1"}, "headers": {"X-Token": "t"}, **FAST},
        )  # fmt: skip
        res = fn(TRAJ)
    assert res == RewardResult(pytest.approx(0.6), {"helpful": 0.9, "safe": 1.0})
    path, body, headers = s.requests[0]
    assert path == "/rm" and headers["X-Token"] == "t"
    assert body == {"prompt": "Say hi", "response": "hi!", "reference": TRAJ["reference"], "task": "chat",
                    "trajectory_id": "g1/0", "model": "rm-1"}  # fmt: skip


def test_retry_after_500_then_success():
    with Stub([(500, {"error": "busy"}), (503, b"not json"), (200, {"score": 0.25})]) as s:
        res = build("http", {"url": s.url, "retries": 2, **FAST})(TRAJ)
    assert res.reward == 0.25 and len(s.requests) == 3


def test_retries_exhausted_and_client_errors_raise():
    with Stub([(500, {"error": "down"})]) as s:
        with pytest.raises(RewardError, match=r"failed after 3 attempt\(s\); last: HTTP 500"):
            build("http", {"url": s.url, "retries": 2, **FAST})(TRAJ)
        assert len(s.requests) == 3
    with Stub([(400, {"error": "bad request"})]) as s:
        with pytest.raises(RewardError, match="HTTP 400"):
            build("http", {"url": s.url, "retries": 5, **FAST})(TRAJ)
        assert len(s.requests) == 1  # a 4xx is not retried
    with Stub([(200, {"other": 1})]) as s, pytest.raises(RewardError, match="no 'score'"):
        build("http", {"url": s.url, **FAST})(TRAJ)
    with Stub([(200, {"score": "high"})]) as s, pytest.raises(RewardError, match="not a number"):
        build("http", {"url": s.url, **FAST})(TRAJ)


def test_connection_refused_is_retried_then_raises():
    with Stub([(200, {})]) as s:
        url = s.url
    with pytest.raises(RewardError, match="failed after 2 attempt"):
        build("http", {"url": url, "retries": 1, **FAST})(TRAJ)


def test_openai_compatible_judge():
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Score: 7"}}]}
    with Stub([(500, {"error": "warming up"}), (200, reply)]) as s:
        fn = build("openai_judge", {"base_url": s.url + "/v1/", "model": "judge", "api_key": "sk-test", **FAST})
        res = fn(TRAJ)
    assert res == RewardResult(pytest.approx(0.7), {"judge_score": 7.0})
    path, body, headers = s.requests[-1]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert body["model"] == "judge" and body["temperature"] == 0.0
    assert body["messages"][0]["role"] == "system" and "hi!" in body["messages"][1]["content"]
    with Stub([(200, {"choices": [{"message": {"content": "I refuse"}}]})]) as s:
        with pytest.raises(RewardError, match="no number"):
            build("openai_judge", {"base_url": s.url, "model": "m", **FAST})(TRAJ)
