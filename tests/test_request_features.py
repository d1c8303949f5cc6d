"""What users expect of a request: n / best_of through fork, min_new_tokens, repetition / presence /
frequency penalties and top-k alternative logprobs. The logits rules are checked against
transformers' own processors in float64, and end to end against `generate` of the same model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                     RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper)

from client import LocalCluster
from worker import logits_processors as lp
from worker.validate_sampling import SamplingExtras
from tests.test_e2e import EOS, VOCAB, ckpt, prompts, settle  # noqa: F401 (fixtures)
from tests.checkpoints import load_oracle

# ---------------------------------------------------------------- the rules, in process


def extras_for(histories, prompt_lens, rep=None, pres=None, freq=None, suppress=None):
    B = len(histories)
    x = SamplingExtras()
    x.repetition = np.asarray(rep if rep is not None else [1.0] * B, dtype=np.float64)
    x.presence = np.asarray(pres if pres is not None else [0.0] * B, dtype=np.float64)
    x.frequency = np.asarray(freq if freq is not None else [0.0] * B, dtype=np.float64)
    x.penalty_counts = np.asarray([len(h) for h in histories], dtype=np.int32)
    x.penalty_prompt_lens = np.asarray(prompt_lens, dtype=np.int32)
    x.penalty_tokens = np.asarray([t for h in histories for t in h], dtype=np.int32)
    if suppress is not None:
        x.suppress = np.asarray([bool(s) for s in suppress])
        x.suppress_counts = np.asarray([len(s) for s in suppress], dtype=np.int32)
        x.suppress_ids = np.asarray([t for s in suppress for t in s], dtype=np.int32)
    return x


def test_repetition_penalty_equals_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64) * 3
    hist = [[1, 2, 2, 7, 49], [0, 3], [5, 5, 5, 6, 11, 12, 13]]
    ours = lp.apply(logits, extras_for(hist, [2, 1, 3], rep=[1.3, 0.8, 2.0]))
    for i, (h, pen) in enumerate(zip(hist, [1.3, 0.8, 2.0])):
        ref = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([h]), logits[i:i + 1].clone())
        assert torch.equal(ours[i], ref[0])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 10, dtype=torch.float64)
    out = lp.apply(logits, extras_for([[4, 4, 1, 4, 2]], [2], pres=[0.5], freq=[0.25]))
    # prompt [4, 4]; output [1, 4, 2]: token 4 once, 1 once, 2 once
    want = torch.zeros(10, dtype=torch.float64)
    want[[1, 2, 4]] = -(0.5 + 0.25)
    assert torch.equal(out[0], want)


def test_min_new_tokens_masks_like_transformers():
    logits = torch.randn(2, 20, dtype=torch.float64)
    ours = lp.apply(logits, extras_for([[], []], [0, 0], suppress=[(3, 9), ()]))
    ref = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=5, eos_token_id=[3, 9])(
        torch.tensor([[1, 2, 7]]), logits[:1].clone())
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], logits[1])


def _dense_penalties(logits, x):
    """The penalties over the whole [S, V] (the form lp.apply had before it touched only seen tokens)."""
    S, V = logits.shape
    row = torch.as_tensor(np.repeat(np.arange(S), x.penalty_counts))
    tok = torch.as_tensor(x.penalty_tokens.astype(np.int64))
    first = np.repeat(np.cumsum(x.penalty_counts) - x.penalty_counts, x.penalty_counts)
    is_output = torch.as_tensor((np.arange(x.penalty_tokens.size) - first)
                                >= np.repeat(x.penalty_prompt_lens, x.penalty_counts))
    seen = torch.zeros(S, V, dtype=torch.bool)
    seen[row, tok] = True
    counts = torch.zeros(S, V, dtype=logits.dtype)
    counts.index_put_((row[is_output], tok[is_output]), torch.ones(int(is_output.sum()), dtype=logits.dtype),
                      accumulate=True)
    rep = torch.as_tensor(x.repetition, dtype=logits.dtype)[:, None]
    out = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
    freq = torch.as_tensor(x.frequency, dtype=logits.dtype)[:, None]
    pres = torch.as_tensor(x.presence, dtype=logits.dtype)[:, None]
    return out - freq * counts - pres * (counts > 0).to(logits.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_penalties_on_seen_tokens_only_equal_the_dense_form_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    S, V = 6, 97
    hist = [rng.integers(0, V, rng.integers(0, 40)).tolist() for _ in range(S)]
    x = extras_for(hist, [min(len(h), int(rng.integers(0, 10))) for h in hist],
                   rep=rng.uniform(0.5, 2.0, S), pres=rng.uniform(-1, 1, S), freq=rng.uniform(-1, 1, S),
                   suppress=[(1, 2), (), (5,), (), (), (96,)])
    logits = torch.as_tensor(rng.normal(0, 4, (S, V))).to(dtype)
    logits[0, 3] = float("-inf")
    want = _dense_penalties(logits, x)
    want[[0, 0, 2, 5], [1, 2, 5, 96]] = float("-inf")
    copy = lp.apply(logits, x)
    assert torch.equal(copy, want) and not torch.equal(copy, logits)
    same = lp.apply(logits, x, in_place=True)   # the runner's form when no raw logit is needed after
    assert same is logits and torch.equal(logits, want)


def test_last_stage_completes_histories_left_without_their_last_token():
    from worker.step_state import SequenceStore, StepPrecondition
    from worker.validate_common import StepValidationError
    from worker.validate_sampling import complete_histories
    store = SequenceStore()
    store.record_sampled([10, 11, 12], np.array([7, 8, 9]))
    # rows: 10 penalized, 2 outputs known, samples offset 3 (one in flight); 11 not penalized;
    # 12 penalized and complete; 13 penalized, sampling its first token (offset 0)
    x = extras_for([[1, 2, 3, 4], [], [5, 6], [9]], [2, 0, 1, 1], rep=[1.2, 1.0, 1.1, 1.3])
    offsets = np.array([3, 5, 1, 0], dtype=np.int32)
    complete_histories(x, np.ones(4, bool), offsets, np.array([10, 11, 12, 13]), store)
    assert x.penalty_counts.tolist() == [5, 0, 2, 1]
    assert x.penalty_tokens.tolist() == [1, 2, 3, 4, 7, 5, 6, 9]
    two_missing = extras_for([[1, 2]], [1], rep=[1.2])
    with pytest.raises(StepValidationError, match="at most its last token"):
        complete_histories(two_missing, np.ones(1, bool), np.array([3], np.int32), np.array([10]), store)
    never_sampled = extras_for([[1, 2]], [1], rep=[1.2])
    with pytest.raises(StepPrecondition, match="has not sampled"):
        complete_histories(never_sampled, np.ones(1, bool), np.array([2], np.int32), np.array([99]), store)


def test_rows_narrows_csr_arrays_to_the_sampled_rows():
    x = extras_for([[1, 2], [3], [4, 5, 6]], [1, 0, 2], rep=[1.1, 1.2, 1.3], suppress=[(7,), (), (8, 9)])
    y = lp.rows(x, np.array([True, False, True]))
    assert y.penalty_counts.tolist() == [2, 3] and y.penalty_tokens.tolist() == [1, 2, 4, 5, 6]
    assert y.suppress_ids.tolist() == [7, 8, 9] and y.repetition.tolist() == pytest.approx([1.1, 1.3])


def test_top_logprobs_are_the_raw_distributions_best():
    logits = torch.randn(2, 30, dtype=torch.float64)
    ids, vals = lp.top_logprobs(logits, 4)
    ref = torch.log_softmax(logits, -1).topk(4)
    assert ids.tolist() == ref.indices.tolist() and np.allclose(vals, ref.values.numpy(), atol=1e-6)


# ---------------------------------------------------------------- end to end


def greedy_reference(hf):
    """transformers' greedy tokens for a prompt and generate() keywords, up to and with EOS."""
    def ref(p, **kw):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), do_sample=False, eos_token_id=EOS, pad_token_id=EOS, **kw)
        toks = out[0, len(p):].tolist()
        return toks[:toks.index(EOS) + 1] if EOS in toks else toks
    return ref


