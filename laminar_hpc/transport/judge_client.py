"""How a rollout's reward call asks a judge (judge/server.py) for its verdict.

The Scorer (tasks/rewards/scorer.py) calls it from the reward pool's threads or worker processes,
beside the decode loop, for every function that takes a `judge` argument:

    client = JudgeClient(run_dir, "rollout-3", judge_cfg, controller_cfg)
    score, why = client(problem, response)     # (0.83, None), or (0.0, "the verdict ... holds no number")

Requests go round-robin over the judges, so every judge gets a share of each rollout's work and
batches it with the other rollouts'. A judge that does not answer within `timeout_s` (dead,
restarting, stuck) is left for the next one, up to one try per judge and one more; its late
answer, if any, is dropped by its request number. All of them silent: JudgeError, which the
Scorer scores 0 as `judge`, counted. Each thread (and each pool process) has its own sockets,
with an identity of its own (`rollout-3.judge<pid><n>`): a judge's ROUTER tells its askers apart
by it. Picklable, for a process pool: the sockets are made where it is used.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import Client, WaitTimeout, wait_endpoint
from laminar_hpc.transport.protocol import JudgeRequest, JudgeVerdict
from laminar_hpc.transport.authz import kind_of
from laminar_hpc.transport.security import client_keys

if TYPE_CHECKING:
    from laminar_hpc.config.judge import JudgeCfg
    from laminar_hpc.config.schema import Config, ControllerCfg


class JudgeError(RuntimeError):
    """No judge answered; the message names them and how long each was given."""


def problem_text(problem) -> str:
    """The problem (a tasks.problem.Problem) as the policy saw it: its prompt, or a chat row's last
    user message."""
    if problem.prompt or not problem.messages:
        return problem.prompt
    users = [m.get("content", "") for m in problem.messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def judge_client_for(cfg: Config, run_dir: str | Path, identity: str) -> "JudgeClient | None":
    """How role `identity` asks the campaign's judges, None without judges: what a
    Scorer takes as `judge` (the rollouts' reward calls, the trainer's warm-up evaluation)."""
    judge = cfg.task.reward.judge
    if judge is None:
        return None
    return JudgeClient(run_dir, identity, judge, cfg.controller, startup_s=cfg.timeouts.startup_s)


class JudgeClient:
    def __init__(self, run_dir: str | Path, identity: str, cfg: JudgeCfg, controller_cfg: ControllerCfg,
                 startup_s: float = 120.0):
        self.run_dir, self.identity, self.cfg = str(run_dir), identity, cfg
        self.controller_cfg, self.startup_s = controller_cfg, startup_s
        self._setup()

    def _setup(self) -> None:
        self._local = threading.local()
        self._numbers = itertools.count(1)
        self._turn = itertools.count()
        self._sockets = itertools.count()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k in ("run_dir", "identity", "cfg", "controller_cfg",
                                                                  "startup_s")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def __call__(self, problem, response) -> tuple[float, str | None]:
        """The verdict on `response` (a tasks.problem.Response) to `problem`: (score, None), or
        (0.0, why its verdict could not be read); JudgeError when no judge answered."""
        with self._lock:
            number, first = next(self._numbers), next(self._turn)
        req = JudgeRequest(request=number, problem=problem_text(problem), response=response.text,
                           answer=problem.answer or "")
        n = self.cfg.replicas
        tried = []
        for attempt in range(n + 1):
            name = f"judge-{(first + attempt) % n}"
            verdict = self._ask(name, req)
            if verdict is not None:
                return verdict.score, verdict.error
            tried.append(name)
        raise JudgeError(f"no judge answered within task.reward.judge.timeout_s={self.cfg.timeout_s:g}s "
                         f"(asked {', '.join(tried)})")

    def _ask(self, name: str, req: JudgeRequest) -> JudgeVerdict | None:
        deadline = time.monotonic() + self.cfg.timeout_s
        try:
            client = self._client(name)
            client.send(req, timeout_s=self.cfg.timeout_s)
        except WaitTimeout:
            return None
        while (left := deadline - time.monotonic()) > 0:
            msg = client.recv(left)
            if isinstance(msg, JudgeVerdict) and msg.request == req.request:
                return msg
            # else: nothing yet (None ends the loop by the deadline), or a late verdict for a
            # request this thread gave up on
        return None

    def _client(self, name: str) -> Client:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        if name not in clients:
            rd = RunDir(self.run_dir)
            # a judge still starting (loading its model) publishes its address when it serves
            address = wait_endpoint(rd, name, self.startup_s)
            with self._lock:
                k = next(self._sockets)
            ident = f"{self.identity}.judge{os.getpid():07d}{k:04d}"
            # the asking role's own key (a rollout's, or the trainer's for its warm-up's evaluation)
            kind = kind_of(self.identity) or "rollout"
            clients[name] = Client(address, ident, keys=client_keys(rd, kind, self.controller_cfg, server="judge"),
                                   endpoint=rd.endpoint(name))
        return clients[name]
