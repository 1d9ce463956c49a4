"""A remote verifier: a reward function that asks an HTTP endpoint (`task.reward.url`).

Each call POSTs the problem and the response as JSON:

    {"problem": {"index": 7, "prompt": "...", "messages": null | [{"role", "content"}, ...],
                 "system": null | "...", "answer": "72", "fields": {...the row's other fields}},
     "response": {"text": "... #### 72", "token_ids": [...], "finish": "eos"}}

and reads the answer: a JSON number (the reward), `{"reward": number}` (the same), or an object
of named numbers (components, weighed by `task.reward.weights`). Other JSON (a string, a list,
an object with a non-number) is returned as it is, and the Scorer scores it 0 as "bad_type".

Each attempt has `timeout_s` in all (connecting, sending, and reading the answer, however slowly
it drips). A connection error, a timeout, HTTP 5xx or 429 is tried again, `retries` times, after
`backoff_s`, doubled each time; HTTP 4xx is not (the request itself is wrong), nor an answer that
is not JSON. What still fails raises RemoteError, which the Scorer scores 0 as "remote".

    verifier = RemoteVerifier(RewardCfg(url="http://127.0.0.1:8000/score", timeout_s=5))
    verifier(problem, Response("... #### 72"))    # 1.0, or {"format": 1.0, "correct": 0.0}
    verifier.close()

One httpx.Client per verifier, shared by the reward pool's threads (httpx clients are
thread-safe); httpx is imported when a verifier is built, never by `import laminar_hpc.tasks`.
"""
from __future__ import annotations

import json
import numbers
import time
from typing import TYPE_CHECKING, Any, Callable

from laminar_hpc.tasks.problem import Problem, Response, RewardValue

if TYPE_CHECKING:
    from laminar_hpc.config.task import RewardCfg

MAX_ANSWER_BYTES = 1 << 20  # a verifier's answer is a number or a few: more is garbage


class RemoteError(Exception):
    """The remote verifier failed after its retries; the Scorer (tasks/rewards/scorer.py) scores it 0 as "remote"."""


def payload(problem: Problem, response: Response) -> bytes:
    """The JSON body of one request. Row fields that JSON cannot hold (e.g. dates) are sent as text."""
    body = {"problem": {"index": problem.index, "prompt": problem.prompt,
                        "messages": None if problem.messages is None else [dict(m) for m in problem.messages],
                        "system": problem.system, "answer": problem.answer, "fields": dict(problem.fields)},
            "response": {"text": response.text, "token_ids": list(response.token_ids), "finish": response.finish}}
    return json.dumps(body, default=_jsonable, allow_nan=False).encode()


def _jsonable(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars from Parquet rows
    return tolist() if callable(tolist) else str(value)


class _Retry(Exception):
    """An attempt that failed in a way another attempt may not (the message says how)."""


class RemoteVerifier:
    def __init__(self, cfg: RewardCfg, *, sleep: Callable[[float], None] = time.sleep):
        import httpx  # here, not at module level: only a run with a remote verifier needs it
        self.url: str = cfg.url
        self.timeout_s, self.retries, self.backoff_s = cfg.timeout_s, cfg.retries, cfg.backoff_s
        self._sleep = sleep  # the backoff's wait (tests record it)
        self._httpx = httpx
        self._client = httpx.Client(timeout=httpx.Timeout(cfg.timeout_s), follow_redirects=False)

    def __call__(self, problem: Problem, response: Response) -> RewardValue | Any:
        body = payload(problem, response)
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return self._attempt(body)
            except _Retry as err:
                last = err
            if attempt + 1 < attempts:
                self._sleep(self.backoff_s * 2 ** attempt)
        raise RemoteError(f"remote verifier {self.url}: {last} (after {attempts} attempt{'s' * (attempts > 1)})")

    def _attempt(self, body: bytes) -> Any:
        httpx = self._httpx
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._client.stream("POST", self.url, content=body,
                                     headers={"content-type": "application/json"}) as answer:
                data = bytearray()
                for chunk in answer.iter_bytes():
                    data += chunk
                    if len(data) > MAX_ANSWER_BYTES:
                        raise RemoteError(f"remote verifier {self.url}: answered more than {MAX_ANSWER_BYTES} "
                                          "bytes; answer a number or an object of numbers")
                    if time.monotonic() > deadline:  # httpx's timeout is per read: a slow drip passes it
                        raise _Retry(f"timed out after {self.timeout_s:g} s (the answer kept dripping)")
                status = answer.status_code
        except httpx.TimeoutException:
            raise _Retry(f"timed out after {self.timeout_s:g} s") from None
        except httpx.TransportError as err:  # connection refused or reset, protocol errors
            raise _Retry(f"{type(err).__name__}: {err}") from None
        except httpx.HTTPError as err:  # e.g. an invalid URL: no attempt would do better
            raise RemoteError(f"remote verifier {self.url}: {type(err).__name__}: {err}") from None
        if status >= 500 or status == 429:
            raise _Retry(f"HTTP {status}: {_snippet(data)}")
        if status >= 300:
            raise RemoteError(f"remote verifier {self.url}: HTTP {status} ({_snippet(data)}); the request was "
                              "refused, so it is not retried")
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise RemoteError(f"remote verifier {self.url}: answered a body that is not JSON ({_snippet(data)}); "
                              "answer a number or an object of numbers") from None
        if isinstance(value, dict) and set(value) == {"reward"} and isinstance(value["reward"], numbers.Real):
            return value["reward"]
        return value

    def close(self) -> None:
        self._client.close()


def _snippet(data: bytes | bytearray, limit: int = 80) -> str:
    text = bytes(data[:limit]).decode("utf-8", "replace")
    return repr(text + ("..." if len(data) > limit else ""))
