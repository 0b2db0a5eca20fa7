"""`looplm import HF_DIR --out RUN`: a pretrained Hugging Face causal LM becomes a looplm run (a GGUF file too:
gguf_import.py reads it into the same `Source`, so both formats share the families, layout and refusals here).

    layers 0 .. N-1          -> prelude (untied, run once)
    layers I .. J-1          -> the shared core, run R rounds (one copy of each layer, or with
                                --core-blocks K the mean of the span's groups of K layers)
    layers L-M .. L-1        -> coda
    layers in between        -> dropped (listed in RUN/import.json)

Supported families: Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text). Their details map onto
looplm's block options (model/blocks.py) exactly, or the import is refused naming the feature:
grouped-query attention and a head width of its own, q/k/v biases (Qwen2), QK-norm (Qwen3,
Gemma 3), tied or untied embeddings, Gemma's sandwich norms, embedding scale, softmax scale,
GeGLU and its (1 + w) norm weights (folded into w here), RoPE base and linear / Llama 3 scaling.
A sliding window is exact only where it never bites, so the run's context is capped at it.

The loop starts from the prelude's output and re-enters nothing (init_state = prelude, injection
= none): round 1 is then exactly the pretrained stack, so with every layer kept and R = 1 the
run's logits are the HF model's, and R > 1 repeats the core on its own output (training-free
looping). The weights are read tensor by tensor (safetensors, never pickles) and kept in fp32.

Every file of HF_DIR is checked where it is read, each refusal one line naming the file: config.json
(`read_config`: JSON, the family, its sizes), the weights (`Weights`: each file's header, every tensor
present at the shape config.json implies), tokenizer.json and generation_config.json. --out must be
absent or an empty folder: an import is a new run, and no run or other file is ever overwritten (an
earlier import included: import into another folder). The run is built in OUT.partial and moved into
place whole (outdir.Staging), so a refused or failed import leaves nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3"}
DEFAULT_CONTEXT = 2048
"""The run's context when neither --context nor a smaller model limit says otherwise (RoPE tables and
cache lengths grow with it; the pretrained model may accept far more)."""


@dataclass(frozen=True)
class Layout:
    """Which pretrained layers become which part of the loop (layer indices 0-based, spans half-open)."""

    prelude: int
    core: tuple[int, int]
    coda: int
    rounds: int = 1
    core_blocks: int = 0
    """Blocks in the shared core; 0 = the span's width (one copy of each layer). A smaller K averages
    the span's consecutive groups of K layers block by block."""

    def check(self, layers: int) -> None:
        i, j = self.core
        if not 0 <= self.prelude <= i < j <= layers - self.coda <= layers or self.coda < 0:
            raise UserError(f"layout: --prelude {self.prelude} --core {i}:{j} --coda {self.coda} must satisfy "
                            f"0 <= prelude <= I < J <= {layers} - coda (the model has {layers} layers)")
        if self.rounds < 1:
            raise UserError(f"--rounds must be >= 1, got {self.rounds}")
        k = self.core_blocks or j - i
        if k < 1 or (j - i) % k:
            raise UserError(f"--core-blocks {k}: must divide the core span's {j - i} layers")

    def dropped(self, layers: int) -> list[int]:
        i, j = self.core
        return [*range(self.prelude, i), *range(j, layers - self.coda)]


def parse_layout(layers: int, prelude: int | None, core: str | None, coda: int | None, rounds: int,
                 core_blocks: int = 0) -> Layout:
    """The CLI's --prelude/--core/--coda (defaults: every layer in the core, nothing dropped)."""
    n, m = prelude or 0, coda or 0
    if core is None:
        span = (n, layers - m)
    else:
        try:
            a, b = (int(x) for x in core.split(":"))
        except ValueError:
            raise UserError(f"--core {core!r}: expected I:J, the half-open span of layers that loops") from None
        span = (a, b)
    layout = Layout(prelude=n, core=span, coda=m, rounds=rounds, core_blocks=core_blocks)
    layout.check(layers)
    return layout


