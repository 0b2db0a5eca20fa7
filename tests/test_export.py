"""`looplm export RUN --hf DIR`: the folder transformers loads with its own Auto classes and without looplm
computes looplm's function. For each kind of model looplm trains (dense, gated with an exit policy,
LoopMoE, the untied baseline, Mixture-of-Recursions token and expert choice): full-sequence logits equal
the looplm forward's, greedy `generate` equals `looplm generate` / the engine, a left-padded batch equals
looplm's batched generation row by row (and each prompt alone), seeded sampling draws what looplm's
sampler draws; the tokenizer round-trips; what the template does not implement is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.data.tokenizer import ByteTokenizer, train_bpe
from looplm.inference.engine import Engine, SamplingParams
from looplm.interop import hf_export
from looplm.interop.hf_export import export_hf
from looplm.runs.checkpoint import save_checkpoint, write_text

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.n_prelude": 1, "model.n_core": 2, "model.n_coda": 1, "depth.kind": "fixed", "depth.rounds": 3,
        "data.seq_len": 32}
# quickstart's init_state is "random": every kind below without its own init_state draws the seed-0 table
KINDS = {
    "dense": {"model.injection": "concat", "model.norm": "sandwich", "model.state_norm": True,
              "model.tie_embeddings": False, "model.qkv_bias": True, "model.qk_norm": True},
    "gated": {"exit.gate": True, "supervision.kind": "learned_exit", "exit.policy": "quantile:0.5",
              "model.init_state": "zeros", "model.residual_scaling": "deeploop", "model.activation": "gelu_tanh",
              "model.attn_scale": 0.3, "model.embed_scale": 2.0, "model.rope_scaling": "llama3",
              "model.rope_factor": 4.0, "model.rope_original_context": 32},
    "moe": {"model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_hidden": 32, "model.init_state": "prelude",
            "model.injection": "none", "model.rope_scaling": "linear", "model.rope_factor": 2.0,
            "model.kv_sharing": "first"},
    "untied": {"model.untied": True, "model.init_state": "prelude", "model.injection": "decay"},
    "mor_token": {"model.mor": "token_choice"},
    "mor_expert": {"model.mor": "expert_choice", "model.mor_causal": "aux_router", "model.mor_cache": "shared_first"},
}
PROMPTS = ["hello", "a somewhat longer prompt", "xy"]
NEW = 8


def _spread(m, kind):
    """Weights away from initialisation (norms, biases, routers, the gate), so that every feature and
    routing decision shapes the output: exits and routed depths differ from token to token."""
    mor = kind.startswith("mor")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("embed"):     # routed runs: logits of O(10), so fp32 round-off stays below 1e-5
                p.normal_(0, 0.3 if mor else 1.0)
            elif name.startswith(("mor_router", "mor_aux_router", "gate.1")):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.06 if mor else 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
            else:
                p.uniform_(0.5, 1.5)
        if getattr(m, "mor_bias", None) is not None:
            m.mor_bias.normal_(0, 0.05)


def _save_run(d, recipe, model, tok):
    save_checkpoint(d, model, {"step": 0})
    tok.save(d / "checkpoint")
    write_text(d / "recipe.toml", recipe.to_toml())
    return d


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """kind -> (run folder, export folder, looplm run, HF model, HF tokenizer), built once per kind."""
    made = {}

    def get(kind):
        if kind not in made:
            recipe = looplm.load_recipe("quickstart", overrides={**TINY, **KINDS[kind]})
            torch.manual_seed(0)
            model = looplm.build_model(recipe)
            _spread(model, kind)
            run = _save_run(tmp_path_factory.mktemp(kind), recipe, model, ByteTokenizer())
            out = run.parent / f"{run.name}-hf"
            export_hf(run, out)
            hf, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32,
                                                            output_loading_info=True)
            assert not any(info.values()), info                 # every weight loaded, nothing left over
            made[kind] = (run, out, looplm.load_run(run), hf.eval(), AutoTokenizer.from_pretrained(out))
        return made[kind]
    return get


def _cache(output):
    """The output's cache: `cache` (transformers >= 5.3x), `past_key_values` before."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def _engine_tokens(run, prompts, **config):
    done = Engine.from_run(run, **config).generate(prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False))
    return [c.tokens for c in done], [c.rounds_used for c in done]


