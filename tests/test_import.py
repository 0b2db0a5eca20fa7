"""`looplm import`: pretrained Hugging Face models (built tiny and random here, saved with transformers)
become looplm runs. At one round with every layer kept the logits equal the HF model's; a looped core
equals the HF layers unrolled by hand; a looped import continues training with `looplm train --init`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import looplm

from conftest import random_hf_model
from looplm.cli import main
from looplm.interop.hf_import import import_hf

transformers = pytest.importorskip("transformers")

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1)


def _configs():
    t = transformers
    return {
        # GQA, a head width of its own (4 x 24 != 64), Llama 3.1 RoPE scaling, untied head
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**COMMON, head_dim=24, rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON, tie_word_embeddings=True)),         # q/k/v biases, tied
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=32, rope_parameters={      # QK-norm
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=64)),         # window caps context
        # sandwich norms with (1 + w), GeGLU, sqrt(d) embedding scale, query_pre_attn_scalar
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(**COMMON, head_dim=32, query_pre_attn_scalar=24,
                                                           layer_types=["full_attention"] * 4)),
    }


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the loop runs its rounds; a shared block, read out at the end."] * 20, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model in eval mode, its saved folder)."""
    root = tmp_path_factory.mktemp("hf")
    tok = _tokenizer()
    out = {}
    for name, (cls, cfg) in _configs().items():
        model = random_hf_model(cls, cfg)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_every_layer_one_round_equals_hf(hf_models, tmp_path, name):
    hf, folder = hf_models[name]
    run = looplm.load_run(import_hf(folder, tmp_path / "run"))
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, run.model(ids).logits
    assert (got - expected).abs().max().item() < 1e-5
    cfg = run.recipe.model
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, run.recipe.depth.rounds) == (0, 4, 0, 1)
    if name == "mistral":                   # exact only while the sliding window never bites
        assert cfg.context == 64


def _hf_unrolled(hf, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """The HF model's own layers applied in the given order (a loop written out), then its norm and head."""
    inner = hf.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    gemma = hf.config.model_type == "gemma3_text"
    rope = inner.rotary_emb(h, pos, "full_attention") if gemma else inner.rotary_emb(h, pos)
    for i in layers:
        out = inner.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=rope)
        h = out[0] if isinstance(out, tuple) else out
    return hf.lm_head(inner.norm(h))


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_looped_core_equals_layers_unrolled_by_hand(hf_models, tmp_path, name):
    hf, folder = hf_models[name]
    run = looplm.load_run(import_hf(folder, tmp_path / "run", prelude=1, core="1:3", coda=1, rounds=3))
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = _hf_unrolled(hf, ids, [0, 1, 2, 1, 2, 1, 2, 3])
        assert (run.model(ids).logits - expected).abs().max().item() < 1e-4
        # and rounds can change at evaluation: one round is the pretrained stack itself
        assert (run.model(ids, rounds=1).logits - hf(ids).logits).abs().max().item() < 1e-5
    record = json.loads((tmp_path / "run" / "import.json").read_text())
    assert (record["prelude"], record["core"], record["coda"], record["dropped"]) == ([0], [1, 2], [3], [])


def test_core_blocks_average_the_span(hf_models, tmp_path):
    hf, folder = hf_models["llama"]
    run = looplm.load_run(import_hf(folder, tmp_path / "run", core="0:4", core_blocks=2, rounds=2))
    layers = hf.model.layers
    for b in range(2):
        want = (layers[b].self_attn.q_proj.weight + layers[2 + b].self_attn.q_proj.weight) / 2
        assert torch.allclose(run.model.core[b].attn.q.weight, want)
        want = (layers[b].mlp.down_proj.weight + layers[2 + b].mlp.down_proj.weight) / 2
        assert torch.allclose(run.model.core[b].mlp.down.weight, want)


def test_dropped_layers_are_recorded(hf_models, tmp_path):
    _, folder = hf_models["qwen3"]
    import_hf(folder, tmp_path / "run", prelude=1, core="2:3", coda=0)
    record = json.loads((tmp_path / "run" / "import.json").read_text())
    assert record["dropped"] == [1, 3] and record["core"] == [2]