# ----------------------------------------------------------------------------- config

REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
"""config.json keys every supported family has: positive integers."""
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar")
"""config.json keys read when present (null = absent): positive integers, and numbers."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_config(hf_dir: Path) -> dict[str, Any]:
    """HF_DIR/config.json, checked (`check_config`); the one reader of an HF import's config."""
    from ..files import read_json_object
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{hf_dir}: no config.json (expected a Hugging Face model folder)")
    return check_config(read_json_object(path, "a Hugging Face model config"), path)


def check_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """`cfg` (config.json's keys, or a GGUF file's metadata in those keys) as a supported family whose sizes
    are positive integers; UserError naming `path` and the key otherwise."""
    kind = cfg.get("model_type")
    if kind == "gemma3" and "text_config" in cfg:
        raise UserError(f"{path}: a Gemma 3 vision-language checkpoint; import its text model "
                        "(Gemma3ForCausalLM, model_type gemma3_text)")
    if kind not in FAMILIES:
        raise UserError(f"{path}: model_type {kind!r} cannot be imported (supported: {', '.join(FAMILIES)})")
    missing = [k for k in REQUIRED_INTS if k not in cfg]
    if missing:
        raise UserError(f"{path}: incomplete, no {', '.join(missing)} (a {FAMILIES[kind]} config names "
                        f"{', '.join(REQUIRED_INTS)})")
    for key in (*REQUIRED_INTS, *OPTIONAL_INTS):
        value = cfg.get(key)
        if (key in REQUIRED_INTS or value is not None) and not (_is_int(value) and value > 0):
            raise UserError(f"{path}: {key} = {json.dumps(value)}, expected a positive integer")
    for key in OPTIONAL_NUMBERS:
        value = cfg.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise UserError(f"{path}: {key} = {json.dumps(value)}, expected a positive number")
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise UserError(f"{path}: {key} = {json.dumps(cfg[key])}, expected an object")
    return cfg