def _hf_new(hf, tok, prompts, **kw):
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = hf.generate(**enc, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **kw)   # no stop at eos
    return [row.tolist() for row in out[:, enc["input_ids"].shape[1]:]]


def test_the_folder_loads_without_looplm_and_holds_what_it_says(exported, tmp_path):
    run, out, lrun, hf, tok = exported("dense")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "modeling_looplm.py",
            "configuration_looplm.py", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "looplm" and config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_looplm.")
    assert config["rounds"] == 3 and config["exit_policy"] == "fixed" and config["qk_norm"] is True
    for name in ("modeling_looplm.py", "configuration_looplm.py"):
        code = (out / name).read_text()
        assert not re.search(r"^\s*(import|from)\s+looplm\b", code, re.M), name
    # a fresh interpreter in which looplm cannot be imported loads it and generates what this one does
    want = _hf_new(hf, tok, PROMPTS[:1])[0]
    script = ("import sys, json; sys.modules['looplm'] = None\n"
              "import torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
              f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)\n"
              f"t = AutoTokenizer.from_pretrained({str(out)!r})\n"
              f"ids = t([{PROMPTS[0]!r}], return_tensors='pt')\n"
              f"g = m.generate(**ids, max_new_tokens={NEW}, do_sample=False, eos_token_id=None)\n"
              "open('tokens.json', 'w').write(json.dumps(g[0, ids['input_ids'].shape[1]:].tolist()))\n"
              "assert not any(k == 'looplm' or k.startswith('looplm.') for k, v in sys.modules.items() if v)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "tokens.json").read_text()) == want


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_the_looplm_forward(exported, kind):
    run, out, lrun, hf, tok = exported(kind)
    x = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = hf(x), lrun.model(x)
        # kv_sharing = first: the export runs the chunk column by column, looplm as one masked product (another
        # summation order: 4.5e-5 on these logits of unit-variance weights); a missed rule moves them by ~1
        atol = 1e-4 if KINDS[kind].get("model.kv_sharing") == "first" else 1e-5
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=atol)
        if kind.startswith("mor"):        # the router's depths, decided causally token by token
            assert torch.equal(got.rounds_used, want.rounds_used) and len(set(want.rounds_used.flatten().tolist())) > 1
            with pytest.raises(ValueError, match="router decides"):
                hf(x, rounds=5)
        elif kind == "untied":
            with pytest.raises(ValueError, match="untied baseline runs exactly 3 rounds"):
                hf(x, rounds=5)
        else:                             # another depth, asked per call
            torch.testing.assert_close(hf(x, rounds=5).logits, lrun.model(x, 5).logits, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_and_left_padded_batches_equal_looplm_generation(exported, kind, capsys):
    run, out, lrun, hf, tok = exported(kind)
    want, _ = _engine_tokens(lrun, PROMPTS)                       # looplm's batched generation
    assert _hf_new(hf, tok, PROMPTS) == want                      # HF: left-padded with attention_mask
    assert [_hf_new(hf, tok, [p])[0] for p in PROMPTS] == want    # and each prompt alone
    with torch.no_grad():                                         # pads are never attended to
        padded = hf(**tok(PROMPTS, return_tensors="pt", padding=True)).logits[:, -1]
        alone = torch.stack([hf(**tok([p], return_tensors="pt")).logits[0, -1] for p in PROMPTS])
    # other shapes' round-off, amplified by 8 block visits of these large weights, stays below 1e-3 (the gated
    # run: 1.2e-4); a pad attended to, or a position counted from the pad, moves these logits by ~1
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-3)
    if kind == "dense":                                           # the command itself
        assert main(["generate", str(run), "--prompt", PROMPTS[1], "--max-new-tokens", str(NEW), "--json"]) == 0
        cli = json.loads(capsys.readouterr().out)["tokens"]
        assert cli == want[1][:len(cli)]


