"""Configuration of LoopLM, a looped (recurrent-depth) language model written out by `looplm export`.

Every field of the looplm recipe's model section that the modeling code reads is here under the same
name (model.rope_scaling as rope_scaling_type: transformers reserves `rope_scaling`), plus the
inference defaults a caller may override per call (`rounds`, `exit_policy`, ...; see
modeling_looplm.py). This file imports only transformers.
"""

from transformers import PretrainedConfig


class LoopLMConfig(PretrainedConfig):
    model_type = "looplm"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads",
                     "num_key_value_heads": "n_kv_heads", "max_position_embeddings": "context"}

    def __init__(
        self,
        vocab_size: int = 257,
        d_model: int = 128,
        n_heads: int = 4,
        n_kv_heads: int = 4,
        head_dim: int = 32,
        ffn_hidden: int = 352,
        context: int = 128,
        n_prelude: int = 1,
        n_core: int = 2,
        n_coda: int = 1,
        init_state: str = "prelude",
        init_state_std: float = 1.0,
        injection: str = "add",
        norm: str = "pre",
        residual_scaling: str = "none",
        deeploop_p: float = 0.5,
        state_norm: bool = False,
        tie_embeddings: bool = True,
        untied: bool = False,
        rope_base: float = 10000.0,
        rope_scaling_type: str = "none",
        rope_factor: float = 8.0,
        rope_low_freq_factor: float = 1.0,
        rope_high_freq_factor: float = 4.0,
        rope_original_context: int = 8192,
        activation: str = "silu",
        qkv_bias: bool = False,
        qk_norm: bool = False,
        attn_scale: float = 0.0,
        embed_scale: float = 1.0,
        norm_eps: float = 1e-5,
        moe_experts: int = 0,
        moe_top_k: int = 2,
        moe_hidden: int = 0,
        mor: str = "none",
        mor_alpha: float = 0.1,
        mor_causal: str = "aux_loss",
        mor_cache: str = "recursion_wise",
        kv_sharing: str = "none",
        nominal_rounds: int = 4,
        exit_gate: bool = False,
        rounds: int = 4,
        exit_policy: str = "fixed",
        exit_min_rounds: int = 1,
        exit_in_prefill: bool = False,
        prefill_cache: str = "full",
        decode_cache: str = "full",
        missing_kv: str = "copy_forward",
        init_state_seed: int = 0,
        use_cache: bool = True,
        **kwargs,
    ):
        # the architecture (the looplm recipe's model section)
        self.vocab_size, self.d_model, self.n_heads, self.n_kv_heads = vocab_size, d_model, n_heads, n_kv_heads
        self.head_dim, self.ffn_hidden, self.context = head_dim, ffn_hidden, context
        self.n_prelude, self.n_core, self.n_coda = n_prelude, n_core, n_coda
        self.init_state, self.init_state_std, self.injection = init_state, init_state_std, injection
        self.norm, self.residual_scaling, self.deeploop_p = norm, residual_scaling, deeploop_p
        self.state_norm, self.tie_embeddings, self.untied = state_norm, tie_embeddings, untied
        # rope_scaling_type: the recipe's model.rope_scaling (transformers reserves `rope_scaling`)
        self.rope_base, self.rope_scaling_type, self.rope_factor = rope_base, rope_scaling_type, rope_factor
        self.rope_low_freq_factor, self.rope_high_freq_factor = rope_low_freq_factor, rope_high_freq_factor
        self.rope_original_context = rope_original_context
        self.activation, self.qkv_bias, self.qk_norm = activation, qkv_bias, qk_norm
        self.attn_scale, self.embed_scale, self.norm_eps = attn_scale, embed_scale, norm_eps
        self.moe_experts, self.moe_top_k, self.moe_hidden = moe_experts, moe_top_k, moe_hidden
        self.mor, self.mor_alpha, self.mor_causal, self.mor_cache = mor, mor_alpha, mor_causal, mor_cache
        self.kv_sharing = kv_sharing
        """first: every core round reads the earlier tokens' round-1 keys/values (decoded under cache policy first)."""
        self.nominal_rounds = nominal_rounds
        """The depth the run was built for: DeepLoop's N, the untied stack's rounds, the router's depths."""
        self.exit_gate = exit_gate
        # inference defaults, each overridable per call (forward / generate keyword of the same name)
        self.rounds = rounds
        self.exit_policy, self.exit_min_rounds, self.exit_in_prefill = exit_policy, exit_min_rounds, exit_in_prefill
        self.prefill_cache, self.decode_cache, self.missing_kv = prefill_cache, decode_cache, missing_kv
        self.init_state_seed, self.use_cache = init_state_seed, use_cache
        kwargs.setdefault("tie_word_embeddings", False)   # the head shares the embedding inside the model
        super().__init__(**kwargs)
