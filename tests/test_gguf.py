"""`looplm import FILE.gguf`: GGUF files written here with the `gguf` package's writer from tiny random HF
models, laid out as llama.cpp's converter lays them out (its metadata keys and tensor names, 1-D tensors kept
F32, a Llama's q/k rows permuted, the byte-level BPE vocabulary and chat template as metadata).

- an F32 file of each family (Llama with GQA and a head width of its own, Qwen2's biases and tied embeddings,
  Qwen3's QK-norm) imports to the original HF model's logits: the un-permutation against the source model;
- each quantized type imports to the logits transformers computes from the same file, and import.json counts
  the file's tensor types;
- the tokenizer encodes as the HF tokenizer the file was written from, renders the file's chat template as
  transformers does, and keeps the file's eos / bos ids;
- a folder holding one .gguf imports as the file does; a looped layout and `looplm export` work from GGUF;
- damaged or unsupported files are refused through the CLI: exit 2, one stderr line naming the file, no run.
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import looplm

from conftest import cli, random_hf_model
from looplm.cli import main
from looplm.interop.hf_import import import_hf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

VOCAB = 320                     # the model's rows; the trained vocabulary is smaller, padded as llama.cpp pads it
# SmolLM2's and Qwen's layout: <|endoftext|> in the vocabulary (transformers' GGUF tokenizer adds it when absent)
SPECIAL = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 1, 3                 # a chat model's eos (<|im_end|>), not the tokenizer's first special token
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["the loop runs its rounds; a shared block, read out at the end.", "Rounds: 12 — read OUT\n\tthe end!",
         "  spaces,  tabs\tand ünïcödé ✓", "<|im_start|>user\nhi<|im_end|>"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=BOS,
              eos_token_id=EOS)
QUANTIZED = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _configs():
    t = transformers
    return {
        # GQA and a head width of its own (4 x 24 != 64), untied head: llama.cpp permutes its q/k rows
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**COMMON, head_dim=24, tie_word_embeddings=False,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON, tie_word_embeddings=True)),      # q/k/v biases, tied
        # QK-norm, and linear RoPE scaling (rope.scaling.type / factor in the file)
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False,
                                                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                     "factor": 2.0})),
    }


def _tokenizer():
    """A byte-level BPE (test_import's) with ChatML's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS[:1] * 20, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[BOS],
                                                eos_token=SPECIAL[EOS])


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter on a Llama q/k projection (convert_hf_to_gguf.py, LlamaModel.permute): within each
    head, HF's two RoPE halves become interleaved rows. Written out here as the statement the import undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
"""HF's layer tensor names (after model.layers.N.) -> llama.cpp's (after blk.N.)."""


