"""`looplm bench decode`: decoding speed on the matched bench-s configuration, peers in the same run.

bench-s (CONTRACT.md): vocabulary 4096, d_model 256, 4 query and 4 KV heads of width 64, SwiGLU
704, RMSNorm, RoPE, tied embeddings, context 256, fp32. looplm: 1 prelude + 2 core x 3 rounds +
1 coda = 8 effective blocks. Peers: `transformers` LlamaForCausalLM with 8 layers of that shape
(`generate`, its dynamic KV cache) and x-transformers `TransformerWrapper(looped=True)` with 2
layers x 4 loops (`AutoregressiveWrapper.generate`, cache on). A peer that is not importable
gets a row with a note instead of numbers.

Decode: prompt 32 random tokens, 128 new tokens, greedy, weights random (speed does not depend
on training; a seeded init keeps runs comparable). Every row runs in its own subprocess, so
`peak_rss_bytes` is that engine's own peak. Each row does one warm-up, then the rows are timed
in turns (row 1, row 2, ..., row 1, ...) `runs` times and medians are reported, so load from
elsewhere on the machine falls on every engine alike. All engines use the same number of torch
threads: by default every core this process may run on (a decode step of one row is bound by
reading the weights, and looplm reads them on every thread); `--threads 1` is the setting least
disturbed by other load on a shared machine.

Measured per row: ttft_s (prompt in, first token out), prefill_tokens_per_s (prompt tokens /
ttft), decode_tokens_per_s (tokens after the first / time after the first, summed over the
batch), decode_tokens_per_cpu_s (the same tokens per CPU-second of this process: on a machine
shared with other jobs, wall time includes time the process waited for a core, CPU time does not),
p50/p95 per-token latency (time between successive decode steps), peak_rss_bytes.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

BENCH_S = {
    "model.vocab_size": 4096, "model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 4,
    "model.head_dim": 64, "model.ffn_hidden": 704, "model.context": 256, "model.n_prelude": 1,
    "model.n_core": 2, "model.n_coda": 1, "model.tie_embeddings": True, "model.injection": "add",
    "model.init_state": "prelude", "model.state_norm": False, "model.norm": "pre",
    "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 256,
}
QUICK = {"model.d_model": 64, "model.head_dim": 16, "model.ffn_hidden": 176, "model.vocab_size": 512}
PROMPT_LEN, BATCH = 32, 8
HEADLINE = "full cache, fixed depth"


def _rss() -> int:
    """The row process's peak RSS (each row has its own process, so its own peak)."""
    from ..memory import process_peak_rss_bytes
    return process_peak_rss_bytes()


def _summary(spec: dict[str, Any], runs: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """Medians over the timed runs of one row."""
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("decode_tokens_per_s", "decode_tokens_per_cpu_s", "prefill_tokens_per_s", "ttft_s")}
    lat = sorted(x for r in runs for x in r.get("latencies", []))
    row = {"engine": spec["engine"], "batch": spec["batch"], **med,
           "p50_token_latency_s": statistics.median(lat) if lat else None,
           "p95_token_latency_s": lat[int(0.95 * (len(lat) - 1))] if lat else None,
           "decode_tokens_per_s_runs": [round(r["decode_tokens_per_s"], 2) for r in runs], "runs": len(runs)}
    if "label" in spec:
        row["label"] = spec["label"]
    row.update(info)
    return row


def _prompts(batch: int, vocab: int) -> Any:
    import torch
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, PROMPT_LEN), generator=g)


# The peers' models, shared by `bench decode` and `bench train`.

