"""POST /v1/chat/completions on a tiny random model whose tokenizer carries a ChatML template (the real model's
chat is tests/test_real_model.py): a reply is the engine's greedy continuation of the rendered prompt, the
stream is the same reply in deltas, logprobs are the completions endpoint's, and every malformed request is a
400 in OpenAI's error shape naming the field."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from looplm.data.tokenizer import ByteTokenizer, PretrainedTokenizer
from looplm.inference.engine import Engine, SamplingParams
from looplm.serve import ServeLimits, create_app

from test_serve_access import KEY, served

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 96, "model.vocab_size": 320,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the loop runs"}]


def _tokenizer() -> PretrainedTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the loop runs its rounds; a shared block, read out at the end."] * 20,
                            trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PretrainedTokenizer(tok, eos_id=2, bos_id=None, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    return Engine(looplm.build_model(looplm.load_recipe("quickstart", overrides=TINY)).eval(), _tokenizer())


def post(call, body, headers=None):
    status, _, got, _ = call("POST", "/v1/chat/completions", {"content-type": "application/json", **(headers or {})},
                             [json.dumps(body).encode()])
    return status, got


def test_the_reply_is_the_engines_greedy_continuation_of_the_rendered_prompt(engine):
    prompt = engine.tokenizer.apply_chat(HI)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nthe loop runs<|im_end|>\n" \
                     "<|im_start|>assistant\n"
    ids = engine.tokenizer.encode(prompt)
    assert ids[0] == 1 and 2 in ids                       # the specials are single tokens, not their characters
    want = engine.generate([ids], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    with served(create_app(engine)) as call:
        status, got = post(call, {"messages": HI, "max_tokens": 12, "temperature": 0})
        assert status == 200 and got["object"] == "chat.completion", got
        choice = got["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want.text}
        assert choice["finish_reason"] == want.finish_reason
        assert got["usage"]["prompt_tokens"] == len(ids)
        assert got["usage"]["completion_tokens"] == len(want.tokens)


def test_the_stream_is_the_same_reply_in_deltas(engine):
    import httpx
    from conftest import uvicorn_in_thread
    with uvicorn_in_thread(create_app(engine)) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        whole = httpx.post(url, json={"messages": HI, "max_tokens": 10, "temperature": 0}, timeout=60).json()
        body = httpx.post(url, json={"messages": HI, "max_tokens": 10, "temperature": 0, "stream": True,
                                     "stream_options": {"include_usage": True}}, timeout=60).text
    frames = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == whole["choices"][0]["message"]["content"]
    assert frames[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert body.rstrip().endswith("data: [DONE]")


def test_logprobs_are_the_models_as_completions_report_them(engine):
    text = engine.tokenizer.apply_chat(HI)
    with served(create_app(engine)) as call:
        _, chat = post(call, {"messages": HI, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2})
        status, _, comp, _ = call("POST", "/v1/completions", {"content-type": "application/json"},
                                  [json.dumps({"prompt": text, "max_tokens": 6, "temperature": 0,
                                               "logprobs": 2}).encode()])
    content = chat["choices"][0]["logprobs"]["content"]
    want = comp["choices"][0]["logprobs"]["token_logprobs"]
    assert [c["logprob"] for c in content] == pytest.approx(want, abs=1e-6)
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6
               for c in content)


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": HI, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": HI, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": HI, "max_tokens": 10_000}, "max_tokens"),
    ({"messages": HI, "max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"messages": HI, "n": 99}, "n"),
    ({"messages": HI, "temperature": 5}, "temperature"),
])
def test_malformed_requests_are_refused_naming_the_field(engine, body, param):
    with served(create_app(engine, limits=ServeLimits(max_tokens=64))) as call:
        status, got = post(call, body)
    assert status == 400 and got["error"]["param"] == param and got["error"]["message"], got


def test_a_model_without_a_chat_template_says_so(engine):
    plain = Engine(engine.model, ByteTokenizer())
    with served(create_app(plain)) as call:
        status, got = post(call, {"messages": HI})
    assert status == 400 and "chat template" in got["error"]["message"]


def test_the_key_guards_chat_too(engine):
    with served(create_app(engine, api_key=KEY)) as call:
        status, got = post(call, {"messages": HI, "max_tokens": 2})
        assert status == 401 and got["error"]["code"] == "invalid_api_key"
        status, got = post(call, {"messages": HI, "max_tokens": 2}, {"authorization": f"Bearer {KEY}"})
        assert status == 200 and got["choices"][0]["message"]["role"] == "assistant"
