"""The gateway's pure parts, without processes: the gRPC->HTTP table, OpenAI request mapping,
chat templates, the metrics exposition, and the monitoring files shipped beside compose."""
from __future__ import annotations

import json
import os
import re

import grpc
import pytest
import yaml

from client.errors import error_for
from client.messages import Stats
from gateway import openai_api as oa
from gateway.chat_template import ChatTemplate, render_simple
from gateway.errors import GRPC_TO_HTTP, GatewayError, as_gateway_error
from gateway.metrics import GatewayMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("code,status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.PERMISSION_DENIED, 403), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
    (grpc.StatusCode.UNIMPLEMENTED, 501)])
def test_error_table(code, status):
    g = as_gateway_error(error_for(code, "what was wrong"))
    assert g.status == status and g.body()["error"]["message"] == "what was wrong"
    assert g.body()["error"]["code"] == code.name.lower()
    assert (g.retry_after is not None) == (status in (429, 503))


def test_the_services_refusal_of_the_gateways_own_token_is_502_not_401():
    """A client's key is checked by the gateway (401 there); upstream UNAUTHENTICATED is about the
    gateway's --metadata-token, which no client can fix."""
    g = as_gateway_error(error_for(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong client token"))
    assert g.status == 502 and "refused this gateway's token" in g.message and g.retry_after is None


def test_error_table_covers_every_code_and_never_fits_is_400():
    assert set(GRPC_TO_HTTP) == set(grpc.StatusCode) - {grpc.StatusCode.OK}
    g = as_gateway_error(error_for(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   "this request needs 9 blocks ... the whole pool holds 4: it could never run"))
    assert g.status == 400 and g.retry_after is None
    assert as_gateway_error(TypeError("prompt must be a str")).status == 400
    assert as_gateway_error(GatewayError(404, "x", code="model_not_found")).body()["error"]["code"] == "model_not_found"


def test_completion_mapping():
    req = oa.CompletionRequest(prompt="hi")
    kw = oa.completion_kwargs(req)
    assert kw["max_new_tokens"] == 16 and kw["temperature"] == 1.0 and "top_p" not in kw  # OpenAI's defaults
    req = oa.CompletionRequest(prompt=[[1, 2], [3]], max_tokens=4, temperature=0.5, top_p=0.9, top_k=-1, stop="x",
                               n=2, best_of=3, logprobs=2, presence_penalty=0.5, frequency_penalty=0.25,
                               repetition_penalty=1.2, min_tokens=1, seed=3, stop_token_ids=[9])
    kw = oa.completion_kwargs(req)
    assert kw == dict(max_new_tokens=4, temperature=0.5, top_k=0, seed=3, stop=["x"], ignore_eos=False, n=2,
                      best_of=3, min_new_tokens=1, presence_penalty=0.5, frequency_penalty=0.25,
                      repetition_penalty=1.2, min_p=0.0, include_stop_str_in_output=False, top_p=0.9,
                      stop_token_ids=[9], logprobs=2)
    assert oa.completion_prompts(req) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert oa.completion_prompts(oa.CompletionRequest(prompt=[5, 6])) == [{"prompt_token_ids": [5, 6]}]
    assert oa.completion_prompts(oa.CompletionRequest(prompt=["a", "b"])) == [{"prompt": "a"}, {"prompt": "b"}]
    for bad in (dict(prompt=[]), dict(prompt=[[1], []]), dict(prompt="x", logprobs=21), dict(prompt="x", n=0),
                dict(prompt="x", n=2, best_of=1), dict(prompt="x", suffix="y"), dict(prompt="x", n=2, temperature=0),
                dict(prompt="x", stream=True, n=1, best_of=2),
                # vLLM fields that would change the answer are refused by name, not ignored
                dict(prompt="x", prompt_logprobs=1), dict(prompt="x", skip_special_tokens=False),
                dict(prompt="x", allowed_token_ids=[1, 2]), dict(prompt="x", truncate_prompt_tokens=8)):
        with pytest.raises(GatewayError) as info:
            r = oa.CompletionRequest(**bad)
            oa.completion_prompts(r)
            oa.completion_kwargs(r)
        assert info.value.status == 400
    # ...while their neutral values and fields of no consequence pass
    oa.completion_kwargs(oa.CompletionRequest(prompt="x", skip_special_tokens=True, user="u", store=False))
    assert oa.completion_kwargs(oa.CompletionRequest(prompt="x", include_stop_str_in_output=True))[
        "include_stop_str_in_output"]


def test_chat_mapping_and_simple_template():
    req = oa.ChatCompletionRequest(messages=[{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
                                   max_completion_tokens=7, logprobs=True, top_logprobs=3)
    msgs = oa.chat_messages(req)
    assert msgs[1] == {"role": "user", "content": "a\nb"}          # parts joined by "\n", as vLLM joins them
    kw = oa.chat_kwargs(req, default_max_tokens=99)
    assert kw["max_new_tokens"] == 7 and kw["logprobs"] == 3
    assert oa.chat_kwargs(oa.ChatCompletionRequest(messages=msgs), 99)["max_new_tokens"] == 99
    assert render_simple(msgs) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    assert ChatTemplate("tiny").render(msgs) == render_simple(msgs)
    # continue_final_message: the text ends where the last (assistant) message does
    partial = msgs + [{"role": "assistant", "content": "The answer is"}]
    assert ChatTemplate("tiny").render(partial, False, True) == render_simple(msgs) + "The answer is"
    for bad in (dict(top_logprobs=2), dict(response_format={"type": "xml"})):
        with pytest.raises(GatewayError):
            r = oa.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **bad)
            oa.chat_messages(r)
            oa.chat_kwargs(r, 8)


def test_checkpoint_template_without_a_tokenizer_renders_with_jinja(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}"}))
    t = ChatTemplate(str(tmp_path))
    assert "jinja2" in t.source
    assert t.render([{"role": "user", "content": "hi"}]) == "[user] hi</s>\n[assistant] "
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no system') }}"}))
    with pytest.raises(ValueError, match="no system"):
        ChatTemplate(str(tmp_path)).render([{"role": "system", "content": "x"}])


def _exposition(stats: Stats | None) -> str:
    m = GatewayMetrics(lambda: "tiny")
    m.ttft.labels("tiny").observe(0.1)
    m.request_success.labels("tiny", "stop").inc()
    m.stats.update(stats)
    return m.render().decode()


def test_metrics_names_and_chains():
    st = Stats(num_blocks=100, used_blocks=25, free_blocks=75, cached_blocks=5, shared_blocks=3, running=2, waiting=1,
               ready=True, cache_epoch=7,
               chains=[{"chain_id": 0, "num_blocks": 50, "used_blocks": 10, "free_blocks": 40, "running": 1,
                        "stages": [{"layer_start": 0, "layer_end": 2, "step_ms": 4.0, "busy_fraction": 0.5}]},
                       {"chain_id": 1, "num_blocks": 50, "used_blocks": 15, "free_blocks": 35, "running": 1}])
    text = _exposition(st)
    assert 'vllm:num_requests_running{model_name="tiny"} 2.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.25' in text
    assert 'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 1.0' in text
    assert 'minipaged:chain_free_blocks{chain="1",group="",model_name="tiny"} 35.0' in text
    assert 'minipaged:stage_step_seconds{chain="0",layers="0:2",model_name="tiny",stage="0"} 0.004' in text
    assert "minipaged:metadata_up 1.0" in text and "_created" not in text
    down = _exposition(None)
    assert "minipaged:metadata_up 0.0" in down and "vllm:num_requests_running" not in down.replace("# ", "")


def test_monitoring_files_use_metrics_that_exist():
    prom = yaml.safe_load(open(os.path.join(ROOT, "monitoring", "prometheus.yml")))
    jobs = {c["job_name"]: c for c in prom["scrape_configs"]}
    assert set(jobs) == {"minipaged-gateway", "minipaged-metadata", "minipaged-worker"}
    dash = json.load(open(os.path.join(ROOT, "monitoring", "grafana", "minipaged-dashboard.json")))
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b((?:vllm|minipaged):[a-z0-9_:]+)", e)}
    # the gateway and the service both export vLLM's request series: a query summing over targets
    # would count a request twice, so every vllm: query names its job
    assert all('job="minipaged-' in e for e in exprs if "vllm:" in e), [e for e in exprs if "vllm:" in e and "job=" not in e]
    st = Stats(num_blocks=4, ready=True, chains=[{"chain_id": 0, "stages": [{"step_ms": 1.0}]}])
    m = GatewayMetrics(lambda: "tiny")
    for h in (m.ttft, m.itl, m.e2e):
        h.labels("tiny").observe(0.1)
    m.prompt_tokens.labels("tiny").inc()
    m.generation_tokens.labels("tiny").inc()
    m.request_success.labels("tiny", "stop").inc()
    m.stats.update(st)
    exposed = {line.split("{")[0].split(" ")[0] for line in m.render().decode().splitlines() if line and line[0] != "#"}
    # the metadata service's own series (its --metrics-port), named as vLLM names them
    service_side = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total"}
    missing = {n for n in names if n not in exposed and n + "_bucket" not in exposed} - service_side
    assert not missing, missing


def test_a_request_is_counted_when_its_last_choice_finishes():
    """Not when the service's stream closes: a client that hangs up on the finish_reason chunk
    was served in full (before, 4-8 of 60 such streams went uncounted)."""
    from types import SimpleNamespace

    from client.messages import StreamChunk, Usage
    from gateway.request_metrics import Observed
    m = GatewayMetrics(lambda: "tiny")
    gw = SimpleNamespace(metrics=m, model_name="tiny", ttft_sum=0.0, ttft_count=0)
    obs = Observed(gw, 0.0, choices=2)

    def count(name, **labels):
        return m.registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0
    obs.chunk(StreamChunk(token_ids=[5, 6], text="ab", finish_reason=None, index=0))
    obs.chunk(StreamChunk(token_ids=[7], text="c", finish_reason="stop", index=0, usage=Usage(3, 3)))
    assert count("vllm:request_success_total", finished_reason="stop") == 0      # one choice of two
    obs.chunk(StreamChunk(token_ids=[8], text="d", finish_reason="length", index=1, usage=Usage(3, 1)))
    assert count("vllm:e2e_request_latency_seconds_count") == 1 and count("vllm:generation_tokens_total") == 4
    obs.finish()                                   # the stream's end: already counted, not twice
    assert count("vllm:e2e_request_latency_seconds_count") == 1
    # refused by the service before any token (a bad value): counted nowhere, as vLLM counts a
    # request it rejects (before: an "abort" and an e2e sample); failed after a token: an abort
    import grpc

    from client.errors import MiniPagedError
    Observed(gw, 0.0).fail(MiniPagedError("temperature must be ...", grpc.StatusCode.INVALID_ARGUMENT))
    assert count("vllm:e2e_request_latency_seconds_count") == 1 and count("vllm:request_success_total",
                                                                           finished_reason="abort") == 0
    late = Observed(gw, 0.0)
    late.chunk(StreamChunk(token_ids=[5], text="a", finish_reason=None, index=0))
    late.fail(MiniPagedError("the chain was lost", grpc.StatusCode.INVALID_ARGUMENT))
    assert count("vllm:request_success_total", finished_reason="abort") == 1


def test_logprobs_of_disallowed_alternatives_are_floored_for_json():
    """A grammar's masked alternatives are -inf, which JSON cannot carry: vLLM's floor, -9999.0
    (before, a structured request with many top_logprobs was a 400 "Out of range float values")."""
    from client.results import StreamChunk
    from gateway.openai_responses import Choice
    c = Choice(0, logprobs=[-0.5], top=[{1: -0.5, 2: float("-inf")}])
    c.add(StreamChunk(token_ids=[3], text="x", logprobs=[-1.0], top_logprobs=[{3: -1.0, 4: float("-inf")}]))
    assert c.logprobs == [-0.5, -1.0] and c.top == [{1: -0.5, 2: -9999.0}, {3: -1.0, 4: -9999.0}]