def test_min_p_keeps_what_transformers_min_p_warper_keeps():
    """min_p after temperature, as transformers' MinPLogitsWarper (and vLLM) apply it: the kept set
    is the same; greedy rows and min_p 0 rows are not touched."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 200, generator=g, dtype=torch.float64) * 2
    min_p = np.asarray([0.1, 0.5, 0.0, 0.3, 1.0], dtype=np.float32)
    temperature = np.asarray([0.7, 1.3, 1.0, 0.0, 1.0], dtype=np.float32)
    out = logits.clone()
    lp.apply_min_p(out, min_p, temperature)
    for i in range(5):
        if min_p[i] == 0 or temperature[i] == 0:
            assert torch.equal(out[i], logits[i])
            continue
        warped = TemperatureLogitsWarper(float(temperature[i]))(None, logits[i:i + 1].clone())
        ref = MinPLogitsWarper(float(min_p[i]), min_tokens_to_keep=1)(None, warped)[0]
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref))
        assert torch.equal(out[i][~torch.isinf(out[i])], logits[i][~torch.isinf(out[i])])   # the rest unchanged
    assert int((~torch.isinf(out[4])).sum()) == 1            # min_p 1: only the most likely token


@pytest.mark.slow
def test_features_end_to_end_against_transformers(ckpt):
    hf = load_oracle(ckpt, torch.float64)
    ref = greedy_reference(hf)

    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4) as c:
        cl = c.client
        for p in prompts(4, 3, 30, seed=91):
            assert cl.generate(prompt_token_ids=p, max_new_tokens=12, repetition_penalty=1.4).token_ids == \
                ref(p, max_new_tokens=12, repetition_penalty=1.4)
            assert cl.generate(prompt_token_ids=p, max_new_tokens=12, min_new_tokens=10).token_ids == \
                ref(p, max_new_tokens=12, min_new_tokens=10)

        # min_p 1 keeps only the most likely token: sampling at any temperature is greedy
        p = prompts(1, 5, 20, seed=93)[0]
        assert cl.generate(prompt_token_ids=p, max_new_tokens=10, temperature=1.3, seed=4,
                           min_p=1.0).token_ids == ref(p, max_new_tokens=10)
        kw = dict(prompt_token_ids=p, max_new_tokens=10, temperature=1.0, seed=4, ignore_eos=True)
        assert cl.generate(**kw, min_p=0.0).token_ids == cl.generate(**kw).token_ids   # 0 = off

        # min_new_tokens with ignore_eos and no stop ids masks nothing (vLLM's rule): an EOS sampled
        # early stays, as with ignore_eos alone (transformers: no EOS id at all). Prompts 19 and 40 of
        # this seed are two whose greedy output has EOS among its first 10 tokens.
        for i in (19, 40):
            p = prompts(64, 3, 30, seed=95)[i]
            with torch.no_grad():
                want = hf.generate(torch.tensor([p]), do_sample=False, eos_token_id=None, pad_token_id=0,
                                   max_new_tokens=12)[0, len(p):].tolist()
            assert EOS in want[:10]
            assert cl.generate(prompt_token_ids=p, max_new_tokens=12, min_new_tokens=10,
                               ignore_eos=True).token_ids == want

        # n choices fork one prefill: greedy choices are identical, seeded ones reproducible
        p = prompts(1, 21, 21, seed=92)[0]                      # 21 tokens: 5 full blocks shared + a copy
        r = cl.generate(prompt_token_ids=p, max_new_tokens=6, n=3)
        assert [ch.token_ids for ch in r.choices] == [ref(p, max_new_tokens=6)] * 3
        kw = dict(prompt_token_ids=p, max_new_tokens=8, n=3, temperature=1.0, seed=11, ignore_eos=True)
        a, b = cl.generate(**kw), cl.generate(**kw)
        assert [ch.token_ids for ch in a.choices] == [ch.token_ids for ch in b.choices]
        assert len({tuple(ch.token_ids) for ch in a.choices}) > 1
        assert a.choices[0].token_ids == cl.generate(**dict(kw, n=1)).token_ids   # choice 0 keeps the seed

        # best_of: the n with the highest cumulative logprob, as a job
        job = cl.wait(cl.submit([dict(kw, n=2, best_of=4)]))[0]
        assert len(job.choices) == 2 and job.usage.completion_tokens == 2 * 8      # the returned ones, as vLLM's
        assert cl.generate(**dict(kw, n=2, best_of=4)).usage.completion_tokens == 2 * 8   # the same as generate()
        scores = [ch.cumulative_logprob for ch in job.choices]
        assert scores == sorted(scores, reverse=True)

        # top-k alternatives: the sampled token is the best for greedy; the list is sorted
        r = cl.generate(prompt_token_ids=p, max_new_tokens=5, logprobs=3)
        for tok, alts in zip(r.token_ids, r.top_logprobs):
            assert list(alts)[0] == tok and list(alts.values()) == sorted(alts.values(), reverse=True)

        # stop token ids end the sequence (in token_ids) but their text is left out, as vLLM's; with
        # include_stop_str_in_output the stop token's text, or a matched stop string, stays
        full = cl.generate(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True)
        k = full.token_ids.index(full.token_ids[3])                  # the first of that id
        text_of = lambda n: cl.generate(prompt_token_ids=p, max_new_tokens=n, ignore_eos=True).text  # noqa: E731
        r = cl.generate(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, stop_token_ids=[full.token_ids[3]])
        assert r.token_ids == full.token_ids[:k + 1] and r.finish_reason == "stop" and r.text == text_of(k)
        assert r.stop_reason == full.token_ids[3] and full.stop_reason is None   # vLLM's stop_reason
        job = cl.wait(cl.submit([dict(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True,
                                      stop_token_ids=[full.token_ids[3]])]))[0]
        assert job.stop_reason == full.token_ids[3]
        r = cl.generate(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, stop_token_ids=[full.token_ids[3]],
                        include_stop_str_in_output=True)
        assert r.text == text_of(k + 1)
        stop = text_of(4)[-2:]
        at = full.text.find(stop)
        for keep in (False, True):
            r = cl.generate(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=keep)
            assert r.finish_reason == "stop" and r.text == full.text[:at + (len(stop) if keep else 0)]
            assert r.stop_reason == stop
        last = list(cl.stream(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, stop=[stop]))[-1]
        assert last.finish_reason == "stop" and last.stop_reason == stop
        # no stop string matches before min_new_tokens tokens exist (vLLM's rule)
        r = cl.generate(prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, stop=[stop], min_new_tokens=8)
        assert r.finish_reason == "length" and r.token_ids == full.token_ids and r.text == full.text

        # generate() asks for final_only: one chunk per choice, the same result as the token stream
        from client.messages import build_generate_request, chunk_from_proto
        for kw in (dict(max_new_tokens=7), dict(max_new_tokens=6, n=2, temperature=1.0, seed=5, logprobs=2),
                   dict(max_new_tokens=9, stop=[cl.generate(prompt_token_ids=p, max_new_tokens=4).text[-2:]])):
            req = build_generate_request(prompt_token_ids=p, **kw)
            req.final_only = True
            whole = [chunk_from_proto(ch) for ch in cl._stub.Generate(req)]
            assert len(whole) == kw.get("n", 1) and all(ch.finish_reason and ch.usage for ch in whole)
            streamed = list(cl.stream(prompt_token_ids=p, **kw))
            for i in range(kw.get("n", 1)):
                mine = [ch for ch in streamed if ch.index == i]
                one = next(ch for ch in whole if ch.index == i)
                assert one.token_ids == [t for ch in mine for t in ch.token_ids]
                assert one.text == "".join(ch.text for ch in mine)
                assert one.logprobs == ([x for ch in mine for x in ch.logprobs] if "logprobs" in kw else None)
                assert one.decode_seconds > 0 or len(one.token_ids) == 1
        # best_of > n: the winners come whole at the end, timed too (the gateway's TTFT and ITL
        # read decode_seconds; before, the winners had none: TTFT = e2e, no ITL)
        req = build_generate_request(prompt_token_ids=p, max_new_tokens=6, n=1, best_of=3, temperature=1.0,
                                     seed=2, ignore_eos=True)
        req.final_only = True
        winners = [chunk_from_proto(ch) for ch in cl._stub.Generate(req)]
        assert len(winners) == 1 and winners[0].decode_seconds > 0
        settle(cl)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_penalized_batches_decode_ahead_and_equal_transformers(ckpt, workers):
    """Penalized sequences are scheduled before their last token comes back (async scheduling);
    the last stage completes their histories with the tokens it sampled. A batch of them, on 1 and
    2 stages, gives transformers' float64 tokens; seeded choices with penalties are reproducible."""
    hf = load_oracle(ckpt, torch.float64)
    ref = greedy_reference(hf)

    ps = prompts(6, 3, 30, seed=97)
    kws = [dict(max_new_tokens=14, repetition_penalty=1.3), dict(max_new_tokens=14, repetition_penalty=0.7),
           dict(max_new_tokens=14, repetition_penalty=1.5, min_new_tokens=12)] * 2
    with LocalCluster(model=ckpt, workers=workers, dtype="float64", block_size=4) as c:
        cl = c.client
        got = cl.wait(cl.submit([dict(prompt_token_ids=p, **kw) for p, kw in zip(ps, kws)]))
        for p, kw, r in zip(ps, kws, got):
            assert r.token_ids == ref(p, **kw)
        kw = dict(prompt_token_ids=ps[0], max_new_tokens=10, n=2, temperature=1.0, seed=3, ignore_eos=True,
                  presence_penalty=0.8, frequency_penalty=0.4)
        a, b = cl.generate(**kw), cl.generate(**kw)
        assert [ch.token_ids for ch in a.choices] == [ch.token_ids for ch in b.choices]
        settle(cl)


