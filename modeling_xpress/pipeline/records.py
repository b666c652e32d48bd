"""Every stage of a pipeline run recorded as text in its output folder.

`<out>/records/<stage>.json`: the stage, its status ("done", "running", "given", "failed"), the command that ran it,
the settings it ran with, one entry per session (start time, wall seconds, machine, threads, and the settings of
that session when they differed), the total wall time, and the results. `<out>/records/<stage>.md` says the same
for a reader, and `<out>/README.md` is the run at a glance: one line per stage. The training stages also keep
`<out>/training_summary.json` (stage → command, steps, logs, curves: the format of the runs in docs/runs) and the
plot of their curves.

A stage that is done is not run again; it is refused if the recipe now asks for other settings (start a new output
folder, or delete the stage's record and output to run it again).
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..bench.benchmark import cpu_name

DONE, RUNNING, GIVEN, FAILED = "done", "running", "given", "failed"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def _minutes(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


class StageRecords:
    """The records of one output folder. `start` opens a session of a stage, `finish` closes it with results."""

    def __init__(self, out: str | os.PathLike, command: str):
        self.out = Path(out)
        self.folder = self.out / "records"
        self.command = command
        self._started: dict[str, float] = {}

    def path(self, stage: str) -> Path:
        return self.folder / f"{stage}.json"

    def load(self, stage: str) -> dict | None:
        path = self.path(stage)
        return json.loads(path.read_text()) if path.is_file() else None

    def finished(self, stage: str) -> bool:
        """Whether `stage` is done (or given), whatever its settings."""
        record = self.load(stage)
        return record is not None and record["status"] in (DONE, GIVEN)

    def is_done(self, stage: str, settings: dict) -> bool:
        """Whether `stage` finished; a finished stage with other settings is a `ValueError` naming them."""
        record = self.load(stage)
        if record is None or record["status"] not in (DONE, GIVEN):
            return False
        done = json.loads(json.dumps(record["settings"]))
        asked = json.loads(json.dumps(settings, default=str))
        changed = sorted(k for k in set(done) | set(asked) if done.get(k) != asked.get(k))
        if changed:
            raise ValueError(
                f"stage {stage} of {self.out} is done with other settings ({', '.join(changed)}: "
                f"{ {k: done.get(k) for k in changed} } then, { {k: asked.get(k) for k in changed} } now). Use another "
                f"--out, or delete {self.path(stage)} and the stage's output to run it again."
            )
        return True

    def start(self, stage: str, settings: dict) -> dict:
        """A new session of `stage` (its first, or a resumed one), recorded as running."""
        record = self.load(stage) or {"stage": stage, "sessions": [], "results": {}}
        session = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_seconds": None,
                   "cpu": cpu_name() or platform.machine(), "threads": torch.get_num_threads(),
                   "command": self.command}  # fmt: skip
        asked = json.loads(json.dumps(settings, default=str))
        if record.get("settings") not in (None, asked):
            session["settings"] = asked  # a resumed stage may run on with other settings (precision, threads, ...)
        record.update(status=RUNNING, command=self.command, settings=asked)
        record["sessions"].append(session)
        self._started[stage] = time.perf_counter()
        self.write(record)
        return record

    def finish(self, record: dict, results: dict, status: str = DONE) -> dict:
        """Close the session with its wall time and the stage's results."""
        stage = record["stage"]
        record["sessions"][-1]["wall_seconds"] = round(time.perf_counter() - self._started.pop(stage), 3)
        record["wall_seconds"] = round(sum(s["wall_seconds"] or 0 for s in record["sessions"]), 3)
        record["results"] = results
        record["status"] = status
        self.write(record)
        return record

    def fail(self, record: dict, error: BaseException) -> None:
        """An interrupted or failed session: its wall time and what stopped it; the stage resumes on the next run."""
        stage = record["stage"]
        if stage in self._started:
            record["sessions"][-1]["wall_seconds"] = round(time.perf_counter() - self._started.pop(stage), 3)
        record["sessions"][-1]["stopped_by"] = f"{type(error).__name__}: {error}"
        record["wall_seconds"] = round(sum(s["wall_seconds"] or 0 for s in record["sessions"]), 3)
        record["status"] = FAILED
        self.write(record)

    def given(self, stage: str, settings: dict, results: dict) -> dict:
        """A stage the recipe provides the output of (e.g. response sets written earlier): recorded, not run."""
        record = {"stage": stage, "status": GIVEN, "command": self.command,
                  "settings": json.loads(json.dumps(settings, default=str)), "sessions": [], "wall_seconds": 0.0,
                  "results": results}  # fmt: skip
        self.write(record)
        return record

    def write(self, record: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stage = record["stage"]
        _write_atomic(self.path(stage), json.dumps(record, indent=1, default=str) + "\n")
        _write_atomic(self.folder / f"{stage}.md", stage_markdown(record))

    def write_overview(self, stages: list[str], title: str) -> None:
        """`<out>/README.md`: one line per stage, in order."""
        lines = [f"# {title}", "", f"Command: `{self.command}`", "",
                 "| stage | status | wall time | results | record |", "|---|---|---|---|---|"]  # fmt: skip
        for stage in stages:
            record = self.load(stage)
            if record is None:
                lines.append(f"| {stage} | not run | – | | |")
                continue
            lines.append(f"| {stage} | {record['status']} | {_minutes(record.get('wall_seconds'))} | "
                         f"{headline(record.get('results', {}))} | [json](records/{stage}.json), "
                         f"[md](records/{stage}.md) |")  # fmt: skip
        _write_atomic(self.out / "README.md", "\n".join(lines) + "\n")


def headline(results: dict) -> str:
    """The few results worth a table cell: scalars only, the long ones (curves, records, lists) left out."""
    shown = {k: v for k, v in results.items() if isinstance(v, (int, float, str, bool)) and len(str(v)) <= 60}
    return "; ".join(f"{k} {round(v, 4) if isinstance(v, float) else v}" for k, v in list(shown.items())[:6])


def stage_markdown(record: dict) -> str:
    lines = [f"# Stage `{record['stage']}`: {record['status']}", "",
             f"Command: `{record.get('command')}`", "", f"Wall time: {_minutes(record.get('wall_seconds'))} over "
             f"{len(record.get('sessions', []))} session(s).", ""]  # fmt: skip
    if record.get("sessions"):
        lines += ["| session started | wall time | cpu | threads | stopped by |", "|---|---|---|---|---|"]
        for s in record["sessions"]:
            lines.append(f"| {s['started']} | {_minutes(s['wall_seconds'])} | {s['cpu']} | {s['threads']} | "
                         f"{s.get('stopped_by', '')} |")  # fmt: skip
        lines.append("")
    lines += ["## Settings", "", "```json", json.dumps(record.get("settings"), indent=1, default=str), "```", ""]
    results = {k: v for k, v in record.get("results", {}).items() if k not in ("curves",)}
    lines += ["## Results", "", "```json", json.dumps(results, indent=1, default=str)[:20000], "```", ""]
    return "\n".join(lines)


def training_table(stages: dict[str, dict]) -> str:
    """A Markdown table of training stages (stage → its results: `global_step`, `train_seconds`, `best_metric`, and
    the `command` it ran, a list of words or a string), for a model card."""
    shown = ("--init_from", "--init_from_target_layers", "--refiner", "--train_mode", "--max_steps",
             "--learning_rate", "--draft_vocab_size", "--num_draft_layers", "--refiner_rank")  # fmt: skip
    lines = ["| stage | steps | train time (min) | held-out τ estimate (best) | command |", "|---|---|---|---|---|"]
    for stage, info in stages.items():
        seconds = info.get("train_seconds") or info.get("wall_seconds_this_run")
        minutes = "–" if seconds is None else f"{seconds / 60:.1f}"
        best = info.get("best_metric")
        command = info.get("command", [])
        command = command.split() if isinstance(command, str) else command
        flags = [a for a in command if a.startswith("--")]
        args = " ".join(f"{a} {command[command.index(a) + 1]}" for a in shown if a in flags)
        lines.append(f"| {stage} | {info.get('global_step', '–')} | {minutes} | "
                     f"{'–' if best is None else f'{best:.3f}'} | `{args}` |")  # fmt: skip
    return "\n".join(lines)
