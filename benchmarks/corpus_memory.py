"""Peak training memory against corpus size: a run reads a prepared corpus through memory-mapped shards,
so what it holds must not grow with the corpus (issue 23).

    python benchmarks/corpus_memory.py [--sizes-mb 20,500] [--steps 200] [--runs 3] [--workdir DIR]
                                       [--keep] [--write-docs docs/benchmarks.md]

For each size a synthetic JSONL corpus of that many megabytes of text is written (documents of
random words from a fixed vocabulary, seeded: the same bytes every time) and prepared once with
`looplm data prepare` (byte tokenizer, so a corpus of N MB is about N million tokens, 2 bytes each).
Then, --runs times, sizes interleaved so a slow moment hits both, a fresh interpreter trains a small
model --steps steps from the prepared folder (data.path=DIR; one thread, batch 16 x 128, the final
evaluation included). Reported per size, median over runs (min-max): the run's own peak RSS (the
trainer's looplm.memory.RunMemory: the high-water mark reset when the run starts, so the interpreter
and torch imports are left out), the same above the RSS the run started from, and the whole
process's peak (ru_maxrss of the child, from wait4). The ratio compares the largest size with the
smallest; flat is 1.0x.

The pages of the token files a run reads become part of its RSS (file-backed, reclaimable): each
window maps the pages around it, so that share grows with the windows read (steps x batch), and
slightly with the corpus (windows in a small corpus share pages more often), never with its size.
The preparation's own peak RSS and time are printed too (it streams the source; it is not the
measured quantity).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START, END = "<!-- corpus-memory:start -->", "<!-- corpus-memory:end -->"
TRAIN = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 2, "model.context": 128,
         "model.n_prelude": 1, "model.n_core": 1, "model.n_coda": 1, "depth.kind": "fixed", "depth.rounds": 2,
         "backward.window": "all", "data.seq_len": 128, "train.batch_size": 16, "train.eval_batches": 4,
         "train.log_every": 50, "train.threads": 1, "optim.warmup_steps": 10}


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A JSONL file of about `megabytes` MB of text ("text" per line): documents of 100-1000 random words
    from a fixed 5,000-word vocabulary. Written as it is generated; returns the bytes of text."""
    import numpy as np
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, size=int(n))) for n in rng.integers(2, 10, size=5000)], dtype=object)
    target, total = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while total < target:
            words = vocab[rng.zipf(1.3, size=int(rng.integers(100, 1000))) % len(vocab)]
            text = " ".join(words) + ".\n"
            total += len(text)
            f.write(json.dumps({"text": text}) + "\n")
    return total


def child(cmd: list[str]) -> tuple[str, int]:
    """Run cmd; (stdout, the child's own peak RSS in bytes from wait4)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return out, usage.ru_maxrss * 1024          # KiB on Linux


def one(prepared: str, steps: int) -> dict:
    """In a fresh interpreter: train `steps` steps from the prepared folder; the run's memory record."""
    import torch

    import looplm.runs.report
    from looplm.recipe import load_recipe
    from looplm.train.trainer import train

    torch.set_num_threads(1)
    looplm.runs.report.write_plots = lambda run_dir, report: []    # matplotlib is no part of training
    recipe = load_recipe("quickstart", {**TRAIN, "data.path": prepared, "train.steps": steps,
                                        "train.checkpoint_every": steps})
    with tempfile.TemporaryDirectory(prefix="corpus-memory-") as tmp:
        report = train(recipe, Path(tmp) / "run", quiet=True)
    assert report["peak_rss_scope"] == "run", "the RSS high-water mark could not be reset here"
    return {"peak_rss_bytes": report["peak_rss_bytes"], "rss_growth_bytes": report["rss_growth_bytes"],
            "train_data_tokens": report["train_data_tokens"], "unique_tokens": report["unique_tokens"],
            "train_loss_final": report["train_loss_final"]}


def median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} MiB ({min(values):.0f}–{max(values):.0f})"