def test_exits_rounds_and_cache_policy_per_call_equal_the_engine(exported):
    """The gated run: its recipe's quantile exit decides per token; the rounds each generated token ran
    and what an exited token leaves at later rounds (copy-forward, or masked) are the engine's."""
    run, out, lrun, hf, tok = exported("gated")
    for over, call in (({}, {}), ({"missing": "mask"}, {"missing_kv": "mask"}),
                       ({"exit": "entropy:1.0", "rounds": 5}, {"exit_policy": "entropy:1.0", "rounds": 5}),
                       ({"exit": "kl:2", "min_rounds": 2}, {"exit_policy": "kl:2", "exit_min_rounds": 2})):
        want, rounds = _engine_tokens(lrun, PROMPTS, **over)
        assert _hf_new(hf, tok, PROMPTS, **call) == want, over
        # token by token through forward and the cache: the rounds each new token ran
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        cache, got, used = None, [], []
        with torch.no_grad():
            for _ in range(NEW):
                o = hf(ids if cache is None else ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True, **call)
                cache = _cache(o)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                got.append(nxt[:, 0].tolist())
                used.append(o.rounds_used[:, -1].tolist())
                ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        assert [list(t) for t in zip(*got)] == want, over
        # the rounds of the step that produced each token: the prompt's ran every round (no exits in the
        # prefill), each decoded token exits where the engine's did
        assert [list(r) for r in zip(*used)] == rounds, over
        assert {r[0] for r in rounds} == {call.get("rounds", 3)} and len({n for r in rounds for n in r[1:]}) > 1, over


def test_sampling_draws_what_looplm_draws_with_the_same_seed(exported):
    """One prompt: torch.manual_seed(s) before generate makes HF's multinomial draw from the same
    generator state as looplm's sampler seeded with s, and init_state_seed=s picks the same random
    initial-state table, so the samples are looplm's. (A batch draws its rows from one generator in
    HF and from one generator per row in looplm: reproducible, not comparable.)"""
    run, out, lrun, hf, tok = exported("dense")
    enc = tok([PROMPTS[0]], return_tensors="pt")
    for seed in (0, 7):
        want = Engine.from_run(lrun).generate([PROMPTS[0]], SamplingParams(
            max_new_tokens=NEW, temperature=0.8, seed=seed, stop_at_eos=False))[0].tokens
        draws = []
        for _ in range(2):
            torch.manual_seed(seed)
            g = hf.generate(**enc, max_new_tokens=NEW, do_sample=True, temperature=0.8, eos_token_id=None,
                            init_state_seed=seed)
            draws.append(g[0, enc["input_ids"].shape[1]:].tolist())
        assert draws[0] == draws[1] == want
    torch.manual_seed(3)
    batch = hf.generate(**tok(PROMPTS, return_tensors="pt", padding=True), max_new_tokens=NEW, do_sample=True)
    torch.manual_seed(3)
    assert torch.equal(batch, hf.generate(**tok(PROMPTS, return_tensors="pt", padding=True), max_new_tokens=NEW,
                                          do_sample=True))


