"""``benchmarks.gpu`` where there is no GPU: it refuses to run without a CUDA device (exit 2, one
line, nothing written); what of it runs on a CPU (a tiny stage's steps driven and timed, the JSON
the run writes, pytest's summary line read) does; and neither importing it nor running its stage
parts imports Ray (the GPU machine has none)."""

import json
import subprocess
import sys
import time

import torch

from benchmarks import gpu

TINY = ["model.vocab_size=256", "model.dim=32", "model.n_heads=2", "model.n_layers=2", "model.seq_len=16", "train.batch_size=2",
        "parallel.microbatches=1", "parallel.stages=1", "train.warmup_steps=1", "train.max_steps=1000"]

# 3-step blocks, one round: each variant's first step left out, two timed
CPU_PARTS = {
    "stall": lambda out, deadline: gpu.snapshot_stall(TINY, deadline, block=3, rounds=1, warmup=1),
    "precision": lambda out, deadline: gpu.precision_speed(TINY, deadline, block=3, rounds=1, warmup=1),
}


def test_without_a_cuda_device_it_exits_2_with_one_clear_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert gpu.main(["--out", str(out)]) == gpu.EXIT_NO_DEVICE == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device is visible" in err[0]
    assert not out.exists()


def test_on_a_cpu_with_ray_unimportable_the_stage_parts_time_two_steps_of_each_variant_and_the_run_writes_their_json(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\n"  # `import ray` raises from here on: the GPU machine has no Ray
            "from benchmarks import gpu\n"
            "from tests.test_gpu_bench import CPU_PARTS\n"
            f"sys.exit(gpu.run(__import__('pathlib').Path({str(tmp_path)!r}), 120.0, ['--out', 'x'], CPU_PARTS))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=gpu.REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / gpu.RESULT).read_text())
    assert {"date", "command", "torch", "cuda", "budget_s", "wall_s", "parts", "errors"} <= set(result) and result["errors"] == {}
    assert result["command"].endswith("-m benchmarks.gpu --out x")
    stall = result["parts"]["stall"]
    assert stall["steps_timed"] == {"none": 2, "snapshot": 2} and stall["device"] == "cpu" and stall["state_bytes"] > 0
    assert all(v > 0 for v in stall["step_ms"].values()) and abs(stall["stall_ms_per_step"] - (stall["step_ms"]["snapshot"] - stall["step_ms"]["none"])) < 0.01
    assert stall["wait_ms_per_step"]["none"] == 0 and stall["copy_ms"] > 0  # a step without a snapshot never waits for a copy
    prec = result["parts"]["precision"]
    assert set(prec["variants"]) == {"fp32", "bf16", "bf16_ckpt"} and prec["tokens_per_step"] == 2 * 16
    assert all(v["steps_timed"] == 2 and v["tokens_per_s"] > 0 and v["peak_memory_bytes"] is None for v in prec["variants"].values())
    assert prec["ratios"]["bf16/fp32 tokens_per_s"] > 0 and prec["ratios"]["bf16/fp32 peak_above_resident_bytes"] is None  # no CUDA memory on a CPU
    assert all(p["wall_s"] >= 0 for p in result["parts"].values())


def test_a_part_that_fails_is_recorded_and_the_parts_after_it_still_run(tmp_path):
    def broken(out, deadline):
        raise RuntimeError("boom")

    assert gpu.run(tmp_path, 60.0, [], {"copies": broken, "stall": lambda out, deadline: {"ran": deadline > time.monotonic()}}) == 1
    result = json.loads((tmp_path / gpu.RESULT).read_text())
    assert result["errors"] == {"copies": "RuntimeError: boom"} and result["parts"]["stall"]["ran"] is True


def test_pytests_summary_line_is_read_into_counts():
    text = "...\n=== short test summary info ===\nFAILED tests/gpu/x.py::t\n1 failed, 2 passed, 1 deselected, 3 warnings, 1 error in 12.34s\n"
    assert gpu.pytest_counts(text) == {"failed": 1, "passed": 2, "deselected": 1, "errors": 1}
    assert gpu.pytest_counts("3 passed in 0.5s") == {"passed": 3} and gpu.pytest_counts("") == {}
