"""Beam search with KV sharing (metadata_service/beam.py): float64 beams, their order and scores
equal transformers' generate(num_beams=K, num_return_sequences=K, do_sample=False), with and
without EOS inside the horizon, across preemption and on 2 stages; every block is free at the end."""
from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import torch

from client import LocalCluster
from client.errors import InvalidArgument
from metadata_service.beam_scorer import BeamScorer
from tests.checkpoints import load_oracle
from tests.test_e2e import EOS, ckpt, prompts, settle  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_oracle(ckpt, torch.float64)


def hf_beams(hf, p, K, max_new, eos=(EOS,), length_penalty=1.0, early_stopping=False):
    """transformers' K hypotheses, best first: (generated ids, sequence score)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          num_beams=K, num_return_sequences=K, do_sample=False, max_new_tokens=max_new,
                          eos_token_id=list(eos), pad_token_id=EOS, length_penalty=length_penalty,
                          early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True)
    lens = (out.beam_indices >= 0).sum(dim=1).tolist()
    gen = out.sequences[:, len(p):]
    return [(gen[i, :lens[i]].tolist(), float(out.sequences_scores[i])) for i in range(K)]


def likely_token(hf, p) -> int:
    """A token greedy decoding emits early: as an extra EOS it ends beams inside the horizon."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=4, eos_token_id=EOS, pad_token_id=EOS)
    return int(out[0, len(p) + 2])


def check(r, want, K):
    assert len(r.choices) == K
    assert [c.token_ids for c in r.choices] == [w[0] for w in want]
    for c, (toks, score) in zip(r.choices, want):
        assert c.beam_score == pytest.approx(score, rel=1e-5, abs=1e-6)
        assert c.cumulative_logprob == pytest.approx(score * len(toks), rel=1e-5, abs=1e-5)  # length_penalty 1
    scores = [c.beam_score for c in r.choices]
    assert scores == sorted(scores, reverse=True)


# ---------------------------------------------------------------- the scorer alone

def test_scorer_keeps_the_best_finished_and_stops_when_nothing_can_improve():
    s = BeamScorer(2, {1}, max_new_tokens=10)
    ids = np.array([[1, 5, 6, 7, 8, 9]])                        # EOS is the best continuation
    lps = np.log(np.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]], dtype=np.float32))
    picks, done = s.step(0, np.zeros(1, np.float32), ids, lps, lambda i: ([], []))
    assert [p.token for p in picks] == [5, 6] and not done      # EOS finished, two beams run on
    assert s.finished[0].token_ids == [1] and s.finished[0].finish_reason == "stop"


def test_chat_and_completions_map_use_beam_search_to_beam_width():
    from gateway import openai_api as oa
    req = oa.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=3, use_beam_search=True,
                                   length_penalty=0.5, early_stopping="never")
    kw = oa.chat_kwargs(req, 16)
    assert (kw["beam_width"], kw["n"], kw["temperature"], kw["length_penalty"], kw["early_stopping"]) == \
        (3, None, 0.0, 0.5, "never")
    kw = oa.completion_kwargs(oa.CompletionRequest(prompt="x", n=2, use_beam_search=True, temperature=0.5))
    assert kw["beam_width"] == 2 and kw["temperature"] == 0.5          # the service refuses it (400)
    assert "beam_width" not in oa.completion_kwargs(oa.CompletionRequest(prompt="x", n=2))


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
def test_beams_equal_transformers_one_stage(ckpt, hf):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", block_size=4) as c:
        cl = c.client
        ps = prompts(3, 5, 14, seed=31)
        for p, K in zip(ps, (2, 4, 3)):
            check(cl.generate(prompt_token_ids=p, max_new_tokens=7, beam_width=K), hf_beams(hf, p, K, 7), K)
        p = ps[1]
        for kw in (dict(length_penalty=0.5, early_stopping=True), dict(length_penalty=2.0, early_stopping="never")):
            r = cl.generate(prompt_token_ids=p, max_new_tokens=6, beam_width=4, **kw)
            want = hf_beams(hf, p, 4, 6, **kw)
            assert [ch.token_ids for ch in r.choices] == [w[0] for w in want]
            assert [ch.beam_score for ch in r.choices] == pytest.approx([w[1] for w in want], rel=1e-5)
        # EOS inside the horizon: a likely token as a second EOS (stop_token_ids count as EOS)
        ended = 0
        for p in ps:
            t = likely_token(hf, p)
            r = cl.generate(prompt_token_ids=p, max_new_tokens=8, beam_width=4, stop_token_ids=[t])
            want = hf_beams(hf, p, 4, 8, eos=(EOS, t))
            check(r, want, 4)
            ended += sum(ch.finish_reason == "stop" for ch in r.choices)
            assert all((ch.finish_reason == "stop") == (ch.token_ids[-1] in (EOS, t)) for ch in r.choices)
        assert ended > 0
        # as a job: the same beams, best first
        job = cl.wait(cl.submit([dict(prompt_token_ids=ps[0], max_new_tokens=7, beam_width=2)]))[0]
        check(job, hf_beams(hf, ps[0], 2, 7), 2)
        st = settle(cl)
        assert st.invariants_ok