def test_tokenizer_is_the_models_own(hf_models, tmp_path):
    _, folder = hf_models["qwen2"]
    run = looplm.load_run(import_hf(folder, tmp_path / "run"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "the loop runs — its rounds, read out"
    assert run.tokenizer.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert run.tokenizer.decode(run.tokenizer.encode(text)) == text
    assert run.tokenizer.eos_id == 1 and b"".join(map(run.tokenizer.token_bytes, run.tokenizer.encode(text))) \
        == text.encode()


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, words", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "relu"}, "activation 'relu'"),
])
def test_unmappable_features_are_refused_by_name(hf_models, tmp_path, capsys, change, words):
    _, folder = hf_models["llama"]
    bad = _edit_config(folder, tmp_path / "bad", **change)
    assert main(["import", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_gemma_local_layers_keep_their_own_rope(tmp_path, capsys):
    """Gemma 3 as it ships: sliding-window layers with RoPE base 10,000 beside global layers with 1,000,000 (the
    window at or above the run's context, where it never bites): every layer kept at one round equals HF, a
    looped core of one local and one global layer equals the layers unrolled by hand; a shared block that would
    average a local and a global layer is refused."""
    t = transformers
    cfg = t.Gemma3TextConfig(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=128,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    torch.manual_seed(0)
    hf = t.Gemma3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    _tokenizer().save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    run = looplm.load_run(import_hf(tmp_path / "hf", tmp_path / "flat"))
    assert run.recipe.model.local_rope_base == 10000.0 and run.recipe.model.local_blocks == (0, 2)
    with torch.no_grad():
        assert (run.model(ids).logits - hf(ids).logits).abs().max().item() < 1e-5
        looped = looplm.load_run(import_hf(tmp_path / "hf", tmp_path / "looped", prelude=1, core="1:3", coda=1,
                                           rounds=2))
        assert looped.recipe.model.local_blocks == (0, 2)     # the prelude's layer 0; core block 1 from layer 2
        inner = hf.model
        h = inner.embed_tokens(ids[:1])
        pos = torch.arange(ids.shape[1])[None]
        for i in [0, 1, 2, 1, 2, 3]:
            kind = cfg.layer_types[i]
            out = inner.layers[i](h, attention_mask=None, position_ids=pos,
                                  position_embeddings=inner.rotary_emb(h, pos, kind))
            h = out[0] if isinstance(out, tuple) else out
        assert (looped.model(ids[:1]).logits - hf.lm_head(inner.norm(h))).abs().max().item() < 1e-4
    from looplm.inference import Engine, SamplingParams           # the cached engine picks each block's tables too
    prompt = ids[0, :9].tolist()
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                           pad_token_id=0)[0, 9:].tolist()
    got = Engine(run.model, run.tokenizer).generate([prompt], SamplingParams(max_new_tokens=6, stop_at_eos=False))
    assert got[0].tokens == want
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "avg"), "--core", "0:4",
                 "--core-blocks", "1"]) == 2
    assert "average local (sliding-window) and global" in capsys.readouterr().err


def test_context_beyond_the_window_is_refused(hf_models, tmp_path, capsys):
    _, folder = hf_models["mistral"]
    assert main(["import", str(folder), "--out", str(tmp_path / "run"), "--context", "100"]) == 2
    assert "sliding window of 64" in capsys.readouterr().err


