"""`looplm import FILE.gguf`: a GGUF file (llama.cpp's, Ollama's, LM Studio's format) read as an import source.

The file holds everything a Hugging Face folder does, in other names: hyper-parameters as metadata
(`llama.embedding_length`, ...), tensors under llama.cpp's names (`blk.3.attn_q.weight`), often quantized,
and the tokenizer (vocabulary, merges, special ids, chat template) as metadata too. This module maps each
onto what the HF import already reads (`hf_import.Source`), so both formats share one set of families,
refusals and weight maps:

- the config: the metadata of the families looplm imports (llama, also Mistral's files; qwen2; qwen3) under
  config.json's keys, then `hf_import.check_config`;
- the tensors: read one at a time from the memory-mapped file, dequantized by the `gguf` package (every type
  it implements; F32/F16/BF16 as they are) to fp32, renamed to HF's names. llama.cpp's converter permutes
  the rows of a Llama-architecture q/k projection (its RoPE pairs neighbouring rows where HF pairs the two
  halves of a head); `GGUFWeights` undoes that, which is the one place the formats differ in arithmetic;
- the tokenizer: transformers' GGUF tokenizer conversion (`AutoTokenizer.from_pretrained(..., gguf_file=)`),
  its fast tokenizer kept with the file's eos/bos ids and chat template.

Reference: transformers loading the same file gives the same logits (tests/test_gguf.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""GGUF general.architecture -> the HF model_type it is imported as (Mistral's files say llama)."""

PERMUTED_QK = {"llama"}
"""Architectures whose q/k rows llama.cpp's converter permuted (undone on read)."""

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias", "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}
"""A layer's tensors: llama.cpp's name (after `blk.N.`) -> HF's (after `layers.N.`)."""
TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


