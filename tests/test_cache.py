"""The per-round KV cache: cached decoding equals the full forward pass, policies, holes.

Parity is checked against `model(idx, rounds)` (no cache, the whole sequence at once) at every
round count, for the model variants whose block code differs (pre-norm, sandwich, DeepLoop,
grouped-query heads, concat injection with state norm, the untied baseline).
"""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.inference.cache import LoopKVCache
from looplm.errors import UserError
from looplm.inference.engine import Engine, GenerationConfig

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 48,
        "model.init_state": "prelude", "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}


def tiny(**overrides):
    torch.manual_seed(0)
    recipe = looplm.load_recipe("quickstart", overrides={**TINY, **overrides})
    return looplm.build_model(recipe).eval()


def cached_logits(model, idx, rounds, prefix, **config):
    """Prefill idx[:, :prefix] as one chunk, then decode the rest column by column: (B, T, V)."""
    eng = Engine(model, None, GenerationConfig(rounds=rounds, **config))
    cache = eng.new_cache(idx.shape[0], idx.shape[1])
    with torch.inference_mode():
        first, _ = eng.run_chunk(idx[:, :prefix], 0, cache, phase="prefill", all_logits=True)
        rest = [eng.run_chunk(idx[:, t:t + 1], t, cache)[0] for t in range(prefix, idx.shape[1])]
    return torch.cat([first, torch.stack(rest, 1)], 1)


VARIANTS = {
    "pre-norm, concat injection, state norm": {},
    "add injection, zeros init": {"model.injection": "add", "model.init_state": "zeros", "model.state_norm": False},
    "sandwich norm": {"model.norm": "sandwich"},
    "deeploop": {"model.residual_scaling": "deeploop"},
    "multi-head (no GQA), 2 prelude, 2 coda": {"model.n_kv_heads": 4, "model.n_prelude": 2, "model.n_coda": 2},
}


@pytest.mark.parametrize("packed_from", [None, 0])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_cache_equals_full_forward_at_every_round_count(variant, packed_from, monkeypatch):
    """packed_from=0: every several-row product (the prompt, the two rows) goes through oneDNN's
    packed weights, which these small matrices otherwise skip (kernels.PACKED_MIN_MACS)."""
    import looplm.inference.kernels as kernels
    if packed_from is not None:
        if kernels.packed_weight(torch.randn(4, 4)) is None:
            pytest.skip("oneDNN packed weights are unavailable here")
        monkeypatch.setattr(kernels, "PACKED_MIN_MACS", packed_from)
    model = tiny(**VARIANTS[variant])
    idx = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))
    for rounds in (1, 2, 3, 4, 6):
        ref = model(idx, rounds).logits
        got = cached_logits(model, idx, rounds, prefix=7)
        assert (got - ref).abs().max().item() < 1e-5, (variant, rounds)


def test_untied_baseline_cached_equals_forward():
    model = tiny(**{"model.untied": True})
    idx = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = model(idx).logits
    assert (cached_logits(model, idx, 3, prefix=5) - ref).abs().max().item() < 1e-5
    with pytest.raises(UserError, match="untied"):
        Engine(model, None, GenerationConfig(rounds=4))


def test_prefill_then_decode_equals_token_by_token_with_random_initial_state():
    """Random loop states come from a per-position table, so chunking does not change them."""
    model = tiny(**{"model.init_state": "random"})
    eng = Engine(model, None, GenerationConfig())
    idx = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(3))
    from looplm.inference.engine import SamplingParams
    noise = eng.initial_noise([SamplingParams(seed=5)] * 2, next(model.parameters()))
    with torch.inference_mode():
        c1 = eng.new_cache(2, 20)
        whole, _ = eng.run_chunk(idx, 0, c1, phase="prefill", noise=noise, all_logits=True)
        c2 = eng.new_cache(2, 20)
        steps = torch.stack([eng.run_chunk(idx[:, t:t + 1], t, c2, noise=noise)[0] for t in range(20)], 1)
    assert (whole - steps).abs().max().item() < 1e-5
    # and the caches they leave behind agree too
    assert (c1.k_core - c2.k_core).abs().max().item() < 1e-5


