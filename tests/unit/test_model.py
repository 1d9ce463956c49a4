"""Model, weight layout, tokenizer and the continuous-batching rollout engine (sampling: test_sampling.py).

Engine outputs are checked against plain full forwards of the same weights (no KV cache), so a
cache/slot/padding bug shows up as a log-prob or token mismatch.
"""
import dataclasses
import string

import pytest
import torch
import torch.nn.functional as F

from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.model.factory import model_args
from laminar_hpc.model.llama import ModelArgs, Transformer, token_logprobs
from laminar_hpc.model.sampling import processed_logprobs
from laminar_hpc.model.tokenizer import CharTokenizer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.transport.weight_store import checksum as store_checksum
from laminar_hpc.rollout.torch_engine import SeqRequest, TorchEngine, VersionInFlightError

VOCAB = 40
ARGS = model_args(ModelCfg(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=48), VOCAB)
NO_EOS = -1  # a token id that is never sampled: runs go to max_new_tokens


def _random_model(args=ARGS, seed=0, std=0.3) -> Transformer:
    """Weights much larger than the default init so distributions are far from uniform/diverse."""
    torch.manual_seed(seed)
    m = Transformer(args).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, std)
    return m


def _pack(model: Transformer, dtype="float32"):
    layout = WeightLayout.from_model(model, dtype=dtype)
    buf = bytearray(layout.nbytes)
    layout.pack(model, memoryview(buf))
    return layout, buf


def _engine(model, *, eos_id, max_batch, temperature, seed=0, top_p=1.0, top_k=0, version=1):
    layout, buf = _pack(model)
    eng = TorchEngine(model.args, eos_id, max_batch=max_batch, temperature=temperature,
                      top_p=top_p, top_k=top_k, seed=seed)
    eng.load_weights(version, memoryview(buf), layout)
    return eng


@torch.no_grad()
def _full_logprobs(model, prompt, tokens, temperature=1.0):
    """Log-probs of `tokens` given `prompt`, from one plain causal forward over prompt+tokens."""
    seq = torch.tensor([prompt + tokens])
    logits = model(seq[:, :-1])
    lp = token_logprobs(logits, seq[:, 1:], temperature)[0]
    return lp[len(prompt) - 1:].tolist()


def _prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + (i * 3) % 7  # lengths 1..7, mixed
        out.append(torch.randint(3, VOCAB, (length,), generator=g).tolist())
    return out


def _drive(engine, requests, admit_per_step=None):
    """Continuous batching: admit pending requests into free slots between decode steps."""
    pending = list(requests)
    finished = {}
    steps = 0
    max_active = 0

    def collect(outs):
        for o in outs:
            if o.finished:
                assert o.request is not None and o.request.traj_id == o.traj_id
                assert o.traj_id not in finished
                finished[o.traj_id] = o.request
            else:
                assert o.request is None

    while pending or engine.num_active():
        free = engine.free_slots()
        take = min(free, len(pending)) if admit_per_step is None else min(free, len(pending), admit_per_step)
        if take:
            batch, pending = pending[:take], pending[take:]
            outs = engine.add(batch)
            assert [o.traj_id for o in outs] == [r.traj_id for r in batch]
            collect(outs)
        max_active = max(max_active, engine.num_active())
        assert engine.num_active() <= engine.max_batch
        collect(engine.step())
        steps += 1
        assert steps < 1000
    return finished, max_active


# ----------------------------------------------------------------------------------------------
# continuous batching
# ----------------------------------------------------------------------------------------------