def test_choices_are_admitted_when_one_of_them_fits():
    """n / best_of choices fork as many as have room and the rest recompute on their own, as vLLM's
    child requests: a request is refused as never fitting only when one choice overflows the pool."""
    import types

    import grpc

    from metadata_service.requests import RequestError, _check_fits
    from minipaged.v1 import metadata_pb2
    engine = types.SimpleNamespace(max_model_len=4096, block_size=16, max_pool_blocks=8)
    _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=40, n=128), 65, engine)    # 105 tokens: 7 blocks
    _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=10, best_of=6), 63, engine)
    with pytest.raises(RequestError) as info:
        _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=80, n=2), 64, engine)    # one choice: 9
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "needs 9 blocks" in str(info.value)
    # the last sampled token is never fed back (Probe U): 128 + 1 fills the 128 slots exactly
    _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=1), 128, engine)
    _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=5), 124, engine)
    with pytest.raises(RequestError, match="needs 9 blocks"):
        _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=2), 128, engine)
    # beams: the prompt's full blocks are shared, through the prefix cache even after a preemption;
    # without one (--no-prefix-caching) they share nothing then, and would preempt each other forever
    beams = metadata_pb2.GenerateRequest(max_new_tokens=8, beam_width=3)
    engine.cfg = types.SimpleNamespace(enable_prefix_caching=True)
    _check_fits(beams, 50, engine)                                                     # 3 + 3 x 2 blocks
    engine.cfg.enable_prefix_caching = False
    with pytest.raises(RequestError, match="needs 12 blocks.*share no prompt block"):
        _check_fits(beams, 50, engine)                                                 # 3 x 4 blocks
    engine.cfg.enable_prefix_caching = True
    _check_fits(metadata_pb2.GenerateRequest(max_new_tokens=1, beam_width=1), 128, engine)   # (kv_tokens too)