def write_gguf(path: Path, hf, tok, qtype=Q.F32, *, arch: str | None = None, with_tokens: bool = True) -> dict:
    """`hf` (and `tok`) as llama.cpp's converter writes them to `path`: 2-D weights in `qtype`, 1-D tensors F32.
    `arch` overrides general.architecture (the keys follow it); returns {type name: tensors written}."""
    cfg = hf.config
    kind = cfg.model_type
    arch = arch or kind
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {kind}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(d)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if head_dim != d // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if kind == "llama":                 # llama.cpp's Llama writes the rotated width (transformers reads head_dim there)
        w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(int(qtype) if qtype != Q.F32 else 0)

    # the tokenizer: symbols in id order, padded to the model's rows as llama.cpp pads ([PADn], UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    if with_tokens:                     # without: a file whose tokenizer was stripped (refused)
        n = len(tok)
        tokens = tok.convert_ids_to_tokens(list(range(n))) + [f"[PAD{i}]" for i in range(n, cfg.vocab_size)]
        special = {tok.convert_tokens_to_ids(s) for s in SPECIAL}
        types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n)]
        w.add_token_list(tokens)
        w.add_token_types(types + [gguf.TokenType.UNUSED] * (cfg.vocab_size - n))
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_chat_template(CHAT_TEMPLATE)

    counts: collections.Counter = collections.Counter()

    def put(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().numpy()
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
            counts["F32"] += 1
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
            counts["F16"] += 1
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
            counts[qtype.name] += 1

    sd = hf.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for theirs, ours in LAYER.items():
            t = sd.get(f"model.layers.{i}.{theirs}")
            if t is None:
                continue
            if arch == "llama" and ours in ("attn_q.weight", "attn_k.weight"):
                t = torch.from_numpy(permute(t.numpy(), heads if ours == "attn_q.weight" else kv))
            put(f"blk.{i}.{ours}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dict(counts)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok):
    """family -> (HF model in eval mode, the folder holding its one F32 file model.gguf and nothing else, the tensor
    types written to it)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, (cls, cfg) in _configs().items():
        model = random_hf_model(cls, cfg)
        folder = root / name
        folder.mkdir()
        out[name] = (model, folder, write_gguf(folder / "model.gguf", model, tok))
    return out


def _ids(n: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the weights


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_f32_file_imports_to_the_source_models_logits(models, tmp_path, name):
    hf, gg_dir, written = models[name]
    run = looplm.load_run(import_hf(gg_dir / "model.gguf", tmp_path / "run"))
    ids = _ids()
    with torch.no_grad():
        assert (run.model(ids).logits - hf(ids).logits).abs().max().item() < 1e-5
    record = json.loads((tmp_path / "run" / "import.json").read_text())
    assert record["format"] == "gguf" and record["gguf_architecture"] == name
    assert record["tensor_types"] == written == {"F32": {"llama": 39, "qwen2": 50, "qwen3": 47}[name]}
    assert record["tied_embeddings"] == hf.config.tie_word_embeddings


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_quantized_file_imports_to_transformers_logits(models, tok, tmp_path, qtype):
    hf = models["llama"][0]
    folder = tmp_path / "gguf"
    folder.mkdir()
    counts = write_gguf(folder / "m.gguf", hf, tok, qtype)
    assert counts == {"F32": 9, qtype.name: 30}      # 4 x 2 norms + the final norm; embedding, head, 4 x 7 matrices
    run = looplm.load_run(import_hf(folder / "m.gguf", tmp_path / "run"))
    # quantization moves the logits away from the source model's; transformers' own GGUF loader (its own
    # dequantization and un-permutation) on the same file is the reference for what the file holds
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        got, want = run.model(ids).logits, ref(ids).logits
        assert (got - want).abs().max().item() < 1e-4
        assert (got - hf(ids).logits).abs().max().item() > 1e-6     # the quantized values were read, not others
    assert json.loads((tmp_path / "run" / "import.json").read_text())["tensor_types"] == counts


# ----------------------------------------------------------------------------- the tokenizer


def test_tokenizer_and_chat_template_are_the_files(models, tok, tmp_path):
    gg_dir = models["qwen2"][1]
    run = looplm.load_run(import_hf(gg_dir / "model.gguf", tmp_path / "run"))
    for text in TEXTS:                  # ASCII, digits, tabs and newlines, non-ASCII, special tokens in the text
        assert run.tokenizer.encode(text) == tok(text, add_special_tokens=False)["input_ids"], text
    assert run.tokenizer.decode(run.tokenizer.encode(TEXTS[1])) == TEXTS[1]
    assert (run.tokenizer.eos_id, run.tokenizer.bos_id) == (EOS, BOS)
    ref = transformers.AutoTokenizer.from_pretrained(gg_dir, gguf_file="model.gguf")
    messages = [{"role": "user", "content": "hi"}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert run.tokenizer.apply_chat(messages) == want == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- folders, layouts, export


def test_a_folder_with_one_gguf_imports_as_the_file(models, tmp_path):
    gg_dir = models["llama"][1]
    assert [p.name for p in gg_dir.iterdir()] == ["model.gguf"]         # no config.json beside it
    by_file = looplm.load_run(import_hf(gg_dir / "model.gguf", tmp_path / "file"))
    by_folder = looplm.load_run(import_hf(gg_dir, tmp_path / "folder"))
    a, b = by_file.model.state_dict(), by_folder.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads((tmp_path / d / "import.json").read_text()) for d in ("file", "folder")]
    assert records[0] == records[1] and records[0]["source"] == str((gg_dir / "model.gguf").resolve())
    assert by_folder.tokenizer.encode(TEXTS[0]) == by_file.tokenizer.encode(TEXTS[0])


def test_looped_layout_from_gguf_and_export(models, tmp_path):
    from test_import import _hf_unrolled
    hf, gg_dir, _ = models["llama"]
    run_dir = tmp_path / "run"
    assert main(["import", str(gg_dir / "model.gguf"), "--out", str(run_dir), "--prelude", "1", "--core", "1:3",
                 "--coda", "1", "--rounds", "2"]) == 0
    run = looplm.load_run(run_dir)
    ids = _ids(20, seed=2)[:1]
    with torch.no_grad():               # the prelude once, the core's two layers twice, the coda once
        assert (run.model(ids).logits - _hf_unrolled(hf, ids, [0, 1, 2, 1, 2, 3])).abs().max().item() < 1e-4
    record = json.loads((run_dir / "import.json").read_text())
    assert (record["prelude"], record["core"], record["coda"], record["rounds"]) == ([0], [1, 2], [3], 2)
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "config.json").is_file() and (tmp_path / "exported" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- refusals


def refused(capsys, *argv) -> str:
    """The one stderr line of `looplm ARGV`, which must exit 2 (test_damaged_files' rule)."""
    code, _, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("looplm: error: "), err
    return lines[0]


def _not_gguf(d: Path, models, tok) -> Path:
    (d / "x.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    return d / "x.gguf"


def _cut_short(d: Path, models, tok) -> Path:
    path = d / "cut.gguf"
    shutil.copy(models["llama"][1] / "model.gguf", path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return path


def _architecture(arch):
    def make(d: Path, models, tok) -> Path:
        write_gguf(d / f"{arch}.gguf", models["llama"][0], tok, arch=arch)
        return d / f"{arch}.gguf"
    return make


def _two_files(d: Path, models, tok) -> Path:
    folder = d / "two"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(models["llama"][1] / "model.gguf", folder / name)
    return folder


def _no_tokens(d: Path, models, tok) -> Path:
    write_gguf(d / "untokenized.gguf", models["llama"][0], tok, with_tokens=False)
    return d / "untokenized.gguf"


REFUSALS = {
    "not GGUF": (_not_gguf, "not a readable GGUF file"),
    "cut short": (_cut_short, "cut short"),
    "architecture gpt2": (_architecture("gpt2"), "general.architecture 'gpt2'"),
    "architecture mamba": (_architecture("mamba"), "general.architecture 'mamba'"),
    "two .gguf files": (_two_files, "holds 2 .gguf files"),
    "no tokenizer.ggml.tokens": (_no_tokens, "tokenizer.ggml.tokens"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_through_the_cli_naming_the_file(models, tok, tmp_path, capsys, case):
    make, words = REFUSALS[case]
    src = make(tmp_path, models, tok)
    out = tmp_path / "run"
    err = refused(capsys, "import", src, "--out", out)
    assert str(src) in err and words in err, err
    assert not out.exists() and not out.with_name("run.partial").exists()


def test_a_vocabulary_without_endoftext_keeps_the_files_ids(tmp_path):
    """Llama 3's layout: a byte-level vocabulary with no <|endoftext|>, every row a token. transformers' GPT-2
    tokenizer adds one beyond the file's ids; the import keeps the file's ids only (the model has no row more)."""
    from tokenizers import Tokenizer, decoders, models as tmodels, pre_tokenizers, trainers
    raw = Tokenizer(tmodels.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(TEXTS[:1] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|im_end|>")
    assert "<|endoftext|>" not in tok.get_vocab()
    cfg = transformers.LlamaConfig(**COMMON)            # every row a token ([PADn] beyond the trained ones)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    global SPECIAL
    saved, SPECIAL = SPECIAL, ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]
    try:
        write_gguf(tmp_path / "model.gguf", hf, tok)
    finally:
        SPECIAL = saved
    run = looplm.load_run(import_hf(tmp_path / "model.gguf", tmp_path / "run"))
    assert run.tokenizer.vocab_size == VOCAB == run.model.cfg.vocab_size
    for text in TEXTS[:3]:
        assert run.tokenizer.encode(text) == tok(text, add_special_tokens=False)["input_ids"], text
    ids = _ids()
    with torch.no_grad():
        assert (run.model(ids).logits - hf(ids).logits).abs().max().item() < 1e-5
