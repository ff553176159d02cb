"""Reading back what mldebug wrote into the dashboards, with their own readers:
TensorBoard's EventAccumulator, and wandb's `wandb leet inspect --json` (the reader of a
run's .wandb transaction log that the installed wandb ships)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from mldebug.record.store import STAT_COLUMNS


def wandb_env(tmp_path, **extra) -> dict:
    """Offline, silent, everything under TMP_PATH: no network, nothing in the home."""
    return dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path),
                WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
                WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
                WANDB_DATA_DIR=str(tmp_path / "wandb-data"), **extra)


def tensorboard(logdir):
    """An EventAccumulator over LOGDIR's event files, every event kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0,
                                                      "tensors": 0})
    ea.Reload()
    return ea


def tb_scalars(ea, tag) -> list:
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def tb_texts(ea, tag) -> list:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in
            ea.Tensors(tag + "/text_summary")]


def wandb_runs(wandb_dir) -> list:
    """The offline run directories under WANDB_DIR/wandb, oldest first."""
    return sorted(p for p in (Path(wandb_dir) / "wandb").glob("offline-run-*") if p.is_dir())


def wandb_records(run_dir, env=None) -> list:
    """Every record of RUN_DIR's .wandb log, as wandb's own reader prints them."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                          str(run_dir)], capture_output=True, text=True, timeout=120,
                         env=env or os.environ)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_history(run_dir, env=None) -> list:
    return [r["history"]["item"] for r in wandb_records(run_dir, env) if r["type"] == "history"]


def f32(v) -> float:
    """What TensorBoard keeps of a float64 (its scalars are float32); NaN for None."""
    return float(np.float32(math.nan if v is None else v))


def same(a, b) -> bool:
    """Equal, NaN equal to NaN."""
    return (a != a and b != b) or a == b


def base_of(key: str) -> str:
    """The tag prefix of series KEY in the dashboards (export.py's scheme, as documented)."""
    name, _, role = key.rpartition(":")
    return f"mldebug/{name or '(root)'}/{role}"


def expected_scalars(run) -> dict:
    """{tag: [(step, value)]} of every stat of every series (first call of each step) and
    every KPI, read from the store with its own API (`Run.stats`, `Run.scalars`)."""
    out: dict = {}
    for s in run.series():
        base = base_of(s["key"])
        rows = {}
        for r in run.stats(s["key"]):
            if r["call"] == 0:
                rows[r["step"]] = r
        for stat in STAT_COLUMNS:
            out[f"{base}/{stat}"] = [(step, r[stat]) for step, r in sorted(rows.items())]
        if run.meta.get("sample"):
            hists = {h["step"]: h for h in run.histograms(s["key"]) if h["call"] == 0}
            out[f"{base}/hist_below"] = [(k, h["below"]) for k, h in sorted(hists.items())]
            out[f"{base}/hist_above"] = [(k, h["above"]) for k, h in sorted(hists.items())]
    for name, points in run.scalars().items():
        out[f"mldebug/kpi/{name}"] = list(points)
    return out