def hf_llama(quick: bool) -> Any:
    """transformers LlamaForCausalLM: 8 layers of the bench-s block shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = 64 if quick else 256
    cfg = LlamaConfig(vocab_size=512 if quick else 4096, hidden_size=d, intermediate_size=176 if quick else 704,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, head_dim=d // 4,
                      max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      attention_bias=False, mlp_bias=False)
    return LlamaForCausalLM(cfg)


def xt_looped(quick: bool) -> Any:
    """x-transformers TransformerWrapper(looped=True): 2 layers x 4 loops of the bench-s width."""
    import torch
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    d = 64 if quick else 256
    return TransformerWrapper(
        num_tokens=512 if quick else 4096, max_seq_len=256, use_abs_pos_emb=False, looped=True, max_looped_steps=4,
        tie_embedding=True,
        attn_layers=Decoder(dim=d, depth=2, heads=4, attn_dim_head=d // 4, rotary_pos_emb=True, ff_glu=True,
                            ff_swish=True, ff_mult=2.75, ff_no_bias=True, use_rmsnorm=True, pre_and_post_norm=True))


# Each setup_* builds one engine and returns (run_once, info): run_once() -> one timed run's numbers.

def setup_looplm(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    from ..recipe.config import load_recipe
    from ..inference.engine import Engine, GenerationConfig, SamplingParams
    from ..model.looped import build_model

    torch.manual_seed(0)
    ov = {**BENCH_S, **(QUICK if spec["quick"] else {}), **spec.get("recipe", {})}
    model = build_model(load_recipe("quickstart", overrides=ov)).eval().to(spec.get("device", "cpu"))
    given = dict(spec.get("config", {}))
    if "recirculation" in given:          # JSON carries its fields; the engine takes the validated config
        from ..inference.recirculation import Recirculation
        given["recirculation"] = Recirculation(**given["recirculation"])
    cfg = GenerationConfig(**given)
    engine = Engine(model, None, cfg)
    prompts = _prompts(spec["batch"], model.cfg.vocab_size).tolist()
    params = SamplingParams(max_new_tokens=spec["new_tokens"], stop_at_eos=False, prompt_mode=spec.get("prompt_mode"))
    rounds: list[int] = []
    flops: list[float] = []
    last: dict[str, Any] = {}

    def run_once() -> dict[str, Any]:
        out = engine.generate(prompts, params)
        st = out[0].stats
        rounds.extend(r for o in out for r in o.rounds_used)
        # the FLOPs of every column the engine computed after the prefill (model/flops.py), per token decoded
        flops.append(st["flops"]["decode"] / max(st["decode_tokens"], 1))
        last.update(st)
        return {"decode_tokens_per_s": st["decode_tokens_per_s"], "ttft_s": st["ttft_s"],
                "decode_tokens_per_cpu_s": st["decode_tokens"] / st["decode_cpu_s"],
                "prefill_tokens_per_s": st["prefill_tokens_per_s"], "latencies": st.get("token_latencies_s", [])}

    def info() -> dict[str, Any]:
        extra = {"exit": str(engine.policy), "prefill_cache": cfg.prefill_cache, "decode_cache": cfg.decode_cache,
                 "mean_rounds": statistics.mean(rounds), "cache_bytes": last["cache_bytes"]["total"],
                 "decode_flops_per_token": statistics.mean(flops)}
        if cfg.recirculation is not None:
            extra["recirculation"] = {k: getattr(cfg.recirculation, k) for k in ("source", "dest", "alpha", "schedule")}
        if cfg.speculative:
            extra["speculative"] = cfg.speculative
            extra["acceptance_rate"] = last["speculative"]["acceptance_rate"]
        return extra
    return run_once, info


def setup_hf(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from transformers.generation.streamers import BaseStreamer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = hf_llama(spec["quick"]).eval().to(spec.get("device", "cpu"))
    cfg = model.config
    B, N = spec["batch"], spec["new_tokens"]
    x = _prompts(B, cfg.vocab_size).to(spec.get("device", "cpu"))
    mask = torch.ones_like(x)

    class Clock(BaseStreamer):
        """Time stamps of generate's per-token callback (batch 1 only)."""

        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value: Any) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run_once() -> dict[str, Any]:
        with torch.inference_mode():
            clock = Clock()
            t0, c0 = time.perf_counter(), time.process_time()
            model.generate(x, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           pad_token_id=0, streamer=clock if B == 1 else None)
            total, cpu_total = time.perf_counter() - t0, time.process_time() - c0
            t1, c1 = time.perf_counter(), time.process_time()   # a 1-token call: prefill alone
            model.generate(x, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft, cpu_first = time.perf_counter() - t1, time.process_time() - c1
            lat, decode_s = [], total - ttft
            if B == 1:                                # the streamer times every token
                stamps = clock.t[1:]                 # put() first receives the prompt
                ttft, decode_s = stamps[0] - t0, stamps[-1] - stamps[0]
                lat = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"ttft_s": ttft, "prefill_tokens_per_s": B * PROMPT_LEN / ttft, "latencies": lat,
                "decode_tokens_per_s": B * (N - 1) / decode_s,
                "decode_tokens_per_cpu_s": B * (N - 1) / (cpu_total - cpu_first)}
    return run_once, lambda: {"layers": 8}