def test_the_cache_rolls_back_and_foreign_caches_are_handled(exported):
    run, out, lrun, hf, tok = exported("gated")
    from transformers import DynamicCache
    x = torch.randint(0, 257, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = hf(x[:, :9], use_cache=True)
        cache = _cache(a)
        assert type(cache).__name__ == "LoopLMCache" and cache.get_seq_length() == 9
        assert len(cache.layers) == 1 + 3 * 2 + 1                  # prelude, (round, core block), coda
        b = hf(x[:, 9:], cache=cache, use_cache=True)
        cache.crop(-1)                                              # forget the last token, run it again
        assert cache.get_seq_length() == 9
        torch.testing.assert_close(hf(x[:, 9:], cache=cache).logits, b.logits, rtol=0, atol=0)
        assert _cache(hf(x, cache=DynamicCache())).get_seq_length() == 10     # an empty default cache: replaced
        with pytest.raises(ValueError, match="start a new cache"):
            hf(x[:, :1], cache=cache, rounds=5)


def test_refused_fields_exit_2_with_one_line(exported, monkeypatch, capsys, tmp_path):
    run = exported("gated")[0]
    # a template that did not implement GeGLU would refuse this run, naming the field, and write nothing
    monkeypatch.setitem(hf_export.MODEL_FIELDS, "activation", ("silu",))
    assert main(["export", str(run), "--hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'model.activation = "gelu_tanh" cannot be exported' in err, err
    assert not (tmp_path / "x").exists()
    monkeypatch.undo()
    # a field the tables do not know (one added to looplm later) is refused unless at its default
    monkeypatch.delitem(hf_export.MODEL_FIELDS, "qk_norm")
    recipe = looplm.load_recipe("quickstart", overrides=TINY)
    assert hf_export.refusals(recipe) == []
    qk = recipe.replace(model=type(recipe.model)(**{**vars(recipe.model), "qk_norm": True}))
    assert hf_export.refusals(qk) == ["model.qk_norm = true cannot be exported: the exported modeling code does not "
                                      "implement model.qk_norm (only its default)"]
    monkeypatch.undo()
    # so is a section the tables do not know (as `train` would be, were it not listed), field by field
    monkeypatch.delitem(hf_export.TRAINING_ONLY, "train")
    plain = recipe.replace(train=type(recipe.train)())                 # every train field at its default
    assert hf_export.refusals(plain) == []
    longer = plain.replace(train=dataclasses.replace(plain.train, steps=7))
    assert hf_export.refusals(longer) == ["train.steps = 7 cannot be exported: the exported modeling code does not "
                                          "implement train.steps (only its default)"]
    monkeypatch.undo()
    # a folder that holds something else is not overwritten
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--hf", str(tmp_path / "busy")]) == 2
    assert "not empty (holds notes.txt) and not an earlier looplm export" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]


def test_the_tokenizer_round_trips_the_runs(exported, tmp_path):
    # the byte tokenizer: every byte is the token of its value, <|eos|> is 256
    _, out, lrun, _, tok = exported("dense")
    byte = ByteTokenizer()
    symbols = tok.convert_ids_to_tokens(list(range(257)))
    assert [tok.convert_tokens_to_ids(s) for s in symbols] == list(range(257)) and symbols[256] == "<|eos|>"
    assert tok.eos_token_id == 256 and tok.pad_token_id == 256 and tok.padding_side == "left"
    for b in range(256):
        assert tok.decode([b]) == byte.decode([b]), b
    texts = ["", "hello world", "  two  spaces\n\ttab", "naïve café ✓ 𝔘 ☃", "<|eos|> is text here",
             "".join(map(chr, range(1, 128))), "Ünïcødé " * 3]
    for t in texts:
        assert tok(t, add_special_tokens=False)["input_ids"] == byte.encode(t), t
        assert tok.decode(byte.encode(t)) == t
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):                     # arbitrary bytes, cut characters and eos included
        ids = torch.randint(0, 257, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng).tolist()
        assert tok.decode(ids, skip_special_tokens=True) == byte.decode(ids), ids
    # a BPE run: its own tokenizer.json, the same ids and text
    bpe = train_bpe(["def f%d(x):\n    return x * %d + 1  # naïve line\n" % (i, i) for i in range(200)], 300)
    recipe = looplm.load_recipe("quickstart", overrides={**TINY, "data.tokenizer": "bpe", "model.vocab_size": 300})
    run = _save_run(tmp_path / "bpe", recipe, looplm.build_model(recipe), bpe)
    export_hf(run, tmp_path / "bpe-hf")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "bpe-hf")
    for t in texts + ["def f12(x):\n    return x * 12 + 1  # naïve line\n"]:
        ids = bpe.encode(t)
        assert hf_tok(t, add_special_tokens=False)["input_ids"] == ids, t
        assert hf_tok.decode(ids + [bpe.eos_id], skip_special_tokens=True) == bpe.decode(ids + [bpe.eos_id]) == t
    assert hf_tok.eos_token_id == bpe.eos_id
    # a pretrained model's own tokenizer (`looplm import`): copied, its special tokens read as that family reads them
    from tokenizers import Tokenizer
    from looplm.data.tokenizer import PretrainedTokenizer
    own = Tokenizer.from_str(bpe._tok.to_str())
    own.add_special_tokens(["<|bos|>"])
    pre = PretrainedTokenizer(own, eos_id=bpe.eos_id, bos_id=own.token_to_id("<|bos|>"))
    recipe = looplm.load_recipe("quickstart", overrides={**TINY, "data.tokenizer": "pretrained",
                                                          "model.vocab_size": 320})
    export_hf(_save_run(tmp_path / "pre", recipe, looplm.build_model(recipe), pre), tmp_path / "pre-hf")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "pre-hf")
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<|bos|>", "<|eos|>")
    assert json.loads((tmp_path / "pre-hf" / "config.json").read_text())["bos_token_id"] == pre.bos_id
    for t in texts + ["two <|eos|> documents"]:
        ids = pre.encode(t)
        assert hf_tok(t, add_special_tokens=False)["input_ids"] == ids, t
        assert hf_tok.decode(ids, skip_special_tokens=True) == pre.decode(ids), t
