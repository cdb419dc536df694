# Copyright 2026 The dion3_jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""What the reports of the quality study's fixed plans share (``--plan rounding``, ``--plan
floor``): reading a plan's JSON lines, a Markdown table, and the footer that names the command,
the code, the date and the machine of the run."""

from __future__ import annotations

import json
import shlex


def load(paths: list[str], phase: str | None = None) -> tuple[dict | None, list[dict]]:
    """``(meta, runs)`` of results files: the first meta record and every run record (only
    those of ``phase`` when given)."""
    meta, runs = None, []
    for path in paths:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec["type"] == "meta" and meta is None:
                    meta = rec
                elif rec["type"] == "run" and phase in (None, rec.get("phase")):
                    runs.append(rec)
    return meta, runs


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def footer(meta: dict, runs: list[dict]) -> list[str]:
    """The section's last lines: the run's command, then its code, date, machine and count."""
    command = shlex.join(["python3", "examples/quality_study.py", *meta["argv"]])
    return ["```bash", command, "```", "",
            table(["", ""], [
                ["code", meta.get("tag") or "(not recorded)"],
                ["date", meta["date"]],
                ["machine", f"{meta['device']} ({meta['n_devices']} device), Python "
                            f"{meta['python']}, jax {meta['jax']}"],
                ["runs", f"{len(runs)} finished"],
            ])]
