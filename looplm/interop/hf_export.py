"""`looplm export RUN --hf DIR`: a run as a Hugging Face folder that transformers loads with its own
classes and without looplm:

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(DIR)

DIR holds config.json (model_type "looplm", auto_map to the modeling code, every model field the code
reads, the rounds and exit policy as overridable defaults), modeling_looplm.py and
configuration_looplm.py (copied from hf_template/, importing only torch and transformers),
model.safetensors (the run's weights under looplm's own names; a tied head is not stored twice),
generation_config.json (looplm generate's defaults: greedy, 64 new tokens, eos) and the tokenizer
(tokenizer.json + tokenizer_config.json for PreTrainedTokenizerFast; the byte tokenizer as a
byte-level BPE without merges whose ids are the byte values and <|eos|> = 256).

What exports is decided by enumeration over every section of the recipe: `SECTIONS` lists the fields
the export reads with the values the template implements (`MODEL_FIELDS`, `DEPTH_FIELDS`, `EXIT_FIELDS`,
data.tokenizer), `TRAINING_ONLY` the fields that shape training only. A field in neither (one added to
looplm after these tables, or a whole new section) is refused unless it is at its default, so a new
feature is never exported as something it is not.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from ..errors import UserError

TEMPLATE = Path(__file__).with_name("hf_template")
TEMPLATE_FILES = ("configuration_looplm.py", "modeling_looplm.py")
TRANSFORMERS_TESTED = "5.24.0"
"""The transformers release the exported code is tested with (constraints.txt pins it)."""

ANY = None
"""A field whose every value the template implements."""

MODEL_FIELDS: dict[str, tuple | None] = {
    "vocab_size": ANY, "d_model": ANY, "n_heads": ANY, "n_kv_heads": ANY, "head_dim": ANY, "ffn_hidden": ANY,
    "context": ANY, "n_prelude": ANY, "n_core": ANY, "n_coda": ANY,
    "init_state": ("zeros", "prelude", "random"), "init_state_std": ANY,
    "injection": ("none", "add", "concat", "decay"), "norm": ("pre", "sandwich"), "residual_scaling": ("none", "deeploop"),
    "deeploop_p": ANY, "state_norm": ANY, "tie_embeddings": ANY, "untied": ANY,
    "rope_base": ANY, "rope_scaling": ("none", "linear", "llama3"), "rope_factor": ANY,
    "rope_low_freq_factor": ANY, "rope_high_freq_factor": ANY, "rope_original_context": ANY,
    "activation": ("silu", "gelu_tanh"), "qkv_bias": ANY, "qk_norm": ANY, "attn_scale": ANY, "embed_scale": ANY,
    "norm_eps": ANY, "moe_experts": ANY, "moe_top_k": ANY, "moe_hidden": ANY,
    "mor": ("none", "token_choice", "expert_choice"), "mor_alpha": ANY, "mor_causal": ("aux_loss", "aux_router"),
    "mor_cache": ("recursion_wise", "shared_first"), "kv_sharing": ("none", "first"),
}
"""Model fields the exported code reads, and the values it implements (ANY: all)."""

HF_NAMES = {"rope_scaling": "rope_scaling_type"}
"""Model fields stored under another name in config.json (transformers reserves `rope_scaling`)."""

EXIT_FIELDS: dict[str, tuple | None] = {"gate": ANY, "policy": ANY, "min_rounds": ANY, "exit_in_prefill": ANY}
DEPTH_FIELDS: dict[str, tuple | None] = {"kind": ANY, "rounds": ANY, "min": ANY, "max": ANY, "mean": ANY,
                                         "sigma": ANY, "stop_prob": ANY}
"""depth.rounds is the default inference depth; the others are training's depth draws."""
TOKENIZERS = ("byte", "bpe", "pretrained")

SECTIONS: dict[str, dict[str, tuple | None]] = {
    "model": MODEL_FIELDS, "depth": DEPTH_FIELDS, "exit": EXIT_FIELDS, "data": {"tokenizer": TOKENIZERS}}
"""Per recipe section, the fields the export reads and the values the template implements."""

TRAINING_ONLY: dict[str, tuple[str, ...]] = {
    "model": ("init_std", "mor_capacity", "injection_decay_init", "adapter_init"),
    "depth": ("ramp_fraction", "ramp_shape"),
    "backward": ("window",),
    "supervision": ("kind", "rounds", "weights", "entropy_beta", "prior", "geometric_lambda", "moe_balance",
                    "moe_z", "mor_balance", "mor_z", "mor_bias_rate", "mor_aux", "fixed_point", "fixed_point_rounds"),
    "data": ("path", "text_field", "task", "max_bytes", "val_fraction", "seq_len", "difficulty_min",
             "difficulty_max", "task_length", "train_length_min", "length_unit", "item_separator", "warmup_steps",
             "curriculum", "length_curriculum", "crop_curriculum",
             "separator", "depth_by_difficulty", "round_targets", "eval_difficulty_max", "eval_rounds_max",
             "eval_examples", "probe_examples", "baselines"),
    "optim": ("lr", "min_lr_ratio", "schedule", "warmup_steps", "decay_fraction", "weight_decay", "beta1", "beta2",
              "eps", "grad_clip"),
    "train": ("steps", "batch_size", "grad_accum", "seed", "dtype", "device", "compile", "parallel",
              "activation_checkpointing", "alignment_every", "mor_warmup_steps", "tensorboard", "lockstep_check",
              "log_every", "checkpoint_every", "eval_batches", "threads", "stage", "stage2_k", "stage2_gamma",
              "freeze_outer_steps"),
}
"""Fields that shape training only: the initialisation and expert choice's training top-k capacities (at
inference a token continues by the router's causal decision, as looplm decodes), and the loss placement,
data, optimiser and trainer settings. Listed by name: a field added to any section later, or a section
added later, is refused unless it is at its default."""