def test_continuous_batching_logprobs_match_full_forward():
    model = _random_model(seed=0)
    eos = 3
    engine = _engine(model, eos_id=eos, max_batch=3, temperature=1.0, seed=123)
    prompts = _prompts(9)
    # the first-admitted request finishes first, so slots free up out of order and compaction runs
    budgets = [2, 12, 9, 5, 14, 3, 8, 11, 6]
    reqs = [SeqRequest(f"t{i}", p, max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    finished, max_active = _drive(engine, reqs, admit_per_step=2)
    assert set(finished) == {r.traj_id for r in reqs}
    assert max_active == 3
    assert engine.num_active() == 0 and engine.kv_tokens() == 0

    all_tokens = []
    for i, r in enumerate(reqs):
        out = finished[r.traj_id]
        assert out.prompt == prompts[i]
        assert 1 <= len(out.tokens) <= budgets[i]
        assert len(out.logprobs) == len(out.tokens)
        # a trajectory ends exactly at EOS or at its budget
        if len(out.tokens) < budgets[i]:
            assert out.tokens[-1] == eos
        assert eos not in out.tokens[:-1]
        ref = _full_logprobs(model, out.prompt, out.tokens)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)
        all_tokens += out.tokens
    # the scaled-up weights give diverse samples (a stuck sampler would not)
    assert len(set(all_tokens)) >= 8


def test_continuous_batching_admit_all_free_slots_and_slot_reuse():
    """Same check with greedy admission (fill every free slot) and a different max_batch."""
    model = _random_model(seed=5)
    engine = _engine(model, eos_id=NO_EOS, max_batch=4, temperature=1.0, seed=7)
    prompts = _prompts(10, seed=9)
    budgets = [1, 7, 3, 10, 4, 2, 9, 5, 6, 8]  # budget 1 finishes in add() itself
    reqs = [SeqRequest(f"r{i}", p, max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    finished, _ = _drive(engine, reqs)
    for i, r in enumerate(reqs):
        out = finished[r.traj_id]
        assert len(out.tokens) == budgets[i]
        ref = _full_logprobs(model, out.prompt, out.tokens)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


def test_engine_sampling_is_seeded():
    model = _random_model(seed=2)

    def run(seed):
        eng = _engine(model, eos_id=NO_EOS, max_batch=2, temperature=1.0, seed=seed)
        reqs = [SeqRequest(f"s{i}", p, max_new_tokens=8) for i, p in enumerate(_prompts(4))]
        fin, _ = _drive(eng, reqs)
        return [fin[f"s{i}"].tokens for i in range(4)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def _greedy_reference(model, prompt, n):
    toks, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + toks]))[0, -1]
            t = int(logits.argmax())
            lps.append(float(F.log_softmax(logits.float(), -1)[t]))
            toks.append(t)
    return toks, lps


def test_greedy_generation_equals_stepwise_argmax():
    model = _random_model(seed=1)
    engine = _engine(model, eos_id=NO_EOS, max_batch=3, temperature=0.0)
    prompts = _prompts(5, seed=4)
    budgets = [10, 4, 7, 9, 6]
    reqs = [SeqRequest(f"g{i}", p, max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    finished, _ = _drive(engine, reqs, admit_per_step=1)
    for i, r in enumerate(reqs):
        out = finished[r.traj_id]
        toks, lps = _greedy_reference(model, prompts[i], budgets[i])
        assert out.tokens == toks
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(lps), atol=1e-4, rtol=0)


def test_generation_stops_at_max_seq_len():
    model = _random_model(seed=1)
    engine = _engine(model, eos_id=NO_EOS, max_batch=2, temperature=1.0)
    prompt = [3 + i % (VOCAB - 3) for i in range(ARGS.max_seq_len - 5)]
    finished, _ = _drive(engine, [SeqRequest("long", prompt, max_new_tokens=100)])
    out = finished["long"]
    assert len(out.prompt) + len(out.tokens) <= ARGS.max_seq_len
    assert len(out.tokens) >= 1
    # the whole trajectory can still be scored by a plain forward
    ref = _full_logprobs(model, out.prompt, out.tokens)
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# re-prefill / migration
# ----------------------------------------------------------------------------------------------

def test_abort_and_readd_on_second_engine_continues_identically():
    model = _random_model(seed=3)
    prompts = _prompts(3, seed=8)
    budget = 12

    def fresh():
        return _engine(model, eos_id=NO_EOS, max_batch=3, temperature=0.0)

    # uninterrupted reference run
    ref_eng = fresh()
    ref_fin, _ = _drive(ref_eng, [SeqRequest(f"m{i}", p, max_new_tokens=budget) for i, p in enumerate(prompts)])

    a = fresh()
    a.add([SeqRequest(f"m{i}", p, max_new_tokens=budget) for i, p in enumerate(prompts)])
    for _ in range(4):
        assert not any(o.finished for o in a.step())
    # abort the middle one: the last active sequence is compacted into its slot
    moved = a.abort(["m1"])
    assert len(moved) == 1 and moved[0].traj_id == "m1"
    assert len(moved[0].tokens) == 5 and len(moved[0].logprobs) == 5
    assert moved[0].tokens == ref_fin["m1"].tokens[:5]
    assert a.num_active() == 2
    assert a.abort(["nope"]) == []

    b = fresh()
    b.add(moved)
    fin_b, _ = _drive(b, [])
    fin_a, _ = _drive(a, [])
    assert set(fin_b) == {"m1"} and set(fin_a) == {"m0", "m2"}
    got = {**fin_a, **fin_b}
    for tid, ref in ref_fin.items():
        assert got[tid].tokens == ref.tokens, tid
        assert len(got[tid].tokens) == budget
        torch.testing.assert_close(torch.tensor(got[tid].logprobs), torch.tensor(ref.logprobs),
                                   atol=1e-4, rtol=0)


def test_readd_with_sampling_gives_consistent_logprobs():
    """A resumed trajectory (sampled) is still scored correctly end to end by a full forward."""
    model = _random_model(seed=4)
    a = _engine(model, eos_id=NO_EOS, max_batch=2, temperature=1.0, seed=1)
    a.add([SeqRequest("x", [5, 6, 7], max_new_tokens=10), SeqRequest("y", [9], max_new_tokens=10)])
    a.step()
    a.step()
    (req,) = a.abort(["x"])
    b = _engine(model, eos_id=NO_EOS, max_batch=2, temperature=1.0, seed=2)
    b.add([SeqRequest("z", [8, 8], max_new_tokens=6)])  # resumes into slot 1, not slot 0
    b.add([req])
    fin, _ = _drive(b, [])
    out = fin["x"]
    assert len(out.tokens) == 10
    ref = _full_logprobs(model, out.prompt, out.tokens)
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6), (8, 0.7)])
def test_engine_logprobs_are_under_the_truncated_distribution(top_k, top_p):
    """rollout.top_k / top_p reach the sampler: every token lies in the kept set of a plain full
    forward, and its recorded log-prob is that forward's processed log-prob (renormalised)."""
    model = _random_model(seed=5)
    eng = _engine(model, eos_id=NO_EOS, max_batch=3, temperature=0.9, top_p=top_p, top_k=top_k, seed=4)
    reqs = [SeqRequest(f"k{i}", p, max_new_tokens=8) for i, p in enumerate(_prompts(3, seed=3))]
    finished, _ = _drive(eng, reqs)
    for r in reqs:
        out = finished[r.traj_id]
        seq = torch.tensor([out.prompt + out.tokens])
        with torch.no_grad():
            pi = processed_logprobs(model(seq[:, :-1]), seq[:, 1:], temperature=0.9, top_k=top_k, top_p=top_p)
        pi = pi[0, len(out.prompt) - 1:]
        assert torch.isfinite(pi).all()  # no sampled token outside the kept set
        torch.testing.assert_close(torch.tensor(out.logprobs), pi, atol=1e-4, rtol=0)
        full = _full_logprobs(model, out.prompt, out.tokens, temperature=0.9)
        assert (pi - torch.tensor(full)).abs().max() > 1e-2  # not the untruncated softmax's