def test_looped_import_continues_training(hf_models, tmp_path, capsys):
    """The issue's path: import with a looped core, then `looplm train --init` with sampled depth, a
    backward window and per-round supervision; the loss falls, the weights started from the import."""
    _, folder = hf_models["llama"]
    src = tmp_path / "imported"
    assert main(["import", str(folder), "--out", str(src), "--prelude", "1", "--core", "1:3", "--coda", "1",
                 "--rounds", "2"]) == 0
    out = tmp_path / "trained"
    assert main(["train", "--init", str(src), "--out", str(out), "--set", "train.steps=16",
                 "--set", "train.batch_size=4", "--set", "data.seq_len=48", "--set", "data.max_bytes=40000",
                 "--set", "depth.kind=uniform", "--set", "depth.min=1", "--set", "depth.max=3",
                 "--set", "backward.window=2", "--set", "supervision.kind=every", "--set", "optim.lr=3e-3"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) >= 2 and math.isfinite(losses[-1]) and losses[-1] < losses[0] - 0.5
    report = json.loads((out / "report.json").read_text())
    assert report["init_from"] == str(src)
    run = looplm.load_run(out)
    assert run.recipe.data.tokenizer == "pretrained"
    assert run.tokenizer.vocab_size == len(transformers.AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_engine_greedy_equals_hf_generate(hf_models, tmp_path, name):
    """looplm's cached engine on the imported weights decodes what HF `generate` decodes from the
    original model: greedy, a left-padded batch of two prompts of different lengths, row by row."""
    from looplm.inference import Engine, SamplingParams
    hf, folder = hf_models[name]
    run = looplm.load_run(import_hf(folder, tmp_path / "run"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (7, 12)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          pad_token_id=0)
    expected = out[:, width:].tolist()
    got = Engine(run.model, run.tokenizer).generate(prompts, SamplingParams(max_new_tokens=10, stop_at_eos=False))
    assert [c.tokens for c in got] == expected


def test_check_on_an_imported_run_skips_only_training_records(hf_models, tmp_path):
    """An imported run has no training record: those checks say "not applicable"; the measured ones run
    (causality, the looped core against untied copies of its blocks, cache policies, ...)."""
    from looplm.checks import check_causality, check_round_telemetry, check_token_accounting, check_untied_parity
    _, folder = hf_models["qwen3"]
    run = looplm.load_run(import_hf(folder, tmp_path / "run", prelude=1, core="1:3", coda=1, rounds=2))
    assert check_token_accounting(run).kind == "not_applicable"
    assert check_round_telemetry(run).kind == "not_applicable"
    assert check_causality(run).passed and check_untied_parity(run).passed


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lm_eval_scores_equal_lm_evals_own_hf_model(hf_models, tmp_path, name):
    """lm-evaluation-harness on the imported run at one round (looplm's native model, the cached engine)
    against lm-eval's own `hf` model on the original weights: per request, the same log-likelihood and
    is_greedy."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from looplm.lm_eval import LoopLM
    hf, folder = hf_models[name]
    run_dir = import_hf(folder, tmp_path / "run")
    pairs = [("the loop runs", " its rounds"), ("a shared block,", " read out at the end."),
             ("the", " loop"), ("rounds; a shared", " block")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    theirs = HFLM(pretrained=hf, tokenizer=transformers.AutoTokenizer.from_pretrained(folder), batch_size=2,
                  device="cpu").loglikelihood(requests)
    ours = LoopLM(run=str(run_dir), rounds=1, batch_size=2).loglikelihood(requests)
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=1e-5)


def test_a_local_rope_base_without_local_blocks_is_refused():
    with pytest.raises(looplm.UserError, match="model.local_rope_base"):
        looplm.load_recipe("quickstart", {"model.local_rope_base": 10000.0})


def _hf_recirculated(hf, ids: torch.Tensor, s: int, d: int, alpha: float) -> torch.Tensor:
    """The serial schedule written with the HF model and forward hooks, no cache: position t's logits come
    from the whole prefix with layer d's output at every earlier position replaced by its refined value (so
    the layers after d read refined history, as the cache would hold it); t's own mix is then taken from
    t's layer-d and layer-s outputs of that same pass."""
    from looplm.inference.recirculation import mix
    layers, refined, out = hf.model.layers, [], []
    for t in range(ids.shape[1]):
        seen = {}

        def at(i):
            def hook(_mod, _args, output):
                h = output[0] if isinstance(output, tuple) else output
                if i == d and refined:
                    h = h.clone()
                    h[:, :t] = torch.stack(refined, 1)
                seen[i] = h
                return (h, *output[1:]) if isinstance(output, tuple) else h
            return hook
        hooks = [layers[i].register_forward_hook(at(i)) for i in (d, s)]
        try:
            with torch.no_grad():
                out.append(hf(ids[:, :t + 1]).logits[:, t])
        finally:
            for h in hooks:
                h.remove()
        refined.append(mix(seen[d][:, t], seen[s][:, t], alpha, 1 - alpha))
    return torch.stack(out, 1)


def test_recirculation_on_an_imported_llama_equals_hf_with_hooks(hf_models, tmp_path):
    from looplm.inference import Engine, GenerationConfig
    from looplm.inference.recirculation import Recirculation
    hf, folder = hf_models["llama"]
    run = looplm.load_run(import_hf(folder, tmp_path / "run"))
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    eng = Engine.from_run(run, recirculation=Recirculation(source=3, dest=1, alpha=0.3))
    with torch.inference_mode():
        got = eng.run_chunk(ids, 0, eng.new_cache(1, 10), phase="prefill", all_logits=True).logits
    want = _hf_recirculated(hf, ids, s=3, d=1, alpha=0.3)
    assert (got - want).abs().max() < 1e-4
    assert (want - hf(ids).logits).abs().max() > 1e-3            # it refined something


def test_recirculate_calibrates_evaluates_and_generates_on_an_imported_llama(hf_models, tmp_path, capsys):
    """`looplm recirculate` on an imported run, whose text comes with --data: the calibration's selection cell
    equals --s/--d's evaluation of the same setting on the selection window, its confirmation equals that
    evaluation on the other windows, and generate --recirculate equals the Engine so configured."""
    from looplm.inference import Engine, SamplingParams
    from looplm.inference.recirculation import Recirculation
    _, folder = hf_models["llama"]
    run_dir = import_hf(folder, tmp_path / "run")
    text = tmp_path / "text.txt"
    text.write_text("the loop runs its rounds; a shared block, read out at the end. " * 40)
    assert main(["recirculate", str(run_dir), "--visits", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["visits"]) == 4
    held = ["--tokens", "96", "--window", "32", "--data", str(text)]
    assert main(["recirculate", str(run_dir), "--calibrate", "--pairs", "3:1", "--alphas", "0.3", "--json",
                 "--out", str(tmp_path / "cal"), *held]) == 0
    table = json.loads(capsys.readouterr().out)
    cell, conf = table["selection"]["best"], table["confirmation"]
    assert table["selection"]["windows"] == [0, 1] and conf["windows"] == [1, 3]           # 3 windows of 32
    assert table["loss"] == conf["best"]["loss"] and table["base_loss"] == conf["base"]["loss"]   # the CONTRACT's keys
    assert (tmp_path / "cal" / "recirculation_calibration.png").exists()
    from looplm.evaluation.recirculation import evaluate, heldout_windows
    run = looplm.load_run(run_dir)
    rest = heldout_windows(run, 96, 32, str(text))[0]
    other = evaluate(run, Recirculation(source=3, dest=1, alpha=0.3), [(rest[0][1:], rest[1][1:])])
    assert other["recirculated"]["loss"] == pytest.approx(conf["best"]["loss"], abs=1e-6)
    assert other["base"]["loss"] == pytest.approx(conf["base"]["loss"], abs=1e-6)
    assert main(["recirculate", str(run_dir), "--s", "3", "--d", "1", "--alpha", "0.3", "--tokens", "32",
                 *held[2:], "--prompt", "the loop", "--max-new-tokens", "5"]) == 0       # the selection's one window
    one = json.loads(capsys.readouterr().out)
    assert one["recirculated"]["loss"] == pytest.approx(cell["loss"], abs=1e-6) and cell["change_pct"] != 0
    assert one["loss"] == one["recirculated"]["loss"] and one["base_loss"] == one["base"]["loss"]
    assert main(["generate", str(run_dir), "--prompt", "the loop", "--max-new-tokens", "5", "--json",
                 "--recirculate", "3:1:0.3"]) == 0
    want = Engine.from_run(run, exit="fixed", recirculation=Recirculation(source=3, dest=1, alpha=0.3)).generate(
        ["the loop"], SamplingParams(max_new_tokens=5))[0]
    assert json.loads(capsys.readouterr().out)["tokens"] == want.tokens
    assert one["generation"]["recirculated"] == want.text
