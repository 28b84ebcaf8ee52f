"""``bench memory`` and ``bench precision`` (issue 48's measurements) on a small model: a stage's
peak is measured in its own process and set against the plan; the precision runs' metrics are
read back and plotted. The figures themselves live in BENCHMARKS.md."""

import json

import pytest

from benchmarks import memory, precision

SMALL = ["model.dim=64", "model.n_heads=4", "model.n_layers=4", "model.seq_len=32", "train.batch_size=4"]


@pytest.mark.timeout(240)
def test_a_stage_peak_is_measured_in_its_own_process_and_set_against_the_plan():
    result = memory.run_memory_bench(["jobs/tiny.yaml"], overrides=SMALL + ["parallel.stages=2"], steps=2, precisions=("bf16",))
    rows = result["rows"]
    assert len(rows) == 2 * 2  # stages x checkpointing
    for r in rows:
        assert "error" not in r, r
        assert r["peak_bytes"] > 0 and r["plan_bytes"] > 0 and r["step_s"] > 0 and r["measured_over_plan"] > 0
    assert [s["precision"] for s in result["summary"]] == ["bf16"]
    assert "| tiny.yaml | bf16 | none | 0 |" in memory.markdown_table(result)


def test_precision_runs_are_read_back_and_plotted(tmp_path):
    for p, final in (("fp32", 3.0), ("bf16", 3.03)):
        rows = [{"event": "start"}] + [{"step": s, "loss": 5.0, "tokens_per_s": 100.0, "elapsed_s": s, **({"val_loss": final + (12 - s) / 10} if s % 4 == 0 else {})}
                                       for s in range(1, 13)]
        (tmp_path / f"{p}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    result = precision.run_precision_bench("jobs/tiny.yaml", steps=12, from_dir=str(tmp_path))
    assert result["final_val_loss"] == {"fp32": 3.0, "bf16": 3.03} and result["bf16_over_fp32_final"] == 1.01
    assert (tmp_path / "precision.png").stat().st_size > 0
    assert "--max-steps 12" in result["commands"]["bf16"] and "train.precision=bf16" in result["commands"]["bf16"]
    (tmp_path / "fp32.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}))
    with pytest.raises(ValueError, match="no validation losses"):
        precision.run_precision_bench("jobs/tiny.yaml", steps=12, from_dir=str(tmp_path))