# ----------------------------------------------------------------------------------------------
# version atomicity
# ----------------------------------------------------------------------------------------------

def test_load_weights_in_flight_keeps_the_sequences_and_their_kv_cache():
    """Refresh in flight with the KV kept (rollout.refresh_kv: keep): the new weights go in under
    the running sequences, whose cache entries stay as computed; the next token comes from the new
    weights over that old cache, so it differs from a fresh forward of the new model."""
    m1, m2 = _random_model(seed=1), _random_model(seed=2)
    layout2, buf2 = _pack(m2)
    eng = _engine(m1, eos_id=NO_EOS, max_batch=2, temperature=1.0, version=1)
    eng.add([SeqRequest("a", [4, 5, 6], max_new_tokens=6)])
    eng.step()
    n = eng.active[0].length
    cache = [buf[0, :, :n].clone() for buf in (*eng.cache.k, *eng.cache.v)]
    eng.load_weights(2, memoryview(buf2), layout2, in_flight=True)
    assert eng.version == 2 and eng.active_ids() == ["a"] and eng.active[0].length == n
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    assert all(torch.equal(buf[0, :, :n], old) for buf, old in zip((*eng.cache.k, *eng.cache.v), cache))
    (out,) = eng.step()
    req = eng.active[0].req
    fresh = _full_logprobs(m2, req.prompt, req.tokens)[-1]
    assert out.tokens == [req.tokens[-1]] and abs(out.logprobs[0] - fresh) > 1e-4  # the old KV was used


