"""Stream shards (controller/shard.py) in process: what a shard keeps of its rollouts' tokens and
what it passes on (controller/shard_store.py), the controller's data plane when its partials hold
no tokens (controller/pools.py, partial.py, moves.py), and the routing of frames through shards
(controller/routes.py)."""
from __future__ import annotations

from helpers import data_plane, problem, result, tokenize, trajectory, work_item

from laminar_hpc.config import load_config
from laminar_hpc.config.shards import shard_of
from laminar_hpc.controller.routes import Routes
from laminar_hpc.controller.shard_store import ShardStore
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import (Finished, Heartbeat, Relayed, Stream, WantGroups, WantWork, decode, encode,
                                            finished_tail, pack_items, stream_frame, StreamItem)

from helpers import REPO


def _store(**kw) -> ShardStore:
    return ShardStore(1, Limits(vocab_size=2000), max_new_tokens=16, prompt=lambda p: tokenize(problem(p)), **kw)


def _stream(store: ShardStore, traj_id: str, tokens: list[int], offset: int, rollout: int = 3, version: int = 0):
    frame = stream_frame([StreamItem(traj_id=traj_id, tokens=tokens, logprobs=[-0.5] * len(tokens), version=version,
                                     offset=offset)])
    store.stream(frame.chunks, list(frame.items), rollout)


def test_a_finished_tail_is_joined_at_its_shard_and_passed_on_as_metadata():
    store = _store()
    w, why = store.with_prompt(work_item(0, group=7, prompt=()))  # the controller sent no prompt: built here
    assert why is None and w.prompt_list() == tokenize(problem(7))
    store.register(3, w)
    _stream(store, "7.0", [5, 6], 0)
    _stream(store, "7.0", [7], 2)
    whole = result(w, [5, 6, 7, 8], reward=1.0, finish="eos")
    meta = store.finish(finished_tail(whole, 3), rollout=3)
    # the controller gets no token: only where they are and how many
    assert meta.shard == 1 and meta.length == 4 and meta.total_tokens == 4
    assert not meta.tokens and not meta.prompt and not meta.logprobs and meta.reward == 1.0
    assert len(encode(Finished(trajectory=meta))) < 200
    got, missing = store.take_finished(["7.0", "9.9"])
    assert missing == ["9.9"] and got[0].token_list() == [5, 6, 7, 8] and got[0].prompt_list() == w.prompt_list()
    assert store.take_finished(["7.0"]) == ([], ["7.0"])  # taken: the trainer's alone now


def test_what_a_shard_cannot_join_or_check_goes_on_as_it_came():
    store = _store()
    w, _ = store.with_prompt(work_item(0, group=2, prompt=()))
    store.register(3, w)
    _stream(store, "2.0", [5, 6], 0)
    whole = result(w, [5, 6, 7], finish="eos")
    assert store.finish(finished_tail(whole, 1), rollout=3) is None  # continues after token 1: not what it holds
    assert store.finish(finished_tail(whole, 2), rollout=4) is None  # rollout-4 does not hold it
    bad = result(w, [5, 6, 99999], finish="eos")  # outside the vocabulary: the controller refuses it
    assert store.finish(finished_tail(bad, 2), rollout=3) is None and "2.0" not in store.finished
    assert store.counts["refused_passed_on"] == 1


def test_a_restarted_shard_keeps_a_whole_result_and_ignores_a_duplicate():
    store = _store()  # holds nothing: the rollout sends what it finishes whole (a new epoch)
    whole = trajectory(0, group=4, tokens=(5, 6), finish="eos")
    meta = store.finish(whole, rollout=0)
    assert meta is not None and meta.length == 2 and "4.0" in store.finished
    assert store.finish(whole, rollout=0) is None  # the same again: the controller ignores a duplicate


def test_unusable_prompts_are_refused_at_the_shard():
    store = ShardStore(0, Limits(vocab_size=2000, max_prompt_tokens=2), max_new_tokens=16,
                       prompt=lambda p: tokenize(problem(p)))
    w, why = store.with_prompt(work_item(0, group=3, prompt=()))
    assert why is not None and "max_prompt_tokens" in why
    assert store.with_prompt(work_item(1, group=3, prompt=()))[1] == why  # (built once per problem)


