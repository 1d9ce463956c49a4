"""Bad data fails one trajectory, never the rollout: a `Rollout` in-process (its controller a
FakeChannel, weights in a real weight store) on the real torch engine (CPU, a tiny model) and on
the emulated one, fed work no engine can take (a prompt longer than model.max_seq_len, token ids
outside the vocabulary, resumed work without room or with broken log-probs) and work the real
engine fails on while generating (weights whose embedding row of one token is NaN), next to good
work. The good trajectories finish as always; each bad one finishes as an error result (finish
"error: ...", no reward, no tokens: the controller drops its group instead of requeueing it);
the loop goes on serving until the controller says stop."""
from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import FakeChannel, close_rollout, role_context, work_item

from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.model.factory import model_args
from laminar_hpc.model.llama import ModelArgs, Transformer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.rollout.engine_interface import SeqRequest
from laminar_hpc.rollout.emulated_engine import EmulatedEngine
from laminar_hpc.rollout.torch_engine import TorchEngine
from laminar_hpc.rollout.main import Rollout
from laminar_hpc.transport.protocol import Assign, Finished, Stop, WantWork
from laminar_hpc.transport.weight_store import WeightStore, checksum, digest_to_int

# the torch engine on the tiny config (CharTokenizer, model.max_seq_len=32, max_new_tokens=12),
# embeddings untied: a NaN embedding row must not also be the lm_head row of every logit
TORCH = ("configs/tiny.yaml", ("rollout.verify_checksum=false", "model.tie_embeddings=false", "rollout.max_batch=4"))
EMULATED = ("configs/tiny-emulated.yaml", ())


def use_engine(r: Rollout, engine) -> None:
    """Replace a rollout's engine: its own and its components' reference (they receive it when built)."""
    r.engine = r.calls.engine = r.turns.engine = engine


@pytest.fixture
def make(tmp_path):
    made, stores = [], []

    def build(config: tuple[str, tuple[str, ...]], engine=None) -> Rollout:
        """A rollout (its engine replaced by `engine` if given) before its first weights."""
        r = Rollout(role_context("rollout", 0, tmp_path, config=config[0], overrides=config[1]), relay=0)
        if engine is not None:
            use_engine(r, engine)
        made.append(r)
        return r

    def publish(r: Rollout, model: Transformer | None = None) -> None:
        """What the node's relay does: version 0 into its weight store (`model`'s weights, else zeros)."""
        store = WeightStore.create(r.weights.path, 2, r.layout.nbytes)
        stores.append(store)
        slot, view = store.begin(0)
        view = view[:r.layout.nbytes]
        if model is not None:
            r.layout.pack(model, view)
        store.commit(slot, 0, r.layout.nbytes, checksum(view), digest_to_int(r.layout.digest))

    build.publish = publish
    yield build
    for r in made:
        close_rollout(r)
    for s in stores:
        s.close()


def serve(r: Rollout, *batches: list) -> dict:
    """`run` as the process runs it: the controller assigns batch i once the rollout asked for
    work i + 1 times, and says stop when every trajectory came back. Returns them by id."""
    pending, ids, calls = list(batches), {w.traj_id for b in batches for w in b}, [0]

    def controller(ch: FakeChannel):
        calls[0] += 1
        assert calls[0] < 100_000, "the rollout loop did not finish its work"
        if pending and len(ch.of(WantWork)) > len(batches) - len(pending):
            return [Assign(work=pending.pop(0))]
        if not pending and ids <= {m.trajectory.traj_id for m in ch.of(Finished)}:
            return [Stop(reason="done")]
        return []

    r.ctx.ctrl.script = controller
    r.run({})  # returns only on the controller's stop: nothing raised out of the loop
    finished = [m.trajectory for m in r.ctx.ctrl.of(Finished)]
    assert len(finished) == len({t.traj_id for t in finished}) == len(ids)  # each exactly once
    assert not r.running and not r.engine.num_active()
    return {t.traj_id: t for t in finished}