def test_load_weights_refused_while_in_flight():
    m1, m2 = _random_model(seed=1), _random_model(seed=2)
    layout2, buf2 = _pack(m2)
    eng = _engine(m1, eos_id=NO_EOS, max_batch=2, temperature=1.0, version=1)
    assert eng.version == 1
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    eng.add([SeqRequest("a", [4, 5], max_new_tokens=3)])
    with pytest.raises(VersionInFlightError):
        eng.load_weights(2, memoryview(buf2), layout2)
    assert eng.version == 1
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    fin, _ = _drive(eng, [])
    assert "a" in fin and eng.num_active() == 0
    eng.load_weights(2, memoryview(buf2), layout2)
    assert eng.version == 2
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k


def test_add_before_weights_raises():
    eng = TorchEngine(ARGS, NO_EOS, max_batch=2)
    with pytest.raises(RuntimeError):
        eng.add([SeqRequest("a", [4], max_new_tokens=2)])


def test_add_more_than_free_slots_raises():
    eng = _engine(_random_model(), eos_id=NO_EOS, max_batch=2, temperature=1.0)
    with pytest.raises(ValueError):
        eng.add([SeqRequest(f"a{i}", [4], max_new_tokens=2) for i in range(3)])


# ----------------------------------------------------------------------------------------------
# weight layout
# ----------------------------------------------------------------------------------------------

def test_weight_layout_round_trip_float32():
    src = _random_model(seed=1)
    layout, buf = _pack(src)
    torch.manual_seed(99)
    dst = Transformer(ARGS)
    assert not torch.equal(dst.model.embed_tokens.weight, src.model.embed_tokens.weight)
    # with checksum=True unpack hashes while it copies: the same checksum the relays put on it
    assert layout.unpack(memoryview(buf), dst, checksum=True) == store_checksum(memoryview(buf))
    assert layout.unpack(memoryview(buf), Transformer(ARGS)) is None  # plain copy: no hashing
    s_sd, d_sd = src.state_dict(), dst.state_dict()
    assert s_sd.keys() == d_sd.keys()
    for k in s_sd:
        assert torch.equal(s_sd[k], d_sd[k]), k
    # the layout holds every parameter exactly once, aligned and non-overlapping
    n_params = sum(p.numel() for p in src.parameters())
    assert sum(s.nbytes for s in layout.specs) == 4 * n_params
    ends = 0
    for s in layout.specs:
        assert s.offset % 64 == 0 and s.offset >= ends
        ends = s.offset + s.nbytes
    assert ends <= layout.nbytes


def test_weight_layout_tied_embeddings():
    src = _random_model(seed=1)
    assert ARGS.tie_embeddings
    layout, buf = _pack(src)
    names = [s.name for s in layout.specs]
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    assert len(names) == len(set(names))
    dst = Transformer(ARGS)
    layout.unpack(memoryview(buf), dst)
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()
    assert torch.equal(dst.lm_head.weight, src.model.embed_tokens.weight)

    untied = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": False})
    m = _random_model(untied, seed=2)
    lay_u = WeightLayout.from_model(m)
    assert "lm_head.weight" in [s.name for s in lay_u.specs]
    assert lay_u.nbytes > layout.nbytes
    assert lay_u.digest != layout.digest