def test_left_padded_rows_equal_unpadded_rows():
    model = tiny()
    eng = Engine(model, None, GenerationConfig())
    a = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(4))
    b = torch.randint(0, 257, (1, 5), generator=torch.Generator().manual_seed(5))
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0], batch[1, 7:] = a[0], b[0]
    with torch.inference_mode():
        cache = eng.new_cache(2, 14, pad=torch.tensor([0, 7]))
        lg, _ = eng.run_chunk(batch, 0, cache, phase="prefill", all_logits=True)
        nxt = torch.tensor([[3], [4]])
        step, _ = eng.run_chunk(nxt, 12, cache)
    ref_a = model(torch.cat([a, nxt[:1]], 1)).logits
    ref_b = model(torch.cat([b, nxt[1:]], 1)).logits
    assert (lg[0] - ref_a[0, :12]).abs().max() < 1e-5
    assert (lg[1, 7:] - ref_b[0, :5]).abs().max() < 1e-5
    assert (step[0] - ref_a[0, -1]).abs().max() < 1e-5 and (step[1] - ref_b[0, -1]).abs().max() < 1e-5


@pytest.mark.parametrize("policy", ["first", "last", "average"])
def test_shared_policies_hold_at_most_one_over_r_of_the_core_cache(policy):
    model = tiny()
    R = 4
    full = LoopKVCache(model.cfg, batch=2, length=32, rounds=R)
    shared = LoopKVCache(model.cfg, batch=2, length=32, rounds=R, prefill=policy, decode=policy)
    assert shared.nbytes()["core"] * R <= full.nbytes()["core"]
    assert shared.nbytes()["total"] < full.nbytes()["total"]


@pytest.mark.parametrize("policy", ["first", "last", "average"])
def test_shared_policy_keeps_the_right_rounds_entry(policy):
    """After a prompt, the one stored entry is round 1's, round R's or the mean of the full cache's."""
    model = tiny()
    R = 3
    idx = torch.randint(0, 257, (1, 10), generator=torch.Generator().manual_seed(6))
    full = Engine(model, None, GenerationConfig(rounds=R))
    shared = Engine(model, None, GenerationConfig(rounds=R, prefill_cache=policy, decode_cache=policy))
    with torch.inference_mode():
        cf, cs = full.new_cache(1, 10), shared.new_cache(1, 10)
        lf, _ = full.run_chunk(idx, 0, cf, phase="prefill", all_logits=True)
        ls, _ = shared.run_chunk(idx, 0, cs, phase="prefill", all_logits=True)
    assert (lf - ls).abs().max() < 1e-6          # inside one chunk attention is exact
    want = {"first": cf.k_core[0], "last": cf.k_core[R - 1], "average": cf.k_core.mean(0)}[policy]
    assert (cs.k_core[0] - want).abs().max() < 1e-6


def test_one_round_makes_every_policy_exact():
    model = tiny()
    idx = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(7))
    ref = model(idx, 1).logits
    for policy in ("first", "last", "average"):
        got = cached_logits(model, idx, 1, prefix=4, prefill_cache=policy, decode_cache=policy)
        assert (got - ref).abs().max() < 1e-5


def test_shared_decode_policy_changes_the_function():
    """Reusing one round's history is an approximation (Ouro's ablation), not the full cache."""
    model = tiny(**{"model.init_std": 0.2})
    idx = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(8))
    ref = model(idx, 3).logits
    got = cached_logits(model, idx, 3, prefix=4, decode_cache="first")
    assert (got[:, 4:] - ref[:, 4:]).abs().max() > 1e-3
    assert (got[:, :5] - ref[:, :5]).abs().max() < 1e-5   # the prompt and the first decode step are exact


def _cfg():
    return tiny().cfg


def test_copy_forward_fills_skipped_rounds_from_the_latest_computed_round():
    cfg = _cfg()
    R = 4
    cache = LoopKVCache(cfg, batch=2, length=4, rounds=R, missing="copy_forward")
    cache.begin(0, 1, "decode")
    H, Dh = cfg.n_kv_heads, cfg.head_dim
    for r in (1, 2, 3, 4):
        rows = None if r <= 2 else torch.tensor([1])    # row 0 exits after round 2
        cache.select(rows)
        n = 2 if rows is None else 1
        for i in range(cfg.n_core):
            val = torch.full((n, H, 1, Dh), float(10 * r + i))
            cache.update(("core", r, i), val, -val)
    cache.commit(torch.tensor([2, 4]))
    for i in range(cfg.n_core):
        assert torch.all(cache.k_core[:, i, 0, :, 0] == torch.tensor([10. + i, 20 + i, 20 + i, 20 + i])[:, None, None])
        assert torch.all(cache.k_core[:, i, 1, :, 0] == torch.tensor([10. + i, 20 + i, 30 + i, 40 + i])[:, None, None])
        assert torch.all(cache.v_core[3, i, 0, :, 0] == -(20. + i))