def test_resumed_work_takes_the_tokens_its_shard_holds():
    store = _store()
    w, _ = store.with_prompt(work_item(0, group=5, prompt=()))
    store.register(3, w)
    _stream(store, "5.0", [5, 6, 7], 0, version=2)
    resumed = store.take_work(work_item(0, group=5, prompt=w.prompt_list(), shard=1, version=2))
    assert resumed.shard is None and resumed.token_list() == [5, 6, 7] and resumed.version == 2
    store.register(0, resumed)  # rollout-0 continues it: its stream goes on from token 3
    _stream(store, "5.0", [8], 3, rollout=0, version=2)
    assert store.pool.partials["5.0"].token_list() == [5, 6, 7, 8]
    # another shard's fetch takes what it holds; nothing held: from the prompt
    work, missing = store.take_partials(["5.0", "6.0"])
    assert [x.token_list() for x in work] == [[5, 6, 7, 8]] and missing == ["6.0"]
    fresh = store.take_work(work_item(0, group=5, prompt=w.prompt_list(), shard=1, version=2))
    assert not fresh.tokens and fresh.version is None


def test_forget_drops_partials_and_results():
    store = _store()
    w, _ = store.with_prompt(work_item(0, group=1, prompt=()))
    store.register(3, w)
    store.finished["1.1"] = trajectory(1, group=1)
    store.forget(["1.0", "1.1"])
    assert not store.pool.partials and not store.finished


def _sharded_plane(shards: int = 2):
    dp = data_plane(group_size=2)
    dp.pool.shard_of = lambda r: shard_of(r, shards)
    dp.pool.version_of = lambda r: 3
    return dp


def test_a_sharded_data_plane_holds_no_token():
    dp = _sharded_plane()
    dp.admit(1)
    assert all(p.prompt == b"" for p in dp.partials.values())  # the shards build the prompts
    work = dp.assign(1, 2)
    assert [w.prompt for w in work] == [b"", b""] and {p.shard for p in dp.partials.values()} == {1}
    meta = trajectory(0, group=0, tokens=(), prompt=(), rollout=1, finish="eos", shard=1, length=5)
    dp.finish(meta, rollout=1)
    dp.finish(trajectory(1, group=0, tokens=(), prompt=(), rollout=1, finish="eos", shard=1, length=3), rollout=1)
    assert dp.tokens_generated == 8
    (g,) = dp.ledger.take_groups(1)
    assert [t.shard for t in g.trajectories] == [1, 1] and not any(t.tokens for t in g.trajectories)


def test_a_dead_rollouts_work_resumes_from_its_shard():
    dp = _sharded_plane()
    dp.admit(1)
    dp.assign(1, 2)
    held = dp.requeue_rollout(1)
    assert len(held) == 2  # its tokens may be at shard 1: placed, not restarted
    w = dp.place(held[0].traj_id, 2)
    assert w.shard == 1 and w.version == 3  # the front shard of rollout-2 (shard 0) takes them from shard 1
    assert dp.partials[w.traj_id].shard == 0
    dp.restart(held[1].traj_id)  # restarted: shard 1 forgets what it holds of it
    assert dp.pool.forgotten == [held[1].traj_id]


def test_a_refused_prompt_drops_its_group_for_admission_to_replace():
    dp = _sharded_plane()
    dp.admit(1)
    dp.assign(1, 2)
    dp.prompt_refused("0.0", "12 prompt tokens exceed task.max_prompt_tokens=8 (filtered)")
    dp.prompt_refused("0.1", "the same")  # its group is gone: counted once
    assert dp.refused["prompts"] == 1 and dp.refused["prompts_too_long"] == 1 and list(dp.refused_problems) == [0]
    assert dp.ledger.dropped == {0: "prompt_refused"} and not dp.partials
    assert sorted(dp.pool.forgotten) == ["0.0", "0.1"]