def test_choices_that_do_not_fit_together_take_turns():
    """Three choices of 5 blocks each in a pool of 10 (Probe P: refused as "could never run"): they
    run, preempting each other, and give the tokens a roomy pool gives."""
    kw = dict(prompt_token_ids=list(range(1, 21)), max_new_tokens=50, n=3, temperature=1.0, seed=7,
              ignore_eos=True)                       # 69 K/V slots each: 5 blocks, the first shared
    with LocalCluster(num_blocks=10) as c:
        r = c.client.generate(**kw)
        tight = [ch.token_ids for ch in r.choices]
        assert r.usage.preemptions > 0 and [len(t) for t in tight] == [50] * 3
        settle(c.client)
        # Probe R: a prompt ending mid-block needs a copy of its last block per choice at the fork;
        # 16 choices of one block each in this pool of 10: those without room wait and recompute
        kw16 = dict(prompt_token_ids=list(range(1, 8)), max_new_tokens=8, n=16, temperature=1.0, seed=3)
        r16 = c.client.generate(**kw16)
        tight16 = [ch.token_ids for ch in r16.choices]
        assert len(tight16) == 16 and r16.usage.completion_tokens == sum(len(t) for t in tight16)
        settle(c.client)
    with LocalCluster() as c:
        assert tight == [ch.token_ids for ch in c.client.generate(**kw).choices]
        assert tight16 == [ch.token_ids for ch in c.client.generate(**kw16).choices]


@pytest.mark.slow
@pytest.mark.parametrize("sync", [False, True])
def test_a_request_that_fills_the_pool_exactly_runs(sync):
    """8 blocks of 4 = 32 slots: prompt 32 + 1 new token, 31 + 2 and 28 + 5 fill them exactly (the
    last token is never fed back); they were refused "could never run" (Probe U)."""
    from client import LocalCluster
    with LocalCluster(model="tiny", workers=1, dtype="float32", block_size=4, num_blocks=8,
                      extra_service_args=["--no-async-scheduling"] if sync else []) as c:
        for plen, new in [(28, 5), (31, 2), (32, 1)]:
            r = c.client.generate(prompt_token_ids=list(range(2, 2 + plen)), max_new_tokens=new, ignore_eos=True)
            assert len(r.token_ids) == new and r.finish_reason == "length"
            assert r.usage.preemptions == 0     # (no decode goes ahead past the last token into a slot)
        st = c.client.stats()
        assert st.invariants_ok and st.used_blocks == 0