EXIT_KINDS = ("fixed", "quantile", "entropy", "kl")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _is_default(config: Any, f: dataclasses.Field) -> bool:
    """Whether `config`'s field f holds its default, as the config resolves it beside its other fields
    (a default like 0 = "derive it" may resolve to a value)."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    value = getattr(config, f.name)
    if value == default:
        return True
    try:
        return getattr(dataclasses.replace(config, **{f.name: default}), f.name) == value
    except Exception:           # the default does not fit beside the other fields: it is not the default
        return False


def refusals(recipe: Any) -> list[str]:
    """Every reason `recipe` cannot be exported, one line each (empty: it exports)."""
    out = []
    for section in (f.name for f in dataclasses.fields(recipe) if f.name != "name"):
        config = getattr(recipe, section)
        table, ignored = SECTIONS.get(section, {}), TRAINING_ONLY.get(section, ())
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if f.name in ignored:
                continue
            if f.name not in table:
                if not _is_default(config, f):
                    out.append(f"{section}.{f.name} = {_toml(value)} cannot be exported: the exported modeling "
                               f"code does not implement {section}.{f.name} (only its default)")
            elif table[f.name] is not ANY and value not in table[f.name]:
                out.append(f"{section}.{f.name} = {_toml(value)} cannot be exported: the exported modeling code "
                           f"implements {', '.join(_toml(v) for v in table[f.name])}")
    kind = recipe.exit.policy.strip().partition(":")[0].strip().lower()
    if kind not in EXIT_KINDS:
        out.append(f"exit.policy = {_toml(recipe.exit.policy)} cannot be exported: the exported modeling code "
                   f"implements the exit policies {', '.join(EXIT_KINDS)}")
    return out


def check_exportable(recipe: Any) -> None:
    """UserError naming the first field the exported code does not implement."""
    found = refusals(recipe)
    if found:
        raise UserError(found[0])


def hf_config(recipe: Any, tokenizer: Any) -> dict[str, Any]:
    """config.json: the model fields the template reads, the inference defaults, the special tokens."""
    from ..halting import parse_exit_policy
    m, ex = recipe.model, recipe.exit
    config: dict[str, Any] = {
        "architectures": ["LoopLMForCausalLM"],
        "model_type": "looplm",
        "auto_map": {"AutoConfig": "configuration_looplm.LoopLMConfig",
                     "AutoModelForCausalLM": "modeling_looplm.LoopLMForCausalLM"},
    }
    config.update({HF_NAMES.get(name, name): list(v) if isinstance(v := getattr(m, name), tuple) else v
                   for name in MODEL_FIELDS})
    rounds, policy = recipe.depth.rounds, ex.policy.strip()
    parsed = parse_exit_policy(policy) if policy != "fixed" else None
    if parsed is not None and parsed.kind == "fixed":      # fixed:R is the default depth R ("fixed" then follows rounds)
        rounds, policy = int(parsed.value), "fixed"
    elif parsed is not None:
        policy = str(parsed)
    caches = {"prefill_cache": "full", "decode_cache": "full", "missing_kv": "copy_forward"}
    if m.mor != "none":        # the router decides depths; the cache follows the trained rule (as looplm decodes)
        rounds, policy = recipe.depth.rounds, "fixed"
        caches = ({"prefill_cache": "full", "decode_cache": "full", "missing_kv": "mask"}
                  if m.mor_cache == "recursion_wise" else {**caches, "prefill_cache": "first", "decode_cache": "first"})
    elif m.kv_sharing == "first":   # every round reads round 1's keys/values: cache policy first on both sides
        caches = {**caches, "prefill_cache": "first", "decode_cache": "first"}
    bos = getattr(tokenizer, "bos_id", None)
    config.update({
        "nominal_rounds": recipe.depth.rounds, "exit_gate": ex.gate, "rounds": rounds, "exit_policy": policy,
        "exit_min_rounds": ex.min_rounds, "exit_in_prefill": ex.exit_in_prefill, **caches, "init_state_seed": 0,
        "bos_token_id": bos, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.eos_id,
        "tie_word_embeddings": False, "use_cache": True, "dtype": "float32",
    })
    return config


def generation_config(tokenizer: Any) -> dict[str, Any]:
    """`looplm generate`'s defaults: greedy, 64 new tokens, stop at eos; sampling without top-k or top-p."""
    return {"bos_token_id": getattr(tokenizer, "bos_id", None), "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.eos_id, "do_sample": False, "max_new_tokens": 64, "temperature": 1.0,
            "top_k": 0, "top_p": 1.0}