def test_mask_leaves_tokens_out_of_rounds_they_skipped():
    cfg = _cfg()
    R = 3
    cache = LoopKVCache(cfg, batch=1, length=4, rounds=R, missing="mask")
    H, Dh = cfg.n_kv_heads, cfg.head_dim
    x = torch.zeros(1, H, 1, Dh)
    cache.begin(0, 1, "decode")                      # column 0 exits after round 1
    for i in range(cfg.n_core):
        cache.update(("core", 1, i), x, x)
    cache.commit(torch.tensor([1]))
    cache.begin(1, 1, "decode")                      # column 1 runs all rounds
    masks = {r: cache.update(("core", r, 0), x, x)[2] for r in (1, 2, 3)}
    assert masks[1] is None or bool(masks[1].all())
    for r in (2, 3):
        assert masks[r].tolist() == [[[[False, True]]]]
    assert cache.missing == "mask"                   # the recorded choice stays what it was


def test_bad_policies_are_user_errors():
    cfg = _cfg()
    with pytest.raises(UserError, match="prefill cache policy"):
        LoopKVCache(cfg, batch=1, length=4, rounds=2, prefill="second")
    with pytest.raises(UserError, match="copy_forward"):
        LoopKVCache(cfg, batch=1, length=4, rounds=2, missing="skip")
    with pytest.raises(ValueError, match="no slot"):
        c = LoopKVCache(cfg, batch=1, length=4, rounds=2)
        c.begin(0, 1)
        c.update(("core", 3, 0), torch.zeros(1, cfg.n_kv_heads, 1, cfg.head_dim),
                 torch.zeros(1, cfg.n_kv_heads, 1, cfg.head_dim))


@pytest.mark.parametrize("n_coda", [0, 1])
def test_the_models_own_forward_drives_the_cache(n_coda):
    """LoopedLM.forward(cache=...) speaks the same protocol. The coda history holds each token's
    final readout, so intermediate readouts are exact only without a coda (n_coda = 0); with a
    coda they read final-round coda keys/values of earlier tokens (the cache's documented rule)."""
    model = tiny(**{"model.n_coda": n_coda})
    idx = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(9))
    ref = model(idx, 3, readout_rounds=(1, 2, 3))
    cache = LoopKVCache(model.cfg, batch=1, length=12, rounds=3)
    with torch.no_grad():
        cache.begin(0, 8, "prefill")
        head = model(idx[:, :8], 3, cache=cache)
        cache.commit(3)
        outs = []
        for t in range(8, 12):
            cache.begin(t, 1, "decode")
            outs.append(model(idx[:, t:t + 1], 3, cache=cache, start_pos=t, readout_rounds=(1, 2, 3)))
            cache.commit(3)
    assert (head.logits - ref.logits[:, :8]).abs().max() < 1e-5
    for t, out in zip(range(8, 12), outs):
        for r in ((1, 2, 3) if n_coda == 0 else (3,)):
            assert (out.round_logits[r][:, 0] - ref.round_logits[r][:, t]).abs().max() < 1e-5


