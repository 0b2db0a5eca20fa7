"""Training on two processes (gloo on loopback, launched with torchrun) against one process.

One torchrun job runs every two-process training of this file (process start-up is most of the
cost); the one-process references run here. Same recipe = same global batch at any world size,
so the loss sequences must agree to float rounding: DDP and FSDP2, with sampled depth and a
truncated backward window, learned exits, Stage II, feedback's parallel passes; a resume at
another world size continues the same sequence; ranks that disagree on depth fail loudly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from looplm.recipe.config import load_recipe
from looplm.train.trainer import stage2_recipe, train

TINY = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 2, "data.seq_len": 32,
        "model.context": 64, "train.batch_size": 4, "train.log_every": 1, "train.checkpoint_every": 3,
        "data.max_bytes": 60_000, "train.eval_batches": 1, "train.steps": 6, "optim.lr": 3e-3,
        "optim.warmup_steps": 1}
# quickstart: sampled depth (lognormal-Poisson), backward window 3; every round supervised, so
# readouts before the window train the head alone while the core gets gradient from the window
SAMPLED = {**TINY, "supervision.kind": "every"}
# ouro-style: the whole stack looped, learned exit distribution with its gate
OURO = {**TINY, "model.n_core": 2}
# the feedback recipe (gated fusion, jitter, random initial state) with one, two and three passes from the
# first step and a plain prefix in half the micro-batches: every random draw of the passes is the global batch's
FEEDBACK = {**TINY, "feedback.mix_from_step": 0, "feedback.passes": [0.3, 0.4, 0.3], "feedback.prefix_mix": 0.5}
TOL = dict(rtol=2e-5, atol=2e-6)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def torchrun(jobs: list[dict], tmp: Path, nproc: int = 2, timeout: int = 420) -> subprocess.CompletedProcess:
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone",
           str(Path(__file__).with_name("_dist_worker.py")), str(spec)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    jobs = []
    for mode in ("ddp", "fsdp"):
        jobs.append({"out": str(tmp / f"sampled-{mode}"), "overrides": {**SAMPLED, "train.parallel": mode}})
        jobs.append({"out": str(tmp / f"ouro-{mode}"), "recipe": "ouro-style",
                     "overrides": {**OURO, "train.parallel": mode}})
        jobs.append({"out": str(tmp / f"stage2-{mode}"), "stage2_of": str(tmp / f"ouro-{mode}"),
                     "overrides": {"train.steps": 4, "train.parallel": mode}})
        jobs.append({"out": str(tmp / f"feedback-{mode}"), "recipe": "feedback",
                     "overrides": {**FEEDBACK, "train.parallel": mode}})
    # gradient accumulation: the earlier micro-batches skip the reduction (no_sync / requires_gradient_sync)
    for mode in ("ddp", "fsdp"):
        jobs.append({"out": str(tmp / f"accum-{mode}"), "overrides": {**SAMPLED, "train.grad_accum": 2,
                                                                       "train.parallel": mode}})
    # activation checkpointing per core block composed with FSDP2: the same numbers
    jobs.append({"out": str(tmp / "sampled-ac-fsdp"),
                 "overrides": {**SAMPLED, "train.parallel": "fsdp", "train.activation_checkpointing": True}})
    # trained at 2 for 3 steps, then resumed at 2 (here) and at 1 (in the test)
    for name, mode in (("resume2", "fsdp"), ("resume1", "ddp")):
        jobs.append({"out": str(tmp / name), "overrides": {**SAMPLED, "train.parallel": mode}, "stop_after": 3})
    jobs.append({"out": str(tmp / "resume2"), "overrides": {**SAMPLED, "train.parallel": "fsdp"}, "resume": True})
    jobs.append({"out": str(tmp / "skew"), "overrides": {**SAMPLED, "train.parallel": "ddp"}, "skew_depth": True})
    proc = torchrun(jobs, tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    train(load_recipe("quickstart", SAMPLED), tmp / "sampled", quiet=True)
    train(load_recipe("ouro-style", OURO), tmp / "ouro", quiet=True)
    train(stage2_recipe(tmp / "ouro", {"train.steps": 4}), tmp / "stage2", quiet=True, init_from=tmp / "ouro")
    train(load_recipe("quickstart", {**SAMPLED, "train.grad_accum": 2}), tmp / "accum", quiet=True)
    train(load_recipe("feedback", FEEDBACK), tmp / "feedback", quiet=True)
    return tmp


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", ["sampled", "ouro", "stage2", "accum"])
def test_two_processes_match_one(two_process_runs, one_process_runs, name, mode):
    one, two = losses(one_process_runs / name), losses(two_process_runs / f"{name}-{mode}")
    assert len(one) == len(two) >= 4
    assert max(one) - min(one) > 1e-3, "the losses should move, or agreement says little"
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), **TOL)
    rep = json.loads((two_process_runs / f"{name}-{mode}" / "report.json").read_text())
    ref = json.loads((one_process_runs / name / "report.json").read_text())
    assert rep["world_size"] == 2 and rep["parallel"] == mode and ref["world_size"] == 1
    accum = 2 if name == "accum" else 1
    assert rep["global_batch"] == {"sequences_per_step": 4 * accum, "per_process_micro_batch": 2, "processes": 2,
                                   "grad_accum": accum}
    assert len(rep["peak_rss_bytes_per_rank"]) == 2
    # what happened is recorded for the whole job, not one process
    for key in ("depth_histogram", "backward_histogram", "tokens_seen", "token_passes", "unique_tokens"):
        assert rep[key] == ref[key], key
    for r, v in ref["val_loss_by_rounds"].items():
        assert rep["val_loss_by_rounds"][r] == pytest.approx(v, rel=1e-4)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_feedback_passes_on_two_processes_match_one(two_process_runs, one_process_runs, mode):
    """Feedback's K passes (one model call, so one forward per backward for DDP and FSDP2) train as in one
    process: both processes draw the same pass count, and the plain prefixes, initial state and jitter of
    their rows of the global batch."""
    two, one = two_process_runs / f"feedback-{mode}", one_process_runs / "feedback"
    rep, ref = (json.loads((run / "report.json").read_text()) for run in (two, one))
    assert set(ref["feedback"]["passes_histogram"]) == {"1", "2", "3"}, "every pass count should be trained"
    torch.testing.assert_close(torch.tensor(losses(two)), torch.tensor(losses(one)), **TOL)
    a, b = _weights(two), _weights(one)
    assert a.keys() == b.keys() and "feedback.gate.weight" in a
    for k in a:   # Adam's step divides by the gradient's own size: a near-zero gradient's rounding moves a
        # weight by a little (measured 7e-6 in one element); 6 steps move a typical one by about 5e-3
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-5, msg=k)
    # the passes and tokens x passes are the whole job's, as tokens and FLOPs are
    for key in ("passes_histogram", "token_passes"):
        assert rep["feedback"][key] == ref["feedback"][key], key
    for key in ("tokens_seen", "token_passes", "train_flops"):
        assert rep[key] == pytest.approx(ref[key]), key


def test_activation_checkpointing_under_fsdp_matches_one_process(two_process_runs, one_process_runs):
    torch.testing.assert_close(torch.tensor(losses(two_process_runs / "sampled-ac-fsdp")),
                               torch.tensor(losses(one_process_runs / "sampled")), **TOL)


def test_resume_at_the_same_and_another_world_size(two_process_runs, one_process_runs):
    want = losses(one_process_runs / "sampled")
    # trained 3 steps at 2, resumed at 2 (FSDP, the sharded optimizer state rebuilt from the saved whole)
    torch.testing.assert_close(torch.tensor(losses(two_process_runs / "resume2")), torch.tensor(want), **TOL)
    # trained 3 steps at 2 (DDP), resumed here in one process
    run = two_process_runs / "resume1"
    assert len(losses(run)) == 3
    train(load_recipe("quickstart", {**SAMPLED, "train.parallel": "ddp"}), run, resume=True, quiet=True)
    torch.testing.assert_close(torch.tensor(losses(run)), torch.tensor(want), **TOL)


def test_ranks_that_disagree_on_depth_fail_loudly(two_process_runs):
    for rank in (0, 1):
        text = (two_process_runs / "skew" / f"lockstep_rank{rank}.txt").read_text()
        assert "ranks disagree on depth" in text and "rank 0: rounds" in text and "rank 1: rounds" in text


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nccl)")
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_nccl_on_two_gpus_matches_one(tmp_path, mode):
    over = {**SAMPLED, "train.device": "cuda"}
    train(load_recipe("quickstart", over), tmp_path / "one", quiet=True)
    proc = torchrun([{"out": str(tmp_path / "two"), "overrides": {**over, "train.parallel": mode}}], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "two")), torch.tensor(losses(tmp_path / "one")),
                               rtol=1e-4, atol=1e-5)


def test_one_process_refuses_parallel_none_under_torchrun(monkeypatch, tmp_path):
    from looplm.errors import UserError
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="train.parallel"):
        train(load_recipe("quickstart", TINY), tmp_path / "x", quiet=True)


def test_global_batch_must_divide(monkeypatch):
    from looplm.errors import UserError
    from looplm.train.parallel import World, shard
    with pytest.raises(UserError, match="divisible"):
        shard(World(rank=0, size=3, backend="gloo"), 4)
    assert [shard(World(rank=r, size=2, backend="gloo"), 4) for r in (0, 1)] == [slice(0, 2), slice(2, 4)]


# ---------------------------------------------------------------------------------------
# kill -9 and resume: a checkpoint is whole or absent, and the finished run equals an uninterrupted one

KILL = {**TINY, "train.steps": 20, "train.checkpoint_every": 3}


def _sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _wait_gone(pids: list[int], timeout: float = 60.0) -> None:
    """Kill the given processes and wait until none runs (a zombie has stopped writing)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError, IndexError):
                break
            if state in ("Z", "X"):
                break
            time.sleep(0.01)


