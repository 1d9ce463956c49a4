"""The vLLM rollout engine driven against a recording stand-in of vLLM (tests/vllm_standin.py):
call order of the weight-update API, tensor names and aliasing, token/log-prob mapping, abort and
re-prefill, sleep/wake around loads, the one-version invariant, that nothing imports vllm, and
that the sampling settings it gives vLLM yield the torch engine's mu (against a reference of
vLLM's processed log-probs written from vLLM's source)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from laminar_hpc.config import config_from_dict
from laminar_hpc.config.schema import ModelCfg, VllmCfg
from laminar_hpc.model.factory import model_args
from laminar_hpc.model.llama import Transformer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.rollout import vllm_engine
from laminar_hpc.rollout.engine_interface import SeqRequest, VersionInFlightError
from laminar_hpc.rollout.vllm_engine import VllmEngine, meta_layout
from vllm_standin import (
    CompletionOutput, RecordingStager, RequestOutput, StandinEngine, logprob_at, standin_api, token_at,
)

EOS = 2
ARGS = model_args(ModelCfg(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                           tie_embeddings=False), vocab_size=100)


def make_engine(*, max_batch=4, eos_at=None, tokens_per_step=1, **vcfg):
    api = standin_api()
    llm = api.LLM("m", vocab=ARGS.vocab_size, max_model_len=64, eos_at=eos_at, tokens_per_step=tokens_per_step)
    stager = RecordingStager()
    # the stand-in's model config has no get_vocab_size (vLLM's has): the vocabulary is given
    engine = VllmEngine(llm, api, VllmCfg(**vcfg), eos_id=EOS, max_batch=max_batch, temperature=1.0, top_p=1.0,
                        stager=stager, vocab_size=ARGS.vocab_size)
    return engine, llm, stager


def layout_and_buffer(dtype="bfloat16"):
    layout = meta_layout(ARGS, dtype)
    buf = bytearray(layout.nbytes)
    np.frombuffer(buf, np.uint8)[:] = np.arange(layout.nbytes) % 251
    return layout, buf


def aliases(t: torch.Tensor, buf: bytearray) -> bool:
    base = np.frombuffer(buf, np.uint8).ctypes.data
    end = t.data_ptr() + t.numel() * t.element_size()
    return t.device.type == "cpu" and base <= t.data_ptr() and end <= base + len(buf)


def run(engine, limit=200):
    done = {}
    for _ in range(limit):
        if not engine.num_active():
            return done
        for o in engine.step():
            if o.finished:
                done[o.traj_id] = o.request
    raise AssertionError(f"still {engine.num_active()} sequences after {limit} steps")


# -- weights ------------------------------------------------------------------------------------
def test_meta_layout_is_the_trainers_layout():
    """The layout built without allocating weights equals the one the trainer publishes."""
    assert meta_layout(ARGS, "bfloat16") == WeightLayout.from_model(Transformer(ARGS), "bfloat16")


def test_transfer_engine_call_order_names_and_aliasing():
    layout, buf = layout_and_buffer()
    # staging limit below the layout size: several update_weights chunks
    engine, llm, stager = make_engine(enable_sleep_mode=False, staging_mb=layout.nbytes / 3 / 2**20)
    assert llm.kwargs == {"max_model_len": 64} and llm.calls == [("init_weight_transfer_engine", {})]
    assert engine.load_weights(7, memoryview(buf), layout) is None
    names = llm.names()
    updates = [c for c in llm.calls if c[0] == "update_weights"]
    assert names == (["init_weight_transfer_engine", "start_weight_update"] + ["update_weights"] * len(updates)
                     + ["finish_weight_update", "reset_prefix_cache"])
    assert len(updates) >= 3
    assert llm.calls[-2] == ("finish_weight_update", "7") and engine.version == 7
    specs = {s.name: s for s in layout.specs}
    assert llm.updated_names == [s.name for s in layout.specs]  # every tensor once, in layout order
    for _, names_, dtypes, shapes, handles in updates:
        assert set(dtypes) == {"bfloat16"}
        assert shapes == [list(specs[n].shape) for n in names_]
        assert handles == [{"GPU-0": ("rebuild", n)} for n in names_]
    # what was staged to the GPU are views of the relay's buffer, not copies
    assert [n for n, _ in stager.staged] == llm.updated_names
    for name, t in stager.staged:
        s = specs[name]
        assert aliases(t, buf) and t.data_ptr() == np.frombuffer(buf, np.uint8).ctypes.data + s.offset


def test_sleep_mode_wraps_each_load():
    layout, buf = layout_and_buffer()
    engine, llm, _ = make_engine(enable_sleep_mode=True)
    engine.load_weights(1, memoryview(buf), layout)
    assert llm.calls[1:4] == [("sleep", 2), ("wake_up", ["weights"]), ("start_weight_update",)]
    assert llm.calls[-2:] == [("finish_weight_update", "1"), ("wake_up", ["kv_cache"])]


def test_reload_weights_mode_sends_aliasing_tensors_through_collective_rpc():
    layout, buf = layout_and_buffer("float32")
    engine, llm, stager = make_engine(enable_sleep_mode=False, weight_update="reload_weights")
    engine.load_weights(4, memoryview(buf), layout, checksum=True)
    assert llm.names() == ["collective_rpc", "reset_prefix_cache"] and not stager.staged
    _, method, kwargs = llm.calls[0]
    assert method == "reload_weights"
    items = kwargs["weights_iterator"]
    assert [n for n, _ in items] == [s.name for s in layout.specs]
    assert all(aliases(t, buf) and t.dtype == torch.float32 for _, t in items)


def test_checksum_is_the_stores_checksum():
    from laminar_hpc.transport.weight_store import checksum
    layout, buf = layout_and_buffer()
    engine, _, _ = make_engine(enable_sleep_mode=False)
    assert engine.load_weights(1, memoryview(buf), layout, checksum=True) == checksum(memoryview(buf))


def test_one_version_at_a_time():
    layout, buf = layout_and_buffer()
    engine, llm, _ = make_engine(enable_sleep_mode=True)
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.add([SeqRequest("a", [5, 6], 8)])
    engine.load_weights(1, memoryview(buf), layout)
    engine.add([SeqRequest("a", [5, 6], 8)])
    before = list(llm.calls)
    with pytest.raises(VersionInFlightError, match="version 1"):
        engine.load_weights(2, memoryview(buf), layout)
    with pytest.raises(VersionInFlightError):
        engine.sleep()
    assert llm.calls == before and engine.version == 1  # nothing reached vLLM


def test_an_in_flight_load_keeps_the_running_requests_and_their_kv():
    """Refresh in flight with the KV kept: no sleep (level 2 would drop the KV of the running
    requests), the transfer as usual, and a prefix cache vLLM could not reset (blocks in use) is
    counted, never an error."""
    layout, buf = layout_and_buffer()
    engine, llm, _ = make_engine(enable_sleep_mode=True)
    engine.load_weights(1, memoryview(buf), layout)
    engine.add([SeqRequest("a", [5, 6], 8)])
    engine.step()
    before = len(llm.calls)
    engine.load_weights(2, memoryview(buf), layout, in_flight=True)
    names = [c[0] for c in llm.calls[before:]]
    assert "sleep" not in names and "wake_up" not in names and "abort_request" not in names
    assert names[0] == "start_weight_update" and names[-2:] == ["finish_weight_update", "reset_prefix_cache"]
    assert engine.version == 2 and engine.active_ids() == ["a"] and engine.prefix_cache_kept == 1
    assert engine.step()[0].traj_id == "a"  # it goes on


def test_transfer_engine_refuses_a_vllm_without_the_api():
    class OldLLM:  # a vLLM from before the four-phase weight-transfer API
        def init_weight_transfer_engine(self, request): ...
        def update_weights(self, request): ...
    with pytest.raises(RuntimeError, match="LLM.start_weight_update"):
        VllmEngine(OldLLM(), standin_api(), VllmCfg(), eos_id=EOS, max_batch=2, temperature=1.0, top_p=1.0,
                   stager=RecordingStager())


# -- generation ---------------------------------------------------------------------------------
def loaded(**kw):
    layout, buf = layout_and_buffer()
    engine, llm, stager = make_engine(**{"enable_sleep_mode": False, **kw})
    engine.load_weights(3, memoryview(buf), layout)
    llm.calls.clear()
    return engine, llm


@pytest.mark.parametrize("per_step", [1, 3])
def test_tokens_and_sampled_logprobs_are_mapped(per_step):
    engine, llm = loaded(eos_at={"a": 2 + 5}, tokens_per_step=per_step)
    assert engine.add([SeqRequest("a", [5, 6], 20), SeqRequest("b", [7, 8, 9], 4)]) == []
    (p_a,), (p_b,) = [c[2:3] for c in llm.calls]
    assert p_a == [5, 6] and p_b == [7, 8, 9] and [c[3] for c in llm.calls] == [20, 4]
    assert engine.num_active() == 2 and engine.free_slots() == 2 and engine.active_ids() == ["a", "b"]
    assert engine.kv_tokens() == 5
    done = run(engine)
    a, b = done["a"], done["b"]
    assert a.tokens == [token_at("a", p, 100) for p in range(2, 7)] + [EOS]  # stopped by the EOS stop id
    assert b.tokens == [token_at("b", p, 100) for p in range(3, 7)]  # stopped by max_tokens
    assert a.logprobs == [logprob_at(p) for p in range(2, 8)] and b.logprobs == [logprob_at(p) for p in range(3, 7)]
    assert engine.num_active() == 0 and engine.kv_tokens() == 0


def test_sampling_params_ask_for_sampled_logprobs_and_deltas():
    engine, llm = loaded()
    seen = []
    real = llm.llm_engine.add_request
    llm.llm_engine.add_request = lambda rid, prompt, params: (seen.append(params.kwargs), real(rid, prompt, params))
    engine.add([SeqRequest("a", [5], 10)])
    (kw,) = seen
    assert kw["logprobs"] == 0 and kw["stop_token_ids"] == [EOS] and kw["max_tokens"] == 10
    assert kw["output_kind"].name == "DELTA" and kw["n"] == 1 and kw["detokenize"] is False
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (1.0, 1.0, 0)  # 0: top-k off, in vLLM too


def test_step_outputs_carry_only_new_tokens():
    engine, _ = loaded(tokens_per_step=2)
    engine.add([SeqRequest("a", [5, 6], 5)])
    outs = [o for _ in range(3) for o in engine.step()]
    assert [len(o.tokens) for o in outs] == [2, 2, 1] and [o.finished for o in outs] == [False, False, True]
    assert sum((o.tokens for o in outs), []) == outs[-1].request.tokens


def test_abort_then_resume_elsewhere_reprefills_and_continues_identically():
    ref, _ = loaded()
    ref.add([SeqRequest("t", [9, 8, 7], 12)])
    whole = run(ref)["t"]

    src, _ = loaded()
    src.add([SeqRequest("t", [9, 8, 7], 12), SeqRequest("u", [1], 12)])
    for _ in range(5):
        src.step()
    (part,) = src.abort(["t", "missing"])
    assert src.active_ids() == ["u"] and len(part.tokens) == 5 and len(part.logprobs) == 5
    dst, llm = loaded()
    dst.add([part])
    (_, rid, prefix, max_tokens), = llm.calls
    assert prefix == [9, 8, 7] + part.tokens and max_tokens == 12 - 5  # re-prefill, only what is left
    assert rid.startswith("t#")
    done = run(dst)["t"]
    assert done.tokens == whole.tokens and done.logprobs == whole.logprobs


def test_abort_forwards_request_ids_and_drops_late_outputs():
    engine, llm = loaded()
    engine.add([SeqRequest("a", [5], 10)])
    rid = llm.calls[0][1]
    (req,) = engine.abort(["a"])
    assert llm.calls[-1] == ("abort_request", [rid]) and req.traj_id == "a"
    assert engine.step() == [] and engine.num_active() == 0
    engine.add([req])  # the same trajectory may come back: it gets a new request id
    assert llm.calls[-1][1] != rid


def test_add_refuses_sequences_without_room_and_queues_none():
    engine, llm = loaded()
    with pytest.raises(ValueError, match="trajectory full: 3 tokens leave no room"):
        engine.add([SeqRequest("ok", [5], 10), SeqRequest("full", [5], 2, tokens=[6, 7], logprobs=[-1.0, -1.0])])
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add([SeqRequest("long", list(range(64)), 10)])
    with pytest.raises(ValueError, match="free slots"):
        engine.add([SeqRequest(str(i), [5], 4) for i in range(5)])
    assert llm.calls == [] and engine.num_active() == 0


def test_token_ids_outside_the_vocabulary_are_refused_before_vllm_sees_them():
    """vLLM started with skip_tokenizer_init checks no token id: on the GPU a foreign one is an
    out-of-bounds embedding read. Today the adapter queues it."""
    engine, llm = loaded()
    assert engine.refuse(SeqRequest("a", [5, 6], 8)) is None
    assert engine.refuse(SeqRequest("b", [5, 100], 8)) == "token id 100 outside the vocabulary of 100"
    assert engine.refuse(SeqRequest("c", [5], 8, tokens=[-2], logprobs=[-1.0])) == \
        "token id -2 outside the vocabulary of 100"
    with pytest.raises(ValueError, match="trajectory b: token id 100 outside"):
        engine.add([SeqRequest("a", [5, 6], 8), SeqRequest("b", [5, 100], 8)])
    assert llm.calls == [] and engine.num_active() == 0
    # without a given vocabulary (as from_config builds it), vLLM's model config says
    api = standin_api()
    llm = api.LLM("m", max_model_len=64)
    llm.llm_engine.model_config.get_vocab_size = lambda: 50
    engine = VllmEngine(llm, api, VllmCfg(), eos_id=EOS, max_batch=2, temperature=1.0, top_p=1.0,
                        stager=RecordingStager())
    assert engine.refuse(SeqRequest("d", [49, 50], 8)) == "token id 50 outside the vocabulary of 50"


@dataclass
class ReasonedOutput(CompletionOutput):
    finish_reason: str | None = None  # vLLM's CompletionOutput has it: None until finished


class FaultyStandin(StandinEngine):
    """The stand-in reporting failures of single requests as vLLM does: `faults` maps a trajectory
    to (kind, its output number where it happens): "error"/"abort" (vLLM finishes the request
    with that finish_reason), "ignored" (a prompt the KV cache can never hold: finished at once,
    no token, finish_reason "length"), "no_logprobs" (an output without log-prob entries)."""

    def __init__(self, calls, faults: dict[str, tuple[str, int]]):
        super().__init__(calls, vocab=100, max_model_len=64, eos_at={}, tokens_per_step=1)
        self.faults, self.seen = faults, {}

    def step(self):
        outs = []
        for ro in super().step():
            comp, finished, traj = ro.outputs[0], ro.finished, ro.request_id.split("#")[0]
            self.seen[traj] = n = self.seen.get(traj, 0) + 1
            kind, at = self.faults.get(traj, (None, 0))
            reason = ("stop" if comp.token_ids[-1:] == [EOS] else "length") if finished else None
            out = ReasonedOutput(comp.token_ids, comp.logprobs, reason)
            if n == at and kind in ("error", "abort", "ignored"):
                out, finished = ReasonedOutput([], [], "length" if kind == "ignored" else kind), True
                self.reqs.pop(ro.request_id, None)  # vLLM freed it
            elif n == at and kind == "no_logprobs":
                out = ReasonedOutput(comp.token_ids, None, reason)
            outs.append(RequestOutput(ro.request_id, [out], finished))
        return outs


def test_one_requests_failure_in_vllm_finishes_that_request_with_an_error():
    """Today a request vLLM finished with finish_reason "error" or "abort", or without a token,
    comes back as a normal finish (its few tokens trained on), and one output without log-probs
    raises out of `step` for the whole batch."""
    engine, llm = loaded()
    llm.llm_engine = FaultyStandin(llm.calls, {"err": ("error", 3), "abrt": ("abort", 2), "ign": ("ignored", 1),
                                               "nolp": ("no_logprobs", 2)})
    engine.add([SeqRequest(t, [5, 6], 6) for t in ("ok", "err", "abrt", "nolp")])
    failed, done = {}, {}
    for _ in range(20):
        if not engine.num_active():
            break
        for o in engine.step():
            if o.error is not None:
                assert o.finished and o.request.traj_id == o.traj_id and o.tokens == o.logprobs == []
                failed[o.traj_id] = o.error
            elif o.finished:
                done[o.traj_id] = o.request
        if "abrt" in failed and "ign" not in failed and "ign" not in engine.active_ids():
            engine.add([SeqRequest("ign", [7, 8], 6)])  # into the slot the abort freed
    assert set(done) == {"ok"} and done["ok"].tokens == [token_at("ok", p, 100) for p in range(2, 8)]
    assert failed["err"].endswith("vLLM finished it with finish_reason='error'")
    assert failed["abrt"].endswith("vLLM finished it with finish_reason='abort'")
    assert failed["ign"].endswith("without generating a token (finish_reason='length')")
    assert "unusable output" in failed["nolp"] and "log-prob entries" in failed["nolp"]
    # vLLM's own finishes are not aborted again; the one still running there is
    aborted = [c[1] for c in llm.calls if c[0] == "abort_request"]
    assert len(aborted) == 1 and aborted[0][0].startswith("nolp#")
    assert engine.num_active() == 0 and not llm.llm_engine.reqs


def test_max_tokens_is_capped_by_the_context():
    engine, llm = loaded()
    engine.add([SeqRequest("a", list(range(60)), 100)])
    assert llm.calls[0][3] == 4


def test_sleep_and_wake():
    engine, llm = loaded(enable_sleep_mode=True)
    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add([SeqRequest("a", [5], 4)])
    engine.wake()
    engine.add([SeqRequest("a", [5], 4)])
    assert llm.names() == ["sleep", "wake_up", "add_request"] and llm.calls[0] == ("sleep", 1)


# -- wiring -------------------------------------------------------------------------------------
def test_build_engine_starts_vllm_with_dummy_weights_and_the_trainers_layout(tmp_path, monkeypatch):
    from laminar_hpc.model.tokenizer import CharTokenizer
    from laminar_hpc.rollout import engines, node
    (tmp_path / "config.json").write_text("{}")
    cfg = config_from_dict({"model": {"hf_path": str(tmp_path)},
                            "trainer": {"publish_dtype": "bfloat16"},
                            "rollout": {"backend": "vllm", "max_batch": 8,
                                        "vllm": {"tensor_parallel_size": 2, "max_model_len": 64}}})
    monkeypatch.setattr(vllm_engine, "load_vllm_api", standin_api)
    monkeypatch.setattr(engines, "model_args", lambda model_cfg, vocab: ARGS)  # the checkpoint's shape
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "")  # recorded: the engine's setting is undone
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    engine, layout = node.build_engine(cfg, rank=1, tok=CharTokenizer())
    assert isinstance(engine, VllmEngine) and engine.max_batch == 8 and engine.eos_id == CharTokenizer().eos_id
    assert layout == WeightLayout.from_model(Transformer(ARGS), "bfloat16")
    kw = engine.llm.kwargs
    assert engine.llm.model == str(tmp_path) and kw["load_format"] == "dummy" and kw["skip_tokenizer_init"]
    assert kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 8 and kw["max_model_len"] == 64
    assert kw["weight_transfer_config"].backend == "ipc" and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["seed"] == cfg.seed * 1000 + 1
    import os
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_vllm_backend_without_hf_path_is_refused():
    cfg = config_from_dict({"rollout": {"backend": "vllm"}})
    with pytest.raises(ValueError, match="model.hf_path"):
        VllmEngine.from_config(cfg, seed=0, eos_id=EOS, api=standin_api())


def test_pull_tells_the_engine_the_version_it_loads(tmp_path):
    from laminar_hpc.rollout.node import NodeWeights
    from laminar_hpc.transport.weight_store import WeightStore, checksum, digest_to_int
    layout, buf = layout_and_buffer()
    store = WeightStore.create(tmp_path / "w", slots=2, capacity=layout.nbytes)
    slot, view = store.begin(5)
    view[:layout.nbytes] = buf
    store.commit(slot, 5, layout.nbytes, checksum(memoryview(buf)), digest_to_int(layout.digest))
    engine, llm, stager = make_engine(enable_sleep_mode=False)
    weights = NodeWeights(tmp_path / "w")
    assert weights.newest() == 5  # the rollout looks before it pulls
    assert weights.pull(engine, layout, verify=True) == 5
    assert engine.version == 5 and ("finish_weight_update", "5") in llm.calls
    assert bytes(np.concatenate([t.view(torch.uint8).reshape(-1).numpy() for _, t in stager.staged])) \
        .startswith(bytes(buf[:layout.specs[0].nbytes]))