@pytest.mark.slow
def test_beams_across_preemption_on_two_stages(ckpt, hf):
    # 2 stages, 32 blocks of 4 tokens: 4 requests x 6 beams cannot all hold their blocks at once
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4, num_blocks=32) as c:
        cl = c.client
        ps = prompts(4, 12, 20, seed=32)
        toks = [likely_token(hf, p) for p in ps]
        items = [dict(prompt_token_ids=p, max_new_tokens=10, beam_width=6, stop_token_ids=[t])
                 for p, t in zip(ps, toks)]
        peak = {"used": 0, "shared": 0}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                st = cl.stats()
                peak["used"], peak["shared"] = max(peak["used"], st.used_blocks), max(peak["shared"], st.shared_blocks)
                time.sleep(0.01)

        w = threading.Thread(target=watch)
        w.start()
        try:
            rs = cl.generate(items)
        finally:
            stop.set()
            w.join()
        for r, p, t in zip(rs, ps, toks):
            check(r, hf_beams(hf, p, 6, 10, eos=(EOS, t)), 6)
        st = settle(cl)
        assert st.preemptions > 0 and sum(r.usage.preemptions for r in rs) == st.preemptions, (peak, st.steps)
        assert peak["shared"] > 0


@pytest.mark.slow
def test_bad_beam_requests_are_rejected_and_change_nothing_and_http_beams(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", block_size=4, http=True) as c:
        cl = c.client
        before = cl.stats()
        p = [5, 6, 7, 8]
        bad = [(dict(temperature=0.7), "temperature must be 0"),
               (dict(top_k=5), "temperature must be 0"),
               (dict(min_p=0.1), "top_p / top_k / min_p unset"),
               (dict(beam_width=17), "beam_width must be in [1, 16]"),
               (dict(n=2), "n must be unset or equal beam_width"),
               (dict(best_of=4), "best_of does not combine"),
               (dict(repetition_penalty=1.3), "does not support repetition_penalty"),
               (dict(stop=["x"]), "does not support stop strings"),
               (dict(logprobs=3), "does not support top_logprobs"),
               # beams scored the raw logprobs: a grammar was ignored, the output invalid
               (dict(regex="[a-c]{3,8}"), "does not support structured outputs"),
               (dict(max_new_tokens=0, prompt_logprobs=1), "does not support max_new_tokens 0")]
        for kw, why in bad:
            args = dict(prompt_token_ids=p, max_new_tokens=4, beam_width=4)
            args.update(kw)
            with pytest.raises(InvalidArgument) as e:
                cl.generate(**args)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and why in str(e.value), (kw, str(e.value))
        for kw in (dict(length_penalty=2.0), dict(early_stopping=True), dict(early_stopping="never")):
            with pytest.raises(InvalidArgument, match="apply to beam search only"):
                cl.generate(prompt_token_ids=p, max_new_tokens=4, **kw)
        url = c.http_url + "/v1/completions"
        r = httpx.post(url, json={"prompt": p, "max_tokens": 5, "use_beam_search": True, "n": 3, "temperature": 0.8})
        assert r.status_code == 400 and "takes no temperature 0.8" in r.text and r.json()["error"]["param"] == "temperature"
        r = httpx.post(url, json={"prompt": p, "max_tokens": 5, "use_beam_search": True, "n": 2, "top_p": 0.9})
        assert r.status_code == 400 and "takes no top_p 0.9 " in r.text and r.json()["error"]["param"] == "top_p"
        after = settle(cl)
        assert after.steps == before.steps and after.prompt_tokens == before.prompt_tokens

        # a cancelled beam job: every beam (forks included) ends and every block comes back
        job = cl.submit([dict(prompt_token_ids=p * 4, max_new_tokens=100, beam_width=8, ignore_eos=True)])
        deadline = time.monotonic() + 60
        while cl.stats().shared_blocks == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        cl.cancel(job)
        assert cl.wait(job) is not None
        settle(cl)

        # vLLM's extension: use_beam_search with n beams, best first, as the SDK's beam_width
        want = cl.generate(prompt_token_ids=p, max_new_tokens=5, beam_width=3)
        for stream in (False, True):
            body = {"prompt": p, "max_tokens": 5, "use_beam_search": True, "n": 3, "stream": stream}
            if not stream:
                r = httpx.post(url, json=body, timeout=60)
                assert r.status_code == 200, r.text
                got = [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
            else:
                texts = {}
                with httpx.stream("POST", url, json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:])["choices"]:
                                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                got = [texts[i] for i in sorted(texts)]
            assert got == [ch.text for ch in want.choices]
        settle(cl)


@pytest.mark.slow
def test_beams_recompute_together_on_the_other_replica_after_a_worker_dies(ckpt, hf):
    ps = prompts(4, 8, 20, seed=33)
    with LocalCluster(model=ckpt, workers=1, replicas=2, dtype="float64", block_size=4) as c:
        cl = c.client
        job = cl.submit([dict(prompt_token_ids=p, max_new_tokens=24, beam_width=4) for p in ps])
        end = time.monotonic() + 60
        while cl.stats().steps < 4 and time.monotonic() < end:
            time.sleep(0.02)
        assert cl.get_job(job).completed < len(ps), "the job ended before the kill: make it longer"
        c.kill_worker(0)
        c.restart_worker(0, wait=False)
        for r, p in zip(cl.wait(job, timeout=300), ps):
            check(r, hf_beams(hf, p, 4, 24), 4)
        settle(cl)


@pytest.mark.slow
def test_a_cancelled_beam_search_stops_even_after_its_head_beam_was_dropped():
    """The Generate call's cancel hook aborted its sequence only while that sequence was unfinished;
    a beam group's head ends when its beam is not chosen, so a cancelled beam search ran on to its
    end (Probe V: 4 x 1,500 tokens after the caller had gone)."""
    import asyncio
    import time

    from client import AsyncClient, LocalCluster
    with LocalCluster(model="tiny", workers=1, dtype="float32") as c:
        async def cut():
            ac = AsyncClient(c.address)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ac.generate(prompt_token_ids=[5, 6, 7], beam_width=4, max_new_tokens=1500,
                                                   ignore_eos=True), 3.0)
            await ac.close()
        asyncio.run(cut())
        end = time.monotonic() + 30
        while c.client.stats().live_sequences and time.monotonic() < end:
            time.sleep(0.2)
        st = c.client.stats()
        assert st.live_sequences == 0 and st.generated_tokens < 4 * 1500 and st.used_blocks == 0, st
