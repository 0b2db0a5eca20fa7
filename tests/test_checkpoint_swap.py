"""A checkpoint is whole or absent: a crash at any point of `save_checkpoint` leaves, after
`repair_checkpoint`, either the previous checkpoint or the new one, never a mix; a version-1
optimizer state (keyed by index) resumes as the name-keyed one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import looplm
from looplm.errors import UserError
from looplm.runs import checkpoint as ck

RECIPE = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return looplm.build_model(looplm.load_recipe("quickstart", RECIPE))


def _saved(run: Path) -> tuple[int, torch.Tensor]:
    from safetensors.torch import load_file
    state = ck.load_state(run)
    return int(state["step"]), load_file(str(run / "checkpoint" / "model.safetensors"))["embed.weight"]


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_at", range(6))
def test_crash_anywhere_in_a_save_leaves_one_whole_checkpoint(tmp_path, monkeypatch, crash_at):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "tokenizer.json").write_text("{}")
    old, new = _model(0), _model(1)
    ck.save_checkpoint(run, old, {"step": 2})
    # the operations of a save, in order: the two files, the fsyncs, the two renames, the cleanup
    calls = {"n": 0}
    real_save, real_rename, real_rmtree = ck.save_model, Path.rename, __import__("shutil").rmtree

    def tick():
        calls["n"] += 1
        if calls["n"] == crash_at + 1:
            raise Crash

    monkeypatch.setattr(ck, "save_model", lambda *a: (tick(), real_save(*a)))
    monkeypatch.setattr(Path, "rename", lambda self, target: (tick(), real_rename(self, target))[1])
    monkeypatch.setattr("shutil.rmtree", lambda p, *a, **k: (tick(), real_rmtree(p, *a, **k)))
    try:
        ck.save_checkpoint(run, new, {"step": 4})
        crashed = False
    except Crash:
        crashed = True
    monkeypatch.undo()
    ck.repair_checkpoint(run)
    step, embed = _saved(run)
    # a crash while writing checkpoint.next/ or at the first rename keeps the old checkpoint; from
    # the second rename on, the new one is whole and is the run's
    assert step == (2 if crash_at < 2 else 4) and crashed == (crash_at < 4)
    assert torch.equal(embed, (old if step == 2 else new).embed.weight)
    assert (run / "checkpoint" / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint"]


def test_version_1_optimizer_state_resumes_like_version_2():
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randint(0, 200, (2, 8)), 2).logits.sum().backward()
    opt.step()
    names = [n for n, _ in m.named_parameters()]
    v1 = opt.state_dict()
    v2 = ck.optimizer_state_for(v1, 1, names)
    assert set(v2["state"]) == set(names) and v2["param_groups"][0]["params"] == names
    back = ck.optimizer_state_by_index(v2, names)
    for i, s in v1["state"].items():
        assert torch.equal(back["state"][i]["exp_avg"], s["exp_avg"])
    assert back["param_groups"] == v1["param_groups"]
    with pytest.raises(UserError, match="lacks"):
        ck.optimizer_state_by_index(v2, names[:-1])