def _checkpoint_step(run: Path) -> int | None:
    from looplm.runs.checkpoint import load_state, repair_checkpoint
    repair_checkpoint(run)        # what --resume does first
    return int(load_state(run)["step"]) if (run / "checkpoint" / "state.pt").exists() else None


def _logged(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _kill_loop(run: Path, launch: list[str], kills: list[tuple[int, float, str]], timeout: float = 120) -> list[int]:
    """Start (or resume) the run and kill it in turn at each (logged step, extra delay, target), then
    let it finish. target: "job" kills the launcher's whole process group, "rank" one worker process.
    Returns the steps logged when each kill landed."""
    import signal
    import time
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    interrupted: list[int] = []
    for at, delay, target in [*kills, (None, 0.0, None)]:
        resume = _checkpoint_step(run) is not None
        proc = subprocess.Popen([*launch, *(["--resume"] if resume else [])], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if at is None:
            _, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
            return interrupted
        deadline = time.monotonic() + timeout
        while _logged(run) < at and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)                               # anywhere in a step, or in a checkpoint write
        workers = _children(proc.pid)
        if target == "rank" and workers:
            os.kill(workers[-1], signal.SIGKILL)
            proc.wait(timeout=60)                       # torchrun tears the job down
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:                      # already gone (torchrun after a rank's death)
            pass
        proc.wait(timeout=60)
        _wait_gone(workers)                             # a dying rank may still be writing checkpoint.next
        step, done = _checkpoint_step(run), _logged(run)
        # at most one checkpoint interval of logged steps is lost
        every = KILL["train.checkpoint_every"]
        assert (done <= every) if step is None else (step >= done - every), (step, done)
        interrupted.append(done)
    return interrupted


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run / "checkpoint" / "model.safetensors"))