def test_routes_carry_only_a_rollouts_messages():
    routes = Routes(shards=2)
    assert routes.shard_for("rollout-3") == 1 and routes.shard_for("rollout-3.hb") == 1
    assert routes.shard_for("trainer-0") is None and Routes(0).shard_for("rollout-3") is None
    batch = Relayed(frames=[("rollout-3", encode(WantWork(credit=2, version=0))),
                            ("rollout-3", encode(WantGroups(n=4))),  # a trainer's message
                            ("trainer-0", encode(Heartbeat(t=1.0))),  # not a rollout
                            ("rollout-5", b"\x00garbage"),
                            ("rollout-5", encode(Stream(items=pack_items([StreamItem(
                                traj_id="1.0", tokens=[5], logprobs=[-0.1], version=0)]))))])
    got = routes.unpack("shard-0", decode(encode(batch)))
    assert [(i, type(m).__name__) for i, m in got] == [("rollout-3", "WantWork"), ("rollout-5", "Stream")]
    assert routes.dropped == 3 and routes.with_tokens == 1
    assert routes.shard_for("rollout-3") == 0  # heard through shard 0: answered through it


def test_routes_send_each_shard_its_batch_forgetting_first():
    sent = []

    class Server:
        def send_frame(self, ident, frame):
            sent.append((ident, decode(frame)))

    routes = Routes(shards=2)
    routes.queue(1, "rollout-1", encode(Heartbeat(t=1.0)))
    routes.flush(Server(), forget=["4.0"])
    assert [(i, m.forget, len(m.frames)) for i, m in sent] == [("shard-0", ["4.0"], 0), ("shard-1", ["4.0"], 1)]
    sent.clear()
    routes.flush(Server(), forget=[])
    assert sent == []  # nothing to say


def test_auto_shards_follow_the_rollout_nodes():
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.controller.shards == "auto" and cfg.stream_shards == 0  # one node: the controller takes the tokens
    many = cfg.model_copy(update={"slurm": cfg.slurm.model_copy(update={
        "layout": cfg.slurm.layout.model_copy(update={"rollout_nodes": 64})})})
    assert many.stream_shards == 4
    assert cfg.model_copy(update={"controller": cfg.controller.model_copy(update={"shards": 3})}).stream_shards == 3


def test_the_shard_count_is_resolved_once_per_config_and_auto_stays_auto(monkeypatch):
    # issue 47: `controller.shards` was resolved again at each of 11 call sites; now the config
    # model resolves it once and the launcher, the roles and the controller read that value
    from laminar_hpc.config import schema
    from laminar_hpc.controller.membership import Membership
    from laminar_hpc.launch.plan import role_specs, slurm_plan
    from laminar_hpc.startup.role import controller_endpoint

    raw = load_config(REPO / "configs" / "tiny.yaml").model_dump(mode="json")
    raw["slurm"]["layout"]["rollout_nodes"], raw["rollout"]["count"] = 40, 40
    calls = []
    resolve = schema.resolve_shards
    monkeypatch.setattr(schema, "resolve_shards", lambda *a: calls.append(a) or resolve(*a))
    cfg = schema.Config.model_validate(raw)
    assert calls == [("auto", 40)] and cfg.stream_shards == 3
    names = [s.name for s in role_specs(cfg)]
    assert [n for n in names if n.startswith("shard-")] == ["shard-0", "shard-1", "shard-2"]
    assert {"shard-0", "shard-1", "shard-2"} <= Membership.of(cfg).names
    assert controller_endpoint(cfg, "rollout", 4) == "shard-1"
    slurm_plan(cfg)
    assert len(calls) == 1, "the shard count was resolved again after the config was loaded"
    # what is written back keeps the user's word: a resume compares `auto` with `auto`
    assert cfg.controller.shards == "auto" and cfg.model_dump()["controller"]["shards"] == "auto"


def test_a_bad_shard_count_is_one_plain_line():
    import pytest
    from pydantic import ValidationError

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    for bad in (-1, "lots", True):
        with pytest.raises(ValidationError) as err:
            type(cfg.controller).model_validate({**cfg.controller.model_dump(), "shards": bad})
        assert "0 or more), or auto" in str(err.value) and "constrained" not in str(err.value)
    assert type(cfg.controller).model_validate({**cfg.controller.model_dump(), "shards": "3"}).shards == 3
