"""`lmrl demo`: a smoke run of the whole pipeline (tiny model, digits, SFT, GRPO, plot)."""

from __future__ import annotations

import json
from pathlib import Path

from lmrl.cli import main as cli_main


def test_demo_fast_runs_the_whole_pipeline(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out), "--fast"]) == 0
    summary = json.loads((out / "demo.json").read_text())
    for key in ("plot", "checkpoint", "sft_model", "metrics", "acc_after_sft", "acc_after_rl"):
        assert key in summary, key
    assert (out / "demo.json").exists()
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (Path(summary["checkpoint"]) / "manifest.json").exists()
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    assert any("val/digits/acc" in row for row in rows)
    assert 0.0 <= summary["acc_after_rl"] <= 1.0
    printed = capsys.readouterr().out
    assert str(summary["plot"]) in printed