def test_weight_layout_bfloat16():
    src = _random_model(seed=1)
    lay32 = WeightLayout.from_model(src, "float32")
    lay16, buf16 = _pack(src, "bfloat16")
    assert lay16.dtype == "bfloat16"
    assert abs(lay16.nbytes - lay32.nbytes / 2) <= 64 * len(lay16.specs)
    assert lay16.nbytes < 0.6 * lay32.nbytes
    assert lay16.digest != lay32.digest
    dst = Transformer(ARGS)
    lay16.unpack(memoryview(buf16), dst)
    for name, p in src.named_parameters():
        q = dict(dst.named_parameters())[name]
        assert q.dtype == torch.float32
        # exactly what rounding to bfloat16 gives, and within bf16 precision of the original
        assert torch.equal(q, p.detach().to(torch.bfloat16).float()), name
        torch.testing.assert_close(q, p.detach(), rtol=2 ** -8, atol=1e-6)


def test_weight_layout_digest_and_buffer_size():
    a = WeightLayout.from_model(Transformer(ARGS))
    b = WeightLayout.from_model(_random_model(seed=3))
    assert a.digest == b.digest  # same shapes, different values
    wider = ModelArgs(**{**ARGS.__dict__, "ffn_dim": 96})
    assert WeightLayout.from_model(Transformer(wider)).digest != a.digest
    bigger_vocab = ModelArgs(**{**ARGS.__dict__, "vocab_size": VOCAB + 1})
    assert WeightLayout.from_model(Transformer(bigger_vocab)).digest != a.digest
    small = bytearray(a.nbytes - 1)
    with pytest.raises(ValueError):
        a.unpack(memoryview(small), Transformer(ARGS))
    with pytest.raises(ValueError):
        a.pack(Transformer(ARGS), memoryview(small))
    with pytest.raises(ValueError):
        WeightLayout.from_model(Transformer(ARGS), dtype="int8")


# ----------------------------------------------------------------------------------------------
# parameter names
# ----------------------------------------------------------------------------------------------

def test_parameter_names_follow_hf_llama():
    names = {n for n, _ in Transformer(ARGS).named_parameters()}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(ARGS.n_layers):
        pre = f"model.layers.{i}."
        expected |= {pre + s for s in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
            "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
    assert names == expected
    sd = Transformer(ARGS).state_dict()
    hd = ARGS.dim // ARGS.n_heads
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (ARGS.n_heads * hd, ARGS.dim)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (ARGS.n_kv_heads * hd, ARGS.dim)
    assert sd["model.layers.1.mlp.gate_proj.weight"].shape == (ARGS.ffn_dim, ARGS.dim)


def test_attention_bias_adds_qkv_biases_like_qwen2():
    args = ModelArgs(**{**ARGS.__dict__, "attention_bias": True})
    names = {n for n, _ in Transformer(args).named_parameters()}
    base = {n for n, _ in Transformer(ARGS).named_parameters()}
    extra = names - base
    assert extra == {f"model.layers.{i}.self_attn.{p}_proj.bias"
                     for i in range(args.n_layers) for p in ("q", "k", "v")}
    assert not any("o_proj.bias" in n or "mlp" in n and n.endswith("bias") for n in names)


def test_attention_bias_model_engine_matches_full_forward():
    args = ModelArgs(**{**ARGS.__dict__, "attention_bias": True, "tie_embeddings": False})
    model = _random_model(args, seed=6)
    engine = _engine(model, eos_id=NO_EOS, max_batch=2, temperature=1.0, seed=3)
    reqs = [SeqRequest(f"q{i}", p, max_new_tokens=6) for i, p in enumerate(_prompts(3, seed=2))]
    finished, _ = _drive(engine, reqs)
    for r in reqs:
        out = finished[r.traj_id]
        ref = _full_logprobs(model, out.prompt, out.tokens)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------

def test_char_tokenizer_round_trip_printable_ascii():
    tok = CharTokenizer()
    text = "".join(chr(c) for c in range(32, 127)) + "\n12+34=46\nHello, World!"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
    chars = "".join(chr(c) for c in range(32, 127)) + "\n"
    char_ids = tok.encode(chars)
    assert len(set(char_ids)) == len(chars)  # one distinct id per character
    assert tok.vocab_size == 4 + len(chars)


def test_char_tokenizer_unknown_and_specials():
    tok = CharTokenizer()
    specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id]
    assert len(set(specials)) == 4
    char_ids = set(tok.encode("".join(chr(c) for c in range(32, 127)) + "\n"))
    assert not char_ids & set(specials)
    assert tok.encode("aé\tb") == [tok.encode("a")[0], tok.unk_id, tok.unk_id, tok.encode("b")[0]]
    assert tok.decode(tok.encode("aé\tb")) == "ab"
    assert tok.decode([tok.bos_id] + tok.encode("x=1") + [tok.eos_id, tok.pad_id]) == "x=1"
    assert string.ascii_letters == tok.decode(tok.encode(string.ascii_letters))