def assert_good(t, eos_id: int) -> None:
    assert t.finish in ("eos", "length") and isinstance(t.reward, float), t.finish
    assert 0 < len(t.tokens) == len(t.logprobs) and all(math.isfinite(x) for x in t.logprobs)
    assert (t.finish == "eos") == (t.tokens[-1] == eos_id)


def assert_error(t, *words: str) -> None:
    assert t.finish.startswith("error: ") and all(w in t.finish for w in words), t.finish
    assert t.reward is None and t.tokens == [] and t.logprobs == [] and t.t_end >= t.t_start


# -- refused at admission ------------------------------------------------------------------------
def test_torch_rollout_refuses_a_too_long_prompt_and_foreign_token_ids_and_serves_the_rest(make):
    """Today the torch engine raises on the first (ValueError) and indexes past its embedding on
    the second (IndexError): either ends the rollout, and the requeued item the next one."""
    r = make(TORCH)
    torch.manual_seed(0)
    make.publish(r, Transformer(r.engine.args))
    vocab, limit = r.engine.args.vocab_size, r.engine.args.max_seq_len
    good = [work_item(i, group=1, prompt=(5, 6, 7 + i), max_new_tokens=12) for i in range(3)]
    bad = [work_item(0, group=2, prompt=[5] * (limit + 8), max_new_tokens=12),
           work_item(1, group=2, prompt=(5, vocab + 3, 6), max_new_tokens=12),
           work_item(2, group=2, prompt=(5, -1, 6), max_new_tokens=12)]
    later = [work_item(i, group=3, prompt=(8, 9), max_new_tokens=12) for i in range(2)]
    done = serve(r, [good[0], bad[0], good[1], bad[1], bad[2], good[2]], later)
    for w in good + later:
        assert_good(done[w.traj_id], r.tok.eos_id)
    assert_error(done["2.0"], "refused", f"{limit + 8} tokens leave no room", f"model.max_seq_len={limit}")
    assert_error(done["2.1"], "refused", f"token id {vocab + 3} outside the vocabulary of {vocab}")
    assert_error(done["2.2"], "refused", "token id -1 outside")
    assert r.errors == 3
    # every slot came back: each error returned its credit, as a finished trajectory does
    asked = sum(m.credit for m in r.ctx.ctrl.of(WantWork))
    assert asked + r.credit_to_return == r.engine.max_batch + len(good + bad + later)


def test_emulated_rollout_refuses_what_a_real_engine_could_not_take(make):
    """Today the emulated engine generates from foreign token ids and broken log-probs (a real
    engine could not) and raises on resumed work without room, ending the rollout."""
    r = make(EMULATED)
    make.publish(r)
    vocab = r.engine.vocab_size
    good = [work_item(i, prompt=(5, 6, 7), max_new_tokens=64) for i in range(3)]
    good.append(work_item(3, prompt=(5, 6), max_new_tokens=64, tokens=[9, 10], logprobs=[-1.0, -2.0], version=0))
    bad = {"1.0": (dict(prompt=(5, vocab, 6)), f"token id {vocab} outside the vocabulary of {vocab}"),
           "1.1": (dict(prompt=()), "empty prompt"),
           "1.2": (dict(tokens=[9] * 4, logprobs=[-1.0] * 4, max_new_tokens=4), "no room to generate"),
           "1.3": (dict(tokens=[9, 10], logprobs=[-1.0]), "2 resumed tokens but 1 log-probs"),
           "1.4": (dict(tokens=[9], logprobs=[float("nan")]), "log-prob is not finite")}
    items = [work_item(int(t[2:]), group=1, **{"prompt": (5, 6), "max_new_tokens": 64, "version": 0, **kw})
             for t, (kw, _) in bad.items()]
    done = serve(r, good[:2] + items + good[2:])
    for w in good:
        assert_good(done[w.traj_id], r.tok.eos_id)
    assert done["0.3"].tokens[:2] == [9, 10]  # the resumed one continued its tokens
    for traj, (_, why) in bad.items():
        assert_error(done[traj], "refused", why)
    assert r.errors == len(bad)