def _rope(params: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE settings -> ModelConfig fields; unknown scalings refused by name, a scaling missing one of its
    numbers refused naming it."""
    def number(key: str, default: float | None = None) -> float:
        value = params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UserError(f"{where}: RoPE {kind!r} needs a positive number {key}, got {json.dumps(value)}")
        return float(value)

    if not isinstance(params, dict):
        raise UserError(f"{where}: RoPE parameters {json.dumps(params)}, expected an object")
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_base": number("rope_theta", 10000.0)}
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": number("factor")}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_factor": number("factor"),
                "rope_low_freq_factor": number("low_freq_factor"),
                "rope_high_freq_factor": number("high_freq_factor"),
                "rope_original_context": int(number("original_max_position_embeddings"))}
    raise UserError(f"{where}: RoPE scaling {kind!r} cannot be imported (looplm implements default, linear, llama3)")


def _rope_params(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters as transformers 5 writes them (rope_parameters, per layer type for Gemma 3),
    or as older files do (rope_theta + rope_scaling, rope_local_base_freq)."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and layer_type and layer_type in rp:
        return rp[layer_type]
    if isinstance(rp, dict) and "rope_theta" in rp:
        return rp
    params = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
    if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        params = {"rope_theta": cfg["rope_local_base_freq"]}
    return params


def model_fields(cfg: dict[str, Any], context: int | None, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ModelConfig fields except the layout's, notes) for a supported config.json."""
    kind = cfg["model_type"]
    d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    gemma = kind == "gemma3_text"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UserError(f"{where}: {key} = {cfg[key]} cannot be imported (looplm's attention and head have no "
                            "soft cap)")
    if cfg.get("use_bidirectional_attention"):
        raise UserError(f"{where}: use_bidirectional_attention cannot be imported (looplm is causal)")
    act = cfg.get("hidden_activation" if gemma else "hidden_act", cfg.get("hidden_act", "silu"))
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise UserError(f"{where}: activation {act!r} cannot be imported (looplm: silu, gelu_pytorch_tanh)")
    if cfg.get("mlp_bias"):
        raise UserError(f"{where}: mlp_bias cannot be imported (looplm's FFN has no biases)")

    # RoPE, and which layers attend through a sliding window
    layer_types = cfg.get("layer_types") or []
    rope = _rope(_rope_params(cfg, "full_attention" if gemma else None), where)
    window = None
    if kind == "mistral" and cfg.get("sliding_window"):
        window = int(cfg["sliding_window"])
    elif kind in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        window = int(cfg["sliding_window"])
    local_layers: list[int] = []
    local_base = 0.0
    if kind not in ("mistral", "qwen2", "qwen3") and "sliding_attention" in layer_types:
        window = int(cfg["sliding_window"])
        local = _rope(_rope_params(cfg, "sliding_attention"), where)
        if local != rope:          # Gemma 3: the local layers rotate with their own base (model.local_rope_base)
            if set(local) != {"rope_base"}:
                raise UserError(f"{where}: the sliding-window layers' RoPE {local} is scaled; looplm's local blocks "
                                "take a plain base (model.local_rope_base)")
            local_base = local["rope_base"]
            local_layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    limit = min(int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT)), window or math.inf)
    if context is None:
        context = int(min(limit, DEFAULT_CONTEXT))
    elif context > limit:
        why = f"the sliding window of {window}" if window is not None and window <= context else "max_position_embeddings"
        raise UserError(f"--context {context}: above {why} ({int(limit)}); beyond it the imported model would not "
                        "compute what the pretrained one does")

    fields: dict[str, Any] = {
        "vocab_size": int(cfg["vocab_size"]), "d_model": d, "n_heads": heads,
        "n_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or d // heads), "ffn_hidden": int(cfg["intermediate_size"]),
        "context": context, "init_state": "prelude", "injection": "none",
        "norm": "sandwich" if gemma else "pre", "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "activation": acts[act], **rope,
    }
    if gemma:
        fields["embed_scale"] = math.sqrt(d)
        fields["attn_scale"] = float(cfg.get("query_pre_attn_scalar", fields["head_dim"])) ** -0.5
    notes = {"family": FAMILIES[kind], "sliding_window": window, "local_rope_base": local_base,
             "local_layers": local_layers}
    return fields, notes


# ----------------------------------------------------------------------------- weights

