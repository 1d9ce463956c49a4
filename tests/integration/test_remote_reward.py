"""The remote verifier (tasks/rewards/remote_verifier.py) against a real HTTP server on 127.0.0.1: good answers,
components, a slow server past the timeout, failures retried with backoff, refusals that are not,
and garbage; through the Scorer and through the reward pool."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from laminar_hpc.config.task import RewardCfg
from laminar_hpc.tasks.rewards.reward_pool import RewardPool
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.rewards.remote_verifier import RemoteVerifier
from laminar_hpc.tasks.rewards.scorer import RemoteError, Scorer

P = Problem(7, "What is 12 + 7?", "19", fields={"level": 2, "tags": ["easy"]})
GOOD = Response("12 + 7 = 19", (5, 6, 2), "eos")


class Verifier(BaseHTTPRequestHandler):
    """Answers by path: what a verifier may do, counted per path."""

    def do_POST(self):  # noqa: N802 - http.server's name
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with state["lock"]:
            state["attempts"][self.path] += 1
            attempt = state["attempts"][self.path]
            state["bodies"].append(body)
        right = float(body["response"]["text"].endswith(body["problem"]["answer"]))
        if self.path == "/good":
            self.reply(200, json.dumps(right))
        elif self.path == "/components":
            self.reply(200, json.dumps({"format": 1.0, "correct": right}))
        elif self.path == "/wrapped":
            self.reply(200, json.dumps({"reward": 0.25}))
        elif self.path == "/slow":  # answers after the client gave up (or when the test ends)
            state["release"].wait(10)
            self.reply(200, "1.0")
        elif self.path == "/drip":  # each byte within a read timeout, the whole far past it
            self.send_response(200)
            self.send_header("content-length", "40")
            self.end_headers()
            for _ in range(40):
                if state["release"].wait(0.05):
                    break
                self.wfile.write(b" ")
                self.wfile.flush()
        elif self.path == "/flaky":  # fails twice, then answers
            self.reply(500, "busy") if attempt <= 2 else self.reply(200, "1.0")
        elif self.path == "/down":
            self.reply(503, "down for maintenance")
        elif self.path == "/refuse":
            self.reply(404, "no such verifier")
        elif self.path == "/garbage":
            self.reply(200, "<html>oops</html>")
        elif self.path == "/string":
            self.reply(200, json.dumps("correct"))
        elif self.path == "/big":
            self.reply(200, "5")

    def reply(self, status: int, text: str) -> None:
        try:
            self.send_response(status)
            self.send_header("content-length", str(len(text.encode())))
            self.end_headers()
            self.wfile.write(text.encode())
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    httpd.state = {"lock": threading.Lock(), "attempts": Counter(), "bodies": [], "release": threading.Event()}
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.state["release"].set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def scorer(server, path: str, **kw) -> Scorer:
    return Scorer(RewardCfg(url=server.url + path, **{"timeout_s": 2.0, "backoff_s": 0.01, **kw}))


def test_a_good_answer_and_what_the_verifier_receives(server):
    s = scorer(server, "/good")
    assert s.score(P, GOOD).reward == 1.0 and s.score(P, Response("20")).reward == 0.0
    body = server.state["bodies"][0]
    assert body == {"problem": {"index": 7, "prompt": "What is 12 + 7?", "messages": None, "system": None,
                                "answer": "19", "fields": {"level": 2, "tags": ["easy"]}},
                    "response": {"text": "12 + 7 = 19", "token_ids": [5, 6, 2], "finish": "eos"}}
    s.close()


def test_components_are_weighed_and_a_wrapped_reward_is_the_reward(server):
    out = scorer(server, "/components", weights={"format": 0.1, "correct": 0.9}).score(P, GOOD)
    assert out.components == {"format": 1.0, "correct": 1.0} and out.reward == pytest.approx(1.0)
    out = scorer(server, "/components", weights={"format": 0.1}).score(P, GOOD)  # correct: logged, not added
    assert out.components == {"format": 1.0, "correct": 1.0} and out.reward == pytest.approx(0.1)
    out = scorer(server, "/wrapped").score(P, GOOD)
    assert (out.reward, out.components, out.error) == (0.25, {}, None)


def test_a_slow_verifier_is_retried_then_scored_as_remote(server):
    out = scorer(server, "/slow", timeout_s=0.3, retries=1).score(P, GOOD)
    assert (out.error, out.reward) == ("remote", 0.0)
    assert "timed out after 0.3 s (after 2 attempts)" in out.detail and server.url in out.detail
    assert server.state["attempts"]["/slow"] == 2


def test_an_answer_that_drips_past_the_timeout_times_out(server):
    out = scorer(server, "/drip", timeout_s=0.5, retries=0).score(P, GOOD)
    assert out.error == "remote" and "timed out after 0.5 s (the answer kept dripping)" in out.detail


def test_server_errors_are_retried_with_doubling_backoff(server):
    waits: list[float] = []
    verifier = RemoteVerifier(RewardCfg(url=server.url + "/flaky", retries=2, backoff_s=0.05), sleep=waits.append)
    assert verifier(P, GOOD) == 1.0
    assert server.state["attempts"]["/flaky"] == 3 and waits == [0.05, 0.1]
    verifier.close()


def test_a_verifier_that_keeps_failing_scores_remote_after_every_retry(server):
    out = scorer(server, "/down", retries=2).score(P, GOOD)
    assert out.error == "remote" and "HTTP 503: 'down for maintenance' (after 3 attempts)" in out.detail
    assert server.state["attempts"]["/down"] == 3


def test_a_refusal_is_not_retried(server):
    out = scorer(server, "/refuse", retries=3).score(P, GOOD)
    assert out.error == "remote" and "HTTP 404" in out.detail and "not retried" in out.detail
    assert server.state["attempts"]["/refuse"] == 1


def test_garbage_and_wrong_answers_are_counted_errors(server):
    out = scorer(server, "/garbage", retries=2).score(P, GOOD)
    assert out.error == "remote" and "not JSON ('<html>oops</html>')" in out.detail
    assert server.state["attempts"]["/garbage"] == 1
    out = scorer(server, "/string").score(P, GOOD)
    assert out.error == "bad_type" and "returned str ('correct')" in out.detail
    assert scorer(server, "/big").score(P, GOOD).error == "out_of_range"


def test_an_unreachable_verifier_is_retried_then_scored_remote(server):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    verifier = RemoteVerifier(RewardCfg(url=f"http://127.0.0.1:{port}/", retries=1), sleep=lambda s: None)
    with pytest.raises(RemoteError, match=r"ConnectError.*\(after 2 attempts\)"):
        verifier(P, GOOD)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_through_the_pool_retries_fit_in_the_calls_budget(server, kind):
    """The pool's timeout covers every attempt: a slow verifier ends as "remote", not "timeout"."""
    cfg = RewardCfg(url=server.url + "/slow", pool=kind, workers=2, timeout_s=0.3, retries=1, backoff_s=0.01)
    with RewardPool(cfg) as pool:
        pool.submit("slow", P, GOOD)
        got: dict = {}
        deadline = time.monotonic() + 60
        while "slow" not in got:
            got.update(pool.collect())
            assert time.monotonic() < deadline, "waited 60 s for the slow verifier's call"
            time.sleep(0.01)
    assert got["slow"].error == "remote" and "after 2 attempts" in got["slow"].detail
    assert server.state["attempts"]["/slow"] == 2