def byte_tokenizer_json() -> Any:
    """looplm's byte tokenizer as a `tokenizers` model: byte-level BPE with no merges, so every byte is
    one token whose id is the byte's value (GPT-2's printable symbol for byte b has id b), and the
    end-of-document token <|eos|> = 256, special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from ..data.tokenizer import _BYTE_OF_SYMBOL, EOS_TOKEN
    vocab = {symbol: b for symbol, b in _BYTE_OF_SYMBOL.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    if tok.token_to_id(EOS_TOKEN) != 256 or tok.get_vocab_size(with_added_tokens=True) != 257:
        raise RuntimeError("byte tokenizer: <|eos|> did not land on id 256")
    return tok


def write_tokenizer(tokenizer: Any, run_checkpoint: Path, out: Path, context: int) -> None:
    """tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast) equal to the run's tokenizer:
    the same ids for the same text, special tokens in text read as plain text (looplm's encode), no
    special tokens added, no clean-up on decode, left padding with <|eos|> (pads are masked)."""
    from ..data.tokenizer import BPE_FILE, EOS_TOKEN, ByteTokenizer, BPETokenizer, read_tokenizer_file
    if isinstance(tokenizer, ByteTokenizer):
        tok, split = byte_tokenizer_json(), True
    else:
        tok = read_tokenizer_file(run_checkpoint / BPE_FILE)
        split = isinstance(tokenizer, BPETokenizer)       # a pretrained model's own reads its special tokens
    tok.save(str(out / "tokenizer.json"))
    eos = tok.id_to_token(tokenizer.eos_id) or EOS_TOKEN
    bos_id = getattr(tokenizer, "bos_id", None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
              "bos_token": tok.id_to_token(bos_id) if bos_id is not None else None, "unk_token": None,
              "clean_up_tokenization_spaces": False, "split_special_tokens": split, "padding_side": "left",
              "model_max_length": context}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _model_card(recipe: Any, run_dir: Path) -> str:
    m = recipe.model
    kind = ("Mixture-of-Recursions (" + m.mor + ")" if m.mor != "none" else
            "LoopMoE" if m.moe_experts else "gated (exit policy " + recipe.exit.policy + ")" if recipe.exit.gate
            else "dense")
    return (f"# {recipe.name} (looplm export)\n\nA looped language model ({kind}): prelude {m.n_prelude} block(s), "
            f"a shared core of {m.n_core} block(s) run {recipe.depth.rounds} rounds, coda {m.n_coda}; "
            f"d_model {m.d_model}, context {m.context}. Exported from the looplm run `{run_dir.name}`.\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)\n"
            "tokenizer = AutoTokenizer.from_pretrained(DIR)\n"
            "ids = tokenizer([\"Hello\"], return_tensors=\"pt\")\n"
            "out = model.generate(**ids, max_new_tokens=32, rounds=8)   # rounds, exit_policy, ...: per call\n```\n\n"
            f"Tested with transformers {TRANSFORMERS_TESTED}. See looplm's docs/export.md.\n")


def export_hf(run_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write RUN as a Hugging Face folder at out_dir (see the module docstring); UserError (one line)
    when the run has a field the exported code does not implement, or out_dir holds something else.
    The folder is built in OUT.partial and moved into place when complete (outdir.Staging): into an
    earlier export, file by file, so files a user keeps beside it (a hub clone's .git) stay; a failed
    export leaves nothing."""
    from safetensors.torch import save_file
    from ..outdir import MARKER, Staging, refuse_foreign
    from ..runs.checkpoint import load_run

    run_dir, out = Path(run_dir), Path(out_dir)
    run = load_run(run_dir, device="cpu")
    check_exportable(run.recipe)
    earlier = refuse_foreign(out, "--hf", _is_export, "an earlier looplm export")
    config = hf_config(run.recipe, run.tokenizer)
    config["looplm_recipe"] = run.recipe.to_dict()
    state = run.model.state_dict()
    if run.recipe.model.tie_embeddings:
        state.pop("head.weight")            # the exported head reads the embedding
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    with Staging(out, "--hf") as stage:
        tmp = stage.dir
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(run.tokenizer), indent=2) + "\n")
        for name in TEMPLATE_FILES:
            shutil.copyfile(TEMPLATE / name, tmp / name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer(run.tokenizer, run_dir / "checkpoint", tmp, run.recipe.model.context)
        (tmp / "README.md").write_text(_model_card(run.recipe, run_dir))
        files = sorted(p.name for p in tmp.iterdir() if p.name != MARKER)
        if earlier:
            stage.merge()
        else:
            stage.commit()
    return {"out": str(out), "files": files, "parameters": sum(
        t.numel() for t in tensors.values()), "rounds": config["rounds"], "exit_policy": config["exit_policy"],
        "transformers_tested": TRANSFORMERS_TESTED}


def _is_export(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "looplm"
    except (OSError, ValueError, AttributeError):
        return False