@pytest.mark.parametrize("world", [1, 2])
def test_kill_and_resume_loses_nothing(tmp_path, world):
    import random
    rng = random.Random(world)
    over = {**KILL, "train.parallel": "ddp" if world == 2 else "none"}
    cli = [sys.executable, "-m", "looplm", "train", "--recipe", "quickstart", *_sets(over)]
    if world == 2:
        cli = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "looplm", "train", "--recipe", "quickstart", *_sets(over)]
    ref = tmp_path / "uninterrupted"
    subprocess.run([*cli, "--out", str(ref)], check=True, capture_output=True, timeout=180,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    run = tmp_path / "killed"
    # kills at growing logged steps (a resumed run re-logs from its checkpoint), each some way into a step
    # two kills: at 2 processes one rank, then the whole job (suite time: each kill is a restart)
    ats = sorted(rng.sample(range(2, KILL["train.steps"] - 1), 2))
    kills = [(at, rng.uniform(0.0, 0.08), "rank" if world == 2 and i == 0 else "job") for i, at in enumerate(ats)]
    interrupted = _kill_loop(run, [*cli, "--out", str(run)], kills)
    assert all(0 < n < KILL["train.steps"] for n in interrupted), f"a kill missed the training: {interrupted}"
    assert losses(run) == losses(ref)
    a, b = _weights(run), _weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (run / "checkpoint.next").exists() and not (run / "checkpoint.prev").exists()