class Weights:
    """The checkpoint's tensors by name, read one at a time from its safetensors file(s), every file's
    header checked first (files.safetensors_names) and every tensor checked against the shape the
    config implies (`get`)."""

    def __init__(self, hf_dir: Path):
        from ..files import safetensors_names
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"{hf_dir}: no *.safetensors weights (looplm never unpickles .bin checkpoints; "
                            "convert them with transformers' save_pretrained)")
        self.hf_dir = hf_dir
        self.where: dict[str, Path] = {}
        for f in files:
            self.where.update({k: f for k in safetensors_names(f)[0]})
        emb = [k for k in self.where if k.endswith("embed_tokens.weight")]
        if len(emb) != 1:
            raise UserError(f"{hf_dir}: expected one embed_tokens.weight in its *.safetensors, found {len(emb)}")
        self.prefix = emb[0][: -len("embed_tokens.weight")]        # "model." for *ForCausalLM

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.where or name in self.where

    def get(self, name: str, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
        """Tensor `name` (the prefix optional) in fp32; UserError naming the weights when it is absent or,
        given the shape config.json implies, has another."""
        from ..files import read_safetensors_tensor
        key = self.prefix + name if self.prefix + name in self.where else name
        if key not in self.where:
            files = sorted({p.name for p in self.where.values()})
            raise UserError(f"{self.hf_dir}: the weights ({', '.join(files)}) hold no tensor {self.prefix + name}, "
                            "which config.json's model needs")
        t = read_safetensors_tensor(self.where[key], key)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise UserError(f"{self.where[key]}: {key} has shape {list(t.shape)}, config.json implies "
                            f"{list(shape)} (hidden_size, intermediate_size, heads or vocab_size disagree with "
                            "the weights)")
        return t.float()

    def layers(self) -> int:
        ids = set()
        for k in self.where:
            if k.startswith(self.prefix + "layers."):
                head = k[len(self.prefix) + len("layers."):].split(".")[0]
                if head.isdigit():
                    ids.add(int(head))
        return max(ids) + 1 if ids else 0


def _block_names(gemma: bool) -> dict[str, str]:
    """looplm block parameter -> the pretrained layer's (norms: Gemma's four around two branches map onto
    looplm's sandwich: norm1/post1 around attention, norm2/post2 around the FFN)."""
    names = {"attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
             "attn.v.weight": "self_attn.v_proj.weight", "attn.o.weight": "self_attn.o_proj.weight",
             "attn.q.bias": "self_attn.q_proj.bias", "attn.k.bias": "self_attn.k_proj.bias",
             "attn.v.bias": "self_attn.v_proj.bias",
             "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.down.weight": "mlp.down_proj.weight", "norm1.weight": "input_layernorm.weight"}
    if gemma:
        names.update({"post1.weight": "post_attention_layernorm.weight",
                      "norm2.weight": "pre_feedforward_layernorm.weight",
                      "post2.weight": "post_feedforward_layernorm.weight"})
    else:
        names["norm2.weight"] = "post_attention_layernorm.weight"
    return names


def _layer_state(w: Weights, layer: int, gemma: bool, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Pretrained layer `layer` under looplm's block names: the names in `shapes` (a block's parameters ->
    their shapes), each read at its shape."""
    out = {}
    for ours, theirs in _block_names(gemma).items():
        if ours not in shapes:
            continue
        t = w.get(f"layers.{layer}.{theirs}", shapes[ours])
        if gemma and ("norm" in ours or ours.startswith("post")):
            t = t + 1.0                     # Gemma's RMSNorm scales by (1 + w)
        out[ours] = t
    return out


@dataclass
class Source:
    """A pretrained model as the import reads it, whatever its file format: the config in config.json's keys,
    tensors under HF's names (`Weights` or `gguf_import.GGUFWeights`: `get`, `in`, `layers`), its tokenizer."""

    cfg: dict[str, Any]
    config_where: str            # what a message about the config names: DIR/config.json, or FILE.gguf
    weights: Any
    tokenizer: Any               # data.tokenizer.PretrainedTokenizer
    tokenizer_where: str         # DIR/tokenizer.json, or FILE.gguf
    name: str
    record: dict[str, Any]       # what import.json adds for this format


def open_hf(hf_dir: Path) -> Source:
    """A Hugging Face model folder: config.json, *.safetensors, tokenizer.json (+ generation_config.json,
    tokenizer_config.json's chat template)."""
    from ..data.tokenizer import PretrainedTokenizer, read_tokenizer_file
    cfg = read_config(hf_dir)
    tok_file = hf_dir / "tokenizer.json"
    w = Weights(hf_dir)
    if not tok_file.is_file():
        raise UserError(f"{hf_dir}: no tokenizer.json (looplm reads fast tokenizers; save one with "
                        "AutoTokenizer.from_pretrained(...).save_pretrained)")
    eos, bos = _special_ids(hf_dir, cfg)
    tok = PretrainedTokenizer(read_tokenizer_file(tok_file), eos, bos, _chat_template(hf_dir))
    return Source(cfg, str(hf_dir / "config.json"), w, tok, str(tok_file), hf_dir.resolve().name,
                  {"source": str(hf_dir.resolve()), "format": "hf"})


def open_source(path: Path) -> Source:
    """An HF folder, a .gguf file, or a folder holding no config.json and one .gguf file."""
    from .gguf_import import open_gguf
    if path.is_file() and path.suffix.lower() == ".gguf":
        return open_gguf(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such folder or .gguf file (expected a Hugging Face model folder or a GGUF file)")
    if not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return open_gguf(found[0])
        if len(found) > 1:
            raise UserError(f"{path}: holds {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}); "
                            "name the one to import")
    return open_hf(path)


def import_hf(hf_dir: str | Path, out: str | Path, *, prelude: int | None = None, core: str | None = None,
              coda: int | None = None, rounds: int = 1, core_blocks: int = 0, context: int | None = None) -> Path:
    """Write the run folder `out` from the pretrained model at `hf_dir`: a Hugging Face folder or a GGUF file
    (see the module docstring)."""
    from ..model.looped import build_model
    from ..outdir import Staging, refuse_foreign
    from ..recipe.config import recipe_from_dict
    from ..runs.checkpoint import save_checkpoint, write_text

    hf_dir, out = Path(hf_dir), Path(out)
    if (out / "checkpoint" / "state.pt").exists():
        raise UserError(f"--out {out} already holds a run; choose another folder")
    refuse_foreign(out, "--out")      # a new run folder: absent or empty (see the module docstring)
    src = open_source(hf_dir)
    cfg, w = src.cfg, src.weights
    where = f"{hf_dir} ({cfg['model_type']})"
    fields, notes = model_fields(cfg, context, f"{src.config_where} ({cfg['model_type']})")
    layers = w.layers()
    if layers != int(cfg["num_hidden_layers"]):
        raise UserError(f"{where}: weights hold {layers} layers, the config says {cfg['num_hidden_layers']}")
    layout = parse_layout(layers, prelude, core, coda, rounds, core_blocks)
    for part in ("o_proj.bias", "gate_proj.bias", "up_proj.bias", "down_proj.bias"):
        if f"layers.0.{'self_attn' if part == 'o_proj.bias' else 'mlp'}.{part}" in w:
            raise UserError(f"{where}: {part} cannot be imported (looplm's blocks have no bias there)")
    gemma = cfg["model_type"] == "gemma3_text"
    untied = "lm_head.weight" in w and not cfg.get("tie_word_embeddings", gemma)
    i, j = layout.core
    k = layout.core_blocks or j - i
    fields.update(n_prelude=layout.prelude, n_core=k, n_coda=layout.coda, tie_embeddings=not untied,
                  qkv_bias="layers.0.self_attn.q_proj.bias" in w, qk_norm="layers.0.self_attn.q_norm.weight" in w)
    if notes["local_layers"]:      # which blocks come from local layers (an averaged core block: all or none)
        local = set(notes["local_layers"])
        sources = [[b] for b in range(layout.prelude)] + \
                  [[i + g * k + b for g in range((j - i) // k)] for b in range(k)] + \
                  [[layers - layout.coda + b] for b in range(layout.coda)]
        mixed = [src for src in sources if 0 < len(local & set(src)) < len(src)]
        if mixed:
            raise UserError(f"--core-blocks {k}: a shared block would average local (sliding-window) and global "
                            f"layers {mixed[0]}, which rotate differently")
        blocks = tuple(pos for pos, src in enumerate(sources) if src[0] in local)
        if blocks:
            fields.update(local_rope_base=notes["local_rope_base"], local_blocks=blocks)
    tok = src.tokenizer
    eos, bos, ids = tok.eos_id, tok.bos_id, tok.vocab_size
    if ids > fields["vocab_size"] or not all(t is None or 0 <= t < fields["vocab_size"] for t in (eos, bos)):
        raise UserError(f"{src.tokenizer_where}: the tokenizer's {ids} token ids (eos {eos}, bos {bos}) do not fit the config's "
                        f"vocab_size {fields['vocab_size']}; the tokenizer is not this model's")
    seq_len = min(fields["context"], 256)
    try:
        recipe = recipe_from_dict({
            "name": f"import-{src.name}", "model": fields,
            "depth": {"kind": "fixed", "rounds": layout.rounds},
            "data": {"tokenizer": "pretrained", "seq_len": seq_len},
        })
    except UserError as err:      # a size the config sets that looplm's model refuses: name the file too
        raise UserError(f"{src.config_where}: {err}") from None
    model = build_model(recipe)
    state = model.state_dict()
    shapes = {n.split(".", 2)[2]: t.shape for n, t in state.items() if n.startswith("core.0.")}
    filled: set[str] = set()

    def put(name: str, t: torch.Tensor) -> None:
        """Copy one pretrained tensor into the model as it is read: the import holds the model and one
        tensor, not a second copy of the weights."""
        state[name].copy_(t)
        filled.add(name)

    with torch.no_grad():
        put("embed.weight", w.get("embed_tokens.weight", state["embed.weight"].shape))
        put("final_norm.weight", w.get("norm.weight", state["final_norm.weight"].shape) + (1.0 if gemma else 0.0))
        if untied:
            put("head.weight", w.get("lm_head.weight", state["head.weight"].shape))
        else:                               # tied: the head is the embedding's own tensor
            filled.add("head.weight")
        for b in range(layout.prelude):
            for n, t in _layer_state(w, b, gemma, shapes).items():
                put(f"prelude.{b}.{n}", t)
        for b in range(k):                  # core block b: the mean of layers i + g*k + b over the span's groups
            group = [_layer_state(w, i + g * k + b, gemma, shapes) for g in range((j - i) // k)]
            for n in group[0]:
                put(f"core.{b}.{n}", torch.stack([s[n] for s in group]).mean(0))
        for b in range(layout.coda):
            for n, t in _layer_state(w, layers - layout.coda + b, gemma, shapes).items():
                put(f"coda.{b}.{n}", t)
    missing = sorted(set(state) - filled)
    if missing:
        raise UserError(f"{where}: no pretrained weights for {missing[:4]}")

    record = {**src.record, "family": notes["family"], "model_type": cfg["model_type"],
              "layers": layers, "prelude": list(range(layout.prelude)), "core": list(range(i, j)),
              "core_blocks": k, "coda": list(range(layers - layout.coda, layers)),
              "dropped": layout.dropped(layers), "rounds": layout.rounds, "context": fields["context"],
              "sliding_window": notes["sliding_window"], "tied_embeddings": not untied,
              "local_layers": notes["local_layers"], "local_rope_base": notes["local_rope_base"] or None}
    with Staging(out, "--out") as stage:        # the run folder appears whole, or not at all
        write_text(stage.dir / "recipe.toml", recipe.to_toml())
        tok.save(stage.dir / "checkpoint")
        save_checkpoint(stage.dir, model, {"step": 0, "imported": record})
        write_text(stage.dir / "import.json", json.dumps(record, indent=2) + "\n")
        stage.commit()
    return out


def _special_ids(hf_dir: Path, cfg: dict[str, Any]) -> tuple[int, int | None]:
    """(eos id, bos id) from config.json, else generation_config.json (a list: its first)."""
    from ..files import read_json_object
    gen = hf_dir / "generation_config.json"
    sources = [(hf_dir / "config.json", cfg)]
    if gen.is_file():
        sources.append((gen, read_json_object(gen, "a Hugging Face generation config")))

    def first(key: str) -> int | None:
        for path, s in sources:
            v = s.get(key)
            if isinstance(v, list):
                v = v[0] if v else None
            if v is not None:
                if not _is_int(v) or v < 0:
                    raise UserError(f"{path}: {key} = {json.dumps(s.get(key))}, expected a token id (an integer >= 0)")
                return v
        return None
    eos = first("eos_token_id")
    if eos is None:
        raise UserError(f"{hf_dir}: config.json names no eos_token_id (looplm separates documents with it)")
    return eos, first("bos_token_id")


def _chat_template(hf_dir: Path) -> str | None:
    """The chat template of an HF folder: chat_template.jinja (transformers 5 writes it there), else
    tokenizer_config.json's chat_template (a string; a list of named templates: the "default" one)."""
    from ..files import read_json_object
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{jinja}: cannot read it as UTF-8 text ({type(err).__name__})") from None
    cfg_file = hf_dir / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    template = read_json_object(cfg_file, "a tokenizer config").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{cfg_file}: chat_template must be a string (a Jinja template)")
    return template