# -- failed while generating -----------------------------------------------------------------------
def peaked(args: ModelArgs, seed: int = 0) -> Transformer:
    """A model whose next token is certain even at temperature 1 (its lm_head scaled up: every
    other token's probability underflows to 0), so what a prompt generates is known in advance."""
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e5)
    return model


@torch.no_grad()
def continuation(model: Transformer, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    while len(toks) < min(len(prompt) + n, model.args.max_seq_len):
        toks.append(int(model(torch.tensor([toks]))[0, -1].argmax()))
    return toks[len(prompt):]


def poison_for(model: Transformer, good: list[list[int]], n: int, eos_id: int, seed: int = 1):
    """(a prompt, the token T it generates first): T is in no prompt and in nothing the good
    prompts generate, nor EOS. With T's embedding row NaN, the prompt prefills cleanly and its
    first decode step (T in, at position len(prompt)) gives non-finite logits; the others never see T."""
    seen = {t for p in good for t in p + continuation(model, p, n)} | {eos_id}
    rng = random.Random(seed)
    for _ in range(200):
        prompt = [rng.randrange(4, model.args.vocab_size) for _ in range(rng.randrange(6, 12))]
        first = continuation(model, prompt, 1)[0]
        if first not in seen and first not in prompt:
            return prompt, first
    raise AssertionError("no prompt generates a token the good prompts never use (change the seed)")


def nan_row(model: Transformer, token: int) -> Transformer:
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("nan")
    return model


def test_torch_rollout_fails_the_one_sequence_whose_step_gives_non_finite_logits(make):
    """Real weights that overflow on one token: the sequence that feeds it ends with an error in
    the middle of a batch, the others in that batch and a later batch finish. Today sampling
    raises for the whole batch (torch.multinomial on NaN probabilities) and the rollout ends."""
    r = make(TORCH)
    model = peaked(r.engine.args)
    good = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    prompt, token = poison_for(model, good, 12, r.tok.eos_id)
    make.publish(r, nan_row(model, token))
    first = [work_item(0, group=1, prompt=good[0], max_new_tokens=12),
             work_item(1, group=1, prompt=prompt, max_new_tokens=12),
             work_item(2, group=1, prompt=good[1], max_new_tokens=12)]
    later = [work_item(0, group=2, prompt=good[2], max_new_tokens=12)]
    done = serve(r, first, later)
    assert_error(done["1.1"], f"non-finite logits at position {len(prompt) + 1}")
    for w in (first[0], first[2], *later):
        assert_good(done[w.traj_id], r.tok.eos_id)
        assert done[w.traj_id].tokens == continuation(model, w.prompt, 12)[:len(done[w.traj_id].tokens)]
    assert r.errors == 1


def test_a_failed_sequence_leaves_no_nan_in_its_cache_slot():
    """The KV cache slot of a sequence that failed on NaN is reused: a shorter sequence there
    masks the old positions, but a masked NaN value still reaches attention's weighted sum (0 * NaN)."""
    args = model_args(ModelCfg(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                               tie_embeddings=False), vocab_size=40)
    model = peaked(args, seed=3)
    long_good, short_good = list(range(4, 24)), [4, 5, 6]
    prompt, token = poison_for(model, [long_good, short_good], 8, eos_id=-1)
    layout = WeightLayout.from_model(model, "float32")
    buf = bytearray(layout.nbytes)
    layout.pack(nan_row(model, token), memoryview(buf))
    engine = TorchEngine(args, eos_id=-1, max_batch=2)
    engine.load_weights(0, memoryview(buf), layout)
    engine.add([SeqRequest("long", long_good, 8), SeqRequest("poison", prompt, 8)])
    (failed,) = [o for o in engine.step() if o.error]  # the poison's NaN is now at its slot, position len(prompt)
    assert failed.traj_id == "poison" and failed.finished and failed.request.traj_id == "poison"
    assert engine.active_ids() == ["long"] and len(short_good) < len(prompt) < len(long_good)
    outs = engine.add([SeqRequest("short", short_good, 6)])  # into the slot the poison left
    while engine.num_active():
        outs += engine.step()
    assert not [o for o in outs if o.error]
    short = next(o.request for o in outs if o.traj_id == "short" and o.finished)
    assert short.tokens == continuation(model, short_good, 6) and all(math.isfinite(x) for x in short.logprobs)


# -- an engine call that raises ----------------------------------------------------------------------
class FlakyEngine(EmulatedEngine):
    """An engine with a bug on one request (as vLLM raising from `step` over one bad input):
    `step` raises while a trajectory in `poison` is in the batch; `broken` makes every call raise."""

    poison: set[str] = set()
    broken = False

    def add(self, requests):
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().add(requests)

    def step(self):
        hit = self.poison.intersection(self.active_ids())
        if self.broken or hit:
            raise RuntimeError(f"device-side assert triggered ({sorted(hit)})")
        return super().step()


def flaky(r: Rollout, poison: set[str]) -> FlakyEngine:
    e = r.engine
    f = FlakyEngine(e.emu, seed=e.seed, eos_id=e.eos_id, vocab_size=e.vocab_size, max_batch=e.max_batch,
                    nbytes=e.array.nbytes, length_seed=e.length_seed)
    f.poison = poison
    return f


def test_a_request_an_engine_step_raises_for_fails_alone_and_a_broken_engine_ends_the_role(make):
    """The step raises for the whole batch; each sequence then runs alone and only the one that
    raises again fails: the others continue with every token they had. Today the exception ends
    the rollout. An engine that raises for every sequence alone is broken, not the data: the role
    ends (its trajectories are requeued) instead of failing them all."""
    r = make(EMULATED)
    use_engine(r, flaky(r, {"1.2"}))
    make.publish(r)
    first = [work_item(i, group=1, prompt=(5, 6, 7), max_new_tokens=64) for i in range(4)]
    later = [work_item(i, group=2, prompt=(5, 6), max_new_tokens=64) for i in range(2)]
    done = serve(r, first, later)
    assert_error(done["1.2"], "engine step failed: RuntimeError: device-side assert")
    for w in first[:2] + first[3:] + later:
        assert_good(done[w.traj_id], r.tok.eos_id)
    assert r.errors == 1 and r.calls.failures == 0

    r.engine.broken = True
    r.stopping = False
    r.ctx.ctrl.inbox.clear()
    r.ctx.ctrl.script = None
    sent = len(r.ctx.ctrl.sent)
    r.queue.extend(work_item(i, group=3, prompt=(5, 6), max_new_tokens=64) for i in range(3))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        r.admit(draining=False)
    assert not r.ctx.ctrl.of(Finished)[len(done):] and len(r.running) == 3  # none failed: requeued by the controller
    assert r.errors == 1 and len(r.ctx.ctrl.sent) == sent


def test_a_reward_function_that_raises_scores_that_trajectory_0_with_the_reason(make, tmp_path):
    """The user's reward code failing on one response (a function meeting text it did not
    expect): that trajectory keeps its tokens and scores 0 with the reason, counted and traced;
    the rollout goes on. (Before the reward pool the exception ended the rollout; then it failed
    the trajectory as an error result, its tokens lost.)"""
    code = tmp_path / "picky.py"
    code.write_text("def score(problem, response):\n"
                    "    if problem.index == 7:\n"
                    "        raise KeyError('no answer found in the response')\n"
                    "    return 1.0\n")
    r = make((EMULATED[0], (*EMULATED[1], f"task.reward.fn={code}:score")))
    make.publish(r)
    work = [work_item(i, group=g, prompt=(5, 6), max_new_tokens=64) for g in (6, 7, 8) for i in range(2)]
    done = serve(r, work)  # work_item: problem = group
    for w in work:
        t = done[w.traj_id]
        assert_good(t, r.tok.eos_id)
        if w.group_id == 7:
            assert t.reward == 0.0 and t.reward_error == "exception"
        else:
            assert t.reward == 1.0 and t.reward_error is None
    assert r.errors == 0 and r.scoring.failures == 2
