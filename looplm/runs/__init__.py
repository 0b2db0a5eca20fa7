"""Run folders: checkpoint.py (save, load, versions, `load_run`) and report.py (report.json, the recipe card, plots)."""

from .checkpoint import Run, load_run

__all__ = ["Run", "load_run"]