def setup_xtransformers(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from x_transformers import AutoregressiveWrapper

    q = spec["quick"]
    wrapper = AutoregressiveWrapper(xt_looped(q)).eval().to(spec.get("device", "cpu"))
    B, N = spec["batch"], spec["new_tokens"]
    x = _prompts(B, 512 if q else 4096).to(spec.get("device", "cpu"))

    def run_once() -> dict[str, Any]:   # no per-token hook: ttft = a 1-token generate, decode = the rest
        with torch.inference_mode():
            t0, c0 = time.perf_counter(), time.process_time()
            wrapper.generate(x, 1, temperature=0.0, cache_kv=True, looped_steps=4)
            t1, c1 = time.perf_counter(), time.process_time()
            wrapper.generate(x, N, temperature=0.0, cache_kv=True, looped_steps=4)
            t2, c2 = time.perf_counter(), time.process_time()
        ttft, decode_s = t1 - t0, (t2 - t1) - (t1 - t0)
        return {"ttft_s": ttft, "prefill_tokens_per_s": B * PROMPT_LEN / ttft,
                "decode_tokens_per_s": B * (N - 1) / decode_s,
                "decode_tokens_per_cpu_s": B * (N - 1) / ((c2 - c1) - (c1 - c0))}
    return run_once, lambda: {"layers": 2, "loops": 4}


SETUPS = {"looplm": setup_looplm, "hf-llama": setup_hf, "x-transformers": setup_xtransformers}
PEER_MODULES = {"hf-llama": "transformers", "x-transformers": "x_transformers"}


def _row_specs(new_tokens: int, quick: bool, peers: bool, device: str = "cpu") -> list[dict[str, Any]]:
    base = {"new_tokens": new_tokens, "quick": quick, "device": device}
    specs: list[dict[str, Any]] = [
        {"engine": "looplm", "batch": 1, "label": HEADLINE},
        {"engine": "looplm", "batch": BATCH, "label": HEADLINE},
    ]
    if not quick:
        for pol in ("first", "last", "average"):
            specs.append({"engine": "looplm", "batch": 1, "label": f"{pol} cache (prefill and decode)",
                          "config": {"prefill_cache": pol, "decode_cache": pol}})
        for ex in ("fixed:2", "kl:0.01", "entropy:8.2"):
            specs.append({"engine": "looplm", "batch": 1, "label": f"exit {ex}", "config": {"exit": ex}})
        specs.append({"engine": "looplm", "batch": 1, "label": "self-speculative 1:4",
                      "config": {"speculative": "1:4"}})
        # recirculation (inference/recirculation.py): the last core visit into the first, two passes per
        # position; the exact schedules' prompts run column by column (resume: the second pass after visit 1,
        # serial: the whole model again), the blockwise one as one chunk
        for batch, schedule in ((1, "resume"), (BATCH, "resume"), (1, "serial"), (1, "blockwise")):
            specs.append({"engine": "looplm", "batch": batch, "label": f"recirculation 6->1 alpha 0.15, {schedule}",
                          "config": {"recirculation": {"source": 6, "dest": 1, "alpha": 0.15, "schedule": schedule}}})
        # full-bandwidth feedback (model/feedback.py, gate fusion): the same model with its 2 d^2 fusion weights,
        # each prompt mode (standard: no feedback; soft: from the prompt's end; fused: an extra prefill pass)
        for mode in ("standard", "soft", "fused"):
            specs.append({"engine": "looplm", "batch": 1, "label": f"feedback gate, prompt mode {mode}",
                          "recipe": {"feedback.mode": "gate"}, "prompt_mode": mode})
    if peers:
        specs += [{"engine": "hf-llama", "batch": 1}, {"engine": "hf-llama", "batch": BATCH},
                  {"engine": "x-transformers", "batch": 1}]
    return [{**base, **s} for s in specs]


class _RowProcess:
    """One row's engine in its own interpreter (its own peak memory), driven one timed run at a time."""

    def __init__(self, spec: dict[str, Any], threads: int, module: str = "looplm.bench.decode"):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--row", json.dumps({**spec, "threads": threads})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = (self.proc.stderr.read() if self.proc.stderr else "").strip().splitlines() or ["no output"]
            raise RuntimeError(err[-1][:300])
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def bench_decode(runs: int = 5, threads: int = 0, new_tokens: int = 128, quick: bool = False,
                 peers: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Every row of the decode benchmark; the CONTRACT's `bench decode --json` object.

    Rows are interleaved: each of `runs` rounds times every row once, so a burst of load from
    elsewhere on the machine hits all engines alike instead of one row's whole measurement.
    """
    import importlib.util

    from ..errors import UserError
    if runs < 1:
        raise UserError(f"--runs {runs}: must be >= 1")
    if threads < 0:
        raise UserError(f"--threads {threads}: must be >= 0 (0 = every core this process may use)")
    threads = threads or len(os.sched_getaffinity(0))
    if not 2 <= new_tokens <= 256 - PROMPT_LEN:
        raise UserError(f"--new-tokens {new_tokens}: must lie in 2..{256 - PROMPT_LEN} (context 256, prompt 32)")
    from ..device import resolve_device
    device = str(resolve_device(device))
    specs = _row_specs(new_tokens, quick, peers, device)
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    procs: dict[int, _RowProcess] = {}
    timed: dict[int, list[dict[str, Any]]] = {}
    try:
        for i, spec in enumerate(specs):
            mod = PEER_MODULES.get(spec["engine"])
            if mod is not None and importlib.util.find_spec(mod) is None:
                rows[i] = {"engine": spec["engine"], "batch": spec["batch"], "skipped": True,
                           "note": f"{mod} is not importable; pip install {mod.replace('_', '-')} -c constraints.txt"}
                continue
            procs[i] = _RowProcess(spec, threads)
        for i, p in list(procs.items()):        # build + warm up each engine (one untimed run)
            try:
                p.ask("ready")
                timed[i] = []
            except (RuntimeError, json.JSONDecodeError) as err:
                rows[i] = {"engine": specs[i]["engine"], "batch": specs[i]["batch"], "skipped": True,
                           "note": f"failed: {err}"}
                p.close()
                del procs[i]
        for n in range(runs):
            print(f"bench decode: timed round {n + 1}/{runs} over {len(procs)} rows", file=sys.stderr)
            for i, p in procs.items():
                timed[i].append(p.ask("run"))
        for i, p in procs.items():
            info = p.ask("info")
            rows[i] = _summary(specs[i], timed[i], info)
    finally:
        for p in procs.values():
            p.close()
    results = [r for r in rows if r is not None]
    out: dict[str, Any] = {"config": "bench-s" if not quick else "bench-s (quick: d_model 64)",
                           "prompt_tokens": PROMPT_LEN, "new_tokens": new_tokens, "greedy": True,
                           "dtype": "fp32", "threads": threads, "runs": runs, "device": device, "machine": _machine(),
                           "results": results}
    out["ratios"] = _ratios(results)
    return out


def _machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "load_avg_1m": load}


def _ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """The issue's targets: looplm batch 1 vs each peer at batch 1, and looplm batch 8 vs batch 1."""
    def tps(engine: str, batch: int, key: str) -> float | None:
        for r in results:
            if (r["engine"], r["batch"]) == (engine, batch) and not r.get("skipped") \
                    and r.get("label", HEADLINE) == HEADLINE:
                return r[key]
        return None
    out = {}
    for key, suffix in (("decode_tokens_per_s", ""), ("decode_tokens_per_cpu_s", "_cpu_time")):
        l1, l8 = tps("looplm", 1, key), tps("looplm", BATCH, key)
        for peer in ("hf-llama", "x-transformers"):
            p = tps(peer, 1, key)
            if l1 and p:
                out[f"looplm_vs_{peer}_batch1{suffix}"] = l1 / p
        if l1 and l8:
            out[f"looplm_batch{BATCH}_vs_batch1{suffix}"] = l8 / l1
    return out


def decode_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"{result['config']}: prompt {result['prompt_tokens']}, {result['new_tokens']} new tokens, greedy, "
             f"fp32, {result['threads']} thread(s), median of {result['runs']} runs"]
    for r in result["results"]:
        name = f"{r['engine']} b{r['batch']} {r.get('label', '')}".strip()
        if r.get("skipped"):
            lines.append(f"{name:44s} skipped: {r['note']}")
            continue
        p50, p95 = r.get("p50_token_latency_s"), r.get("p95_token_latency_s")
        lines.append(f"{name:44s} decode {r['decode_tokens_per_s']:7.1f} tok/s ({r['decode_tokens_per_cpu_s']:7.1f} "
                     f"per CPU-s)  prefill "
                     f"{r['prefill_tokens_per_s']:8.1f} tok/s  ttft {1000 * r['ttft_s']:6.1f} ms  "
                     + (f"p50/p95 {1000 * p50:5.2f}/{1000 * p95:5.2f} ms  " if p50 and p95 else "")
                     + f"rss {r['peak_rss_bytes'] / 2**20:6.0f} MiB")
    for k, v in result["ratios"].items():
        lines.append(f"{k}: {v:.2f}x")
    return lines


def _row_main(spec_text: str) -> None:
    """A row worker: build the engine, then answer "ready" (warm-up), "run" (one timed run) and
    "info" (row details and this process's peak memory), one JSON line each, until stdin ends."""
    import torch
    spec = json.loads(spec_text)
    torch.set_num_threads(spec["threads"])
    run_once, info = SETUPS[spec["engine"]](spec)
    answer_row_commands(run_once, info)


def answer_row_commands(run_once: Any, info: Any) -> None:
    """The row worker's protocol on stdin/stdout, one JSON line per command: "ready" (an untimed
    warm-up run), "run" (one timed run's numbers), "info" (row details and peak memory)."""
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "ready":
            run_once()
            reply: dict[str, Any] = {"ok": True}
        elif cmd == "run":
            reply = run_once()
        elif cmd == "info":
            reply = {**info(), "peak_rss_bytes": _rss()}
        else:
            break
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--row":
        _row_main(sys.argv[2])
    else:
        print("usage: python -m looplm.bench.decode --row JSON (use `looplm bench decode`)", file=sys.stderr)
        sys.exit(2)