def markdown(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    first = rows[0]
    lines = [f"`{command}` ({datetime.date.today().isoformat()}; byte tokenizer, so about 1 token per byte, "
             f"2 bytes each on disk; {args.steps} steps of batch 16 × 128 per fresh process, one thread, the final "
             f"evaluation included; sizes interleaved; median of {args.runs}, min–max; load average at the start "
             f"{args.load:.2f}):", "",
             "| corpus | prepared tokens (shards) | run's peak RSS | above the run's start | process peak (ru_maxrss) |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r is first else f", {statistics.median(r['peak']) / statistics.median(first['peak']):.2f}×"
        growth = "" if r is first else f", {statistics.median(r['growth']) / statistics.median(first['growth']):.2f}×"
        proc = "" if r is first else f", {statistics.median(r['process']) / statistics.median(first['process']):.2f}×"
        lines.append(f"| {r['mb']} MB | {r['tokens'] / 1e6:.1f} M ({r['shards']}) | {median_range(r['peak'])}{ratio} | "
                     f"{median_range(r['growth'])}{growth} | {median_range(r['process'])}{proc} |")
    lines += ["", "Preparing (one `looplm data prepare` each, streamed): " + "; ".join(
        f"{r['mb']} MB in {r['prepare_s']:.0f} s, peak RSS {r['prepare_rss'] / 2**20:.0f} MiB" for r in rows) + "."]
    return "\n".join(lines) + "\n"


def write_docs(path: Path, table: str) -> None:
    """Replace the text between the corpus-memory markers of `path` (which must hold them)."""
    text = path.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{path}: no {START} ... {END} markers to write between")
    head, rest = text.split(START, 1)
    path.write_text(head + START + "\n" + table + END + rest.split(END, 1)[1], encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="20,500", help="corpus sizes in MB of text, comma-separated")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", help="where corpora and prepared folders go (default a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora and prepared folders")
    ap.add_argument("--write-docs", metavar="MD", help="write the table between the corpus-memory markers of MD")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps)))
        return
    a.load = os.getloadavg()[0]
    command = "python benchmarks/corpus_memory.py " + " ".join(sys.argv[1:])
    sizes = [int(s) for s in a.sizes_mb.split(",")]
    work = Path(a.workdir or tempfile.mkdtemp(prefix="corpus-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for mb in sizes:
            corpus, prep = work / f"corpus-{mb}mb.jsonl", work / f"prepared-{mb}mb"
            if not corpus.exists():
                t = time.perf_counter()
                write_corpus(corpus, mb)
                print(f"wrote {corpus} ({mb} MB) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            t = time.perf_counter()
            _, rss = child([sys.executable, "-m", "looplm", "data", "prepare", str(corpus), "--out", str(prep),
                            "--quiet", "--set", f"data.max_bytes={2 * mb * 1_000_000 + 1000}"])
            m = json.loads((prep / "manifest.json").read_text())
            rows.append({"mb": mb, "prep": prep, "tokens": m["tokens"]["train"], "shards": len(m["shards"]["train"]),
                         "prepare_s": time.perf_counter() - t, "prepare_rss": rss, "peak": [], "growth": [], "process": []})
            print(f"prepared {mb} MB: {m['tokens']['train']:,} train tokens in {len(m['shards']['train'])} shards, "
                  f"{rows[-1]['prepare_s']:.0f} s, peak RSS {rss / 2**20:.0f} MiB", file=sys.stderr)
        for n in range(a.runs):
            for r in rows:                         # interleaved, so a slow moment hits every size
                out, rss = child([sys.executable, __file__, "--one", str(r["prep"]), "--steps", str(a.steps)])
                got = json.loads(out.strip().splitlines()[-1])
                r["peak"].append(got["peak_rss_bytes"] / 2**20)
                r["growth"].append(got["rss_growth_bytes"] / 2**20)
                r["process"].append(rss / 2**20)
                print(f"run {n + 1}: {r['mb']} MB: run's peak {r['peak'][-1]:.0f} MiB, above its start "
                      f"{r['growth'][-1]:.0f} MiB, process peak {r['process'][-1]:.0f} MiB, final loss "
                      f"{got['train_loss_final']:.3f}", file=sys.stderr)
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    table = markdown(rows, a, command)
    print(table)
    summary = {"sizes_mb": sizes, "steps": a.steps, "runs": a.runs, "load_average": a.load,
               "rows": [{k: v for k, v in r.items() if k != "prep"} for r in rows],
               "peak_ratio_largest_vs_smallest": statistics.median(rows[-1]["peak"]) / statistics.median(rows[0]["peak"])}
    print(json.dumps(summary))
    if a.write_docs:
        write_docs(Path(a.write_docs), table)


if __name__ == "__main__":
    main()