@pytest.mark.parametrize("threads", [2, 3])
def test_cached_decode_with_per_thread_weight_slices_equals_forward(threads):
    """With several threads one-row products run as a bmm over output slices; same numbers."""
    model = tiny(**{"model.n_kv_heads": 4})
    idx = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ops, a = Engine(model, None, GenerationConfig()).kernels(), model.core[0].attn
        qkv_rows = ops.table[(id(a.q.weight), id(a.k.weight), id(a.v.weight))][0]
        assert qkv_rows.shape[0] == threads and qkv_rows.dim() == 3        # the split layout is in use
        ref = model(idx, 3).logits
        got = cached_logits(model, idx, 3, prefix=5)
    finally:
        torch.set_num_threads(before)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("policy, missing, used", [
    ("full", "copy_forward", 2), ("full", "mask", 1), ("first", "copy_forward", 3), ("last", "copy_forward", 2),
    ("average", "copy_forward", 2),
])
def test_a_chunk_of_some_rows_leaves_the_other_rows_alone(policy, missing, used):
    """Finished rows are left out of later chunks, and a new prompt may fill a finished row's
    place: writing and committing one row's chunk must not touch the others' entries or depths."""
    cfg = _cfg()
    R, B, L = 3, 3, 6
    cache = LoopKVCache(cfg, batch=B, length=L, rounds=R, prefill=policy, decode=policy, missing=missing)
    g = torch.Generator().manual_seed(0)
    for part in (cache.k_prelude, cache.v_prelude, cache.k_core, cache.v_core, cache.k_coda, cache.v_coda):
        part.copy_(torch.randn(part.shape, generator=g))
    cache.depth[:, :4] = torch.tensor([[1, 3, 2, 3]] * B)
    cache.written = 4                                # columns 0..3 hold (hand-written) entries
    before = {name: t.clone() for name, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    row = torch.tensor([1])
    H, Dh = cfg.n_kv_heads, cfg.head_dim
    cache.begin(2, 2, "decode", row)                 # row 1 writes columns 2 and 3
    for i in range(cfg.n_prelude):
        cache.update(("prelude", 0, i), torch.ones(1, H, 2, Dh), torch.ones(1, H, 2, Dh))
    for r in range(1, used + 1):
        for i in range(cfg.n_core):
            cache.update(("core", r, i), torch.full((1, H, 2, Dh), 7.0 + r), torch.full((1, H, 2, Dh), -7.0 - r))
    cache.commit(torch.tensor([R, used, R]))         # the other rows' entries say R: must be ignored
    for name, old in before.items():
        now = getattr(cache, name)
        if name in ("depth", "pad", "_valid"):                       # (B, ...)
            assert torch.equal(now[[0, 2]], old[[0, 2]]), name
        elif name.endswith("_core"):
            assert torch.equal(now[:, :, [0, 2]], old[:, :, [0, 2]]), name
        elif name.endswith(("_prelude", "_coda")):
            assert torch.equal(now[:, [0, 2]], old[:, [0, 2]]), name
    assert bool((cache.k_core[:, :, 1, :, 2:4] != before["k_core"][:, :, 1, :, 2:4]).any())   # row 1 was written


def test_caches_implement_the_protocol_the_model_calls():
    from looplm.inference.early_exit import SequenceKV
    from looplm.inference.cache import KVCache
    model = tiny()
    assert isinstance(Engine(model, None, GenerationConfig()).new_cache(1, 4), KVCache)
    assert isinstance(SequenceKV(1, 4), KVCache)
    assert not isinstance(object(), KVCache)


def test_a_speculative_rollback_never_reads_the_rejected_entries():
    """Prefill, three uncommitted 1-round drafts, a full-depth verification of the pending token
    and the drafts, then a rollback that keeps one draft (truncate). A chunk that starts past the
    truncation would attend to the rejected draft's column, whose entries are stale: the cache
    refuses it. The chunk at the truncation point is exact: it equals plain decoding of the
    tokens that were kept."""
    model = tiny()
    eng = Engine(model, None, GenerationConfig())
    idx = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(4))
    P = 8
    kept = idx[:, :P + 2]                       # the prompt, the pending token and one accepted draft
    with torch.inference_mode():
        cache = eng.new_cache(1, 16)
        eng.run_chunk(idx[:, :P], 0, cache, phase="prefill")
        for j in range(3):                                            # drafts at P..P+2, not committed
            eng.run_chunk(idx[:, P + j:P + j + 1] + 1, P + j, cache, rounds=1, commit=False)
        eng.run_chunk(idx[:, P:P + 4] + 1, P, cache, all_logits=True)  # verification writes P..P+3
        cache.truncate(P + 2)                                         # keep columns ..P+1 (edit them in)
        eng.run_chunk(kept[:, P:P + 2], P, cache, all_logits=True)     # the accepted tokens' real entries
        with pytest.raises(RuntimeError, match="truncated or never written"):
            eng.run_chunk(idx[:, P + 3:P + 4], P + 3, cache)           # would read column P+2 (rejected)
        nxt = torch.tensor([[7]])
        got, _ = eng.run_chunk(nxt, P + 2, cache)
        fresh = eng.new_cache(1, 16)
        eng.run_chunk(kept, 0, fresh, phase="prefill")
        want, _ = eng.run_chunk(nxt, P + 2, fresh)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert cache.filled == P + 3