class GGUFFile:
    """The parsed header of one GGUF file: metadata by key and tensors by name (data memory-mapped, nothing
    dequantized yet). UserError naming the file when it is not a GGUF file or is cut short."""

    def __init__(self, path: Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise UserError(f"{path}: reading GGUF files needs the gguf package: pip install 'looplm[gguf]'") from None
        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as err:      # ValueError on a bad magic or version, others on a file cut short
            detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise UserError(f"{path}: not a readable GGUF file, or cut short ({detail})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def meta(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception:
            raise UserError(f"{self.path}: metadata {key} is unreadable") from None


def read_gguf_config(f: GGUFFile) -> dict[str, Any]:
    """The file's hyper-parameters under config.json's keys (checked by `hf_import.check_config`)."""
    from .hf_import import check_config
    arch = f.meta("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{f.path}: general.architecture {arch!r} cannot be imported from GGUF (supported: "
                        f"{', '.join(ARCHITECTURES)}; import other families from their Hugging Face folder)")
    if "rope_freqs.weight" in f.tensors:
        raise UserError(f"{f.path}: RoPE frequency factors (rope_freqs.weight, Llama 3.1's scaling) cannot be imported "
                        "from GGUF; import the Hugging Face folder, whose config names the scaling")
    a = arch
    tokens = f.reader.fields.get("tokenizer.ggml.tokens")      # its length only (not 50k strings decoded)
    heads = f.meta(f"{a}.attention.head_count")
    d = f.meta(f"{a}.embedding_length")
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": f.meta(f"{a}.vocab_size", len(tokens.data) if tokens is not None else None),
        "hidden_size": d, "intermediate_size": f.meta(f"{a}.feed_forward_length"),
        "num_hidden_layers": f.meta(f"{a}.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": f.meta(f"{a}.attention.head_count_kv", heads),
        "head_dim": f.meta(f"{a}.attention.key_length"),
        "max_position_embeddings": f.meta(f"{a}.context_length"),
        "rms_norm_eps": f.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu",
    }
    theta = f.meta(f"{a}.rope.freq_base", 10000.0)
    scaling = f.meta(f"{a}.rope.scaling.type")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": theta,
                                  "factor": f.meta(f"{a}.rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise UserError(f"{f.path}: RoPE scaling {scaling!r} cannot be imported from GGUF (looplm reads none, linear)")
    rot = f.meta(f"{a}.rope.dimension_count")
    hd = cfg["head_dim"] or (d // heads if isinstance(d, int) and isinstance(heads, int) and heads else None)
    if rot is not None and rot != hd:
        raise UserError(f"{f.path}: {a}.rope.dimension_count {rot} rotates part of a head of {hd} (partial RoPE "
                        "cannot be imported)")
    if any(f.meta(f"{a}.{k}") for k in ("attention.sliding_window", "expert_count")):
        raise UserError(f"{f.path}: a sliding window or experts cannot be imported from GGUF")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    return check_config(cfg, f.path)


class GGUFWeights:
    """The file's tensors under HF's names (the interface of `hf_import.Weights`): each read, dequantized to
    fp32 and un-permuted when asked for, so the import holds one tensor of the file at a time."""

    prefix = ""

    def __init__(self, f: GGUFFile, cfg: dict[str, Any]):
        self.f, self.cfg = f, cfg
        self.names: dict[str, str] = {}
        for name in f.tensors:
            hf = _hf_name(name)
            if hf is not None:
                self.names[hf] = name
            elif not name.startswith("rope_freqs"):
                raise UserError(f"{f.path}: tensor {name} has no place in a {cfg['model_type']} model "
                                "(an architecture variant looplm does not import)")
        self.permuted = f.meta("general.architecture") in PERMUTED_QK

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def layers(self) -> int:
        ids = {int(n.split(".")[1]) for n in self.names if n.startswith("layers.")}
        return max(ids) + 1 if ids else 0

    def types(self) -> dict[str, int]:
        """Quantization type name -> how many tensors of the file have it."""
        out: dict[str, int] = {}
        for t in self.f.tensors.values():
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return dict(sorted(out.items()))

    def get(self, name: str, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize
        if name not in self.names:
            raise UserError(f"{self.f.path}: holds no tensor for {name} ({_gguf_of(name)}), which the model needs")
        t = self.f.tensors[self.names[name]]
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                data = np.asarray(t.data, dtype=np.float32)
            else:
                data = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(f"{self.f.path}: {t.name} is {t.tensor_type.name}, a type the gguf package cannot "
                            "dequantize") from None
        except Exception as err:
            raise UserError(f"{self.f.path}: {t.name} ({t.tensor_type.name}) cannot be read, the file may be cut "
                            f"short ({type(err).__name__})") from None
        want = tuple(int(n) for n in reversed(t.shape))     # ggml lists dimensions innermost first
        if data.size != int(np.prod(want)):
            raise UserError(f"{self.f.path}: {t.name} holds {data.size} values, its header says {list(want)}")
        out = torch.from_numpy(np.array(data.reshape(want), dtype=np.float32))      # a writable copy
        if shape is not None and tuple(out.shape) != tuple(shape):
            raise UserError(f"{self.f.path}: {t.name} has shape {list(out.shape)}, the file's metadata implies "
                            f"{list(shape)}")
        if self.permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.cfg["num_attention_heads"] if ".q_proj." in name else \
                self.cfg.get("num_key_value_heads", self.cfg["num_attention_heads"])
            out = unpermute_rows(out, heads)
        return out


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. Within each head of width Dh, HF keeps the two RoPE halves apart
    (rows 0..Dh/2-1 pair with Dh/2..Dh-1); llama.cpp interleaves them (row 2i pairs with 2i+1). Its rows
    (heads, Dh/2, 2) read back as (heads, 2, Dh/2) restore HF's order."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_of(hf_name: str) -> str:
    for g, h in TOP_NAMES.items():
        if h == hf_name:
            return g
    parts = hf_name.split(".", 2)
    for g, h in LAYER_NAMES.items():
        if len(parts) == 3 and h == parts[2]:
            return f"blk.{parts[1]}.{g}"
    return hf_name


def read_gguf_tokenizer(f: GGUFFile) -> Any:
    """The file's tokenizer as a `PretrainedTokenizer`: transformers' conversion of the GGUF vocabulary (with
    its special tokens), the file's eos / bos ids and chat template."""
    from ..data.tokenizer import PretrainedTokenizer
    field = f.reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise UserError(f"{f.path}: holds no tokenizer (tokenizer.ggml.tokens); looplm imports a model with its own")
    n_tokens = len(field.data)
    eos = f.meta("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise UserError(f"{f.path}: names no tokenizer.ggml.eos_token_id (looplm separates documents with it)")
    try:
        import transformers
    except ImportError:
        raise UserError(f"{f.path}: reading a GGUF tokenizer needs transformers: pip install 'looplm[gguf]'") from None
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
    except Exception as err:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise UserError(f"{f.path}: transformers cannot build its tokenizer ({detail})") from None
    finally:
        transformers.logging.set_verbosity(level)
    bos = f.meta("tokenizer.ggml.bos_token_id")
    template = f.meta("tokenizer.chat_template")
    return PretrainedTokenizer(_file_ids_only(hf_tok.backend_tokenizer, n_tokens), int(eos),
                               None if bos is None else int(bos), template if isinstance(template, str) else None)


def _file_ids_only(tok: Any, n: int) -> Any:
    """The tokenizer without tokens transformers added beyond the file's n (its GPT-2 class adds
    `<|endoftext|>` to a byte-level vocabulary that lacks one, Llama 3's): ids the model has no row for."""
    import json
    from tokenizers import Tokenizer
    if tok.get_vocab_size(with_added_tokens=True) <= n:
        return tok
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["id"] < n]
    if data.get("post_processor") is not None and any(
            i >= n for sp in (data["post_processor"].get("special_tokens") or {}).values() for i in sp.get("ids", [])):
        data["post_processor"] = None       # looplm encodes without special tokens
    return Tokenizer.from_str(json.dumps(data))


def open_gguf(path: Path) -> Any:
    """`hf_import.Source` for the GGUF file `path`."""
    from .hf_import import Source
    f = GGUFFile(path)
    cfg = read_gguf_config(f)
    weights = GGUFWeights(f, cfg)
    tok = read_gguf_tokenizer(f)
    name = path.stem
    record = {"source": str(path.resolve()), "format": "gguf", "gguf_architecture": f.meta("general.architecture"),
              "gguf_name": f.meta("general.name"), "tensor_types": weights.types()}
    return Source(cfg, str(path), weights, tok, str(path), name, record)