# ----------------------------------------------------------------------------------------------
# limits
# ----------------------------------------------------------------------------------------------

def test_position_beyond_max_seq_len_raises():
    model = Transformer(ARGS)
    ok = torch.zeros(1, ARGS.max_seq_len, dtype=torch.long)
    assert model(ok).shape == (1, ARGS.max_seq_len, VOCAB)
    with pytest.raises(ValueError, match=r"max_seq_len=48") as exc:
        model(torch.zeros(1, ARGS.max_seq_len + 1, dtype=torch.long))
    assert str(ARGS.max_seq_len) in str(exc.value)


def test_engine_rejects_prompt_without_room():
    eng = _engine(_random_model(), eos_id=NO_EOS, max_batch=2, temperature=1.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add([SeqRequest("big", [4] * ARGS.max_seq_len, max_new_tokens=4)])
    assert eng.num_active() == 0


def test_pack_splits_big_tensors_over_threads_and_works_in_a_forked_child():
    """pack copies 8 MiB pieces on a thread pool; a child forked after the parent's first pack has
    none of those threads and must make its own instead of waiting on them forever."""
    import multiprocessing

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2100), torch.nn.Linear(2100, 8))  # 17 MB: pieces
    layout = WeightLayout.from_model(model)
    packed = bytearray(layout.nbytes)
    layout.pack(model, memoryview(packed))
    for name, view in layout.views(memoryview(packed)).items():
        assert torch.equal(view, dict(model.named_parameters())[name].detach())

    def pack_again():
        again = bytearray(layout.nbytes)
        layout.pack(model, memoryview(again))
        raise SystemExit(0 if again == packed else 1)
    child = multiprocessing.get_context("fork").Process(target=pack_again)
    child.start()
    child.join(timeout=60)
    if child.exitcode is None:
        child.kill()
        pytest.fail("the forked child's pack did not finish within 60 s")
    assert child.exitcode == 0


def test_the_model_shape_is_one_type_built_only_from_the_config():
    """ModelArgs declares the shape and has no defaults; the config's `model:` section holds the
    same fields (by name) with the only defaults; model_args copies one into the other."""
    shape = {f.name for f in dataclasses.fields(ModelArgs)}
    not_shape = {"tokenizer", "hf_path", "hf_tokenizer", "dtype", "lora"}  # where the shape comes from, the dtype, adapters
    assert shape - {"vocab_size"} == set(ModelCfg.model_fields) - not_shape
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(ModelArgs))
    cfg = ModelCfg(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=80, max_seq_len=20, rope_theta=500.0,
                   norm_eps=1e-6, tie_embeddings=False, attention_bias=True)
    args = model_args(cfg, 77)
    assert args.vocab_size == 77
    assert {k: getattr(args, k) for k in shape - {"vocab_size"}} == cfg.model_dump(exclude=not_shape)
    default = model_args(ModelCfg(), 77)
    assert {k: getattr(default, k) for k in shape - {"vocab_size"}} == ModelCfg().model_dump(exclude=not_shape)
