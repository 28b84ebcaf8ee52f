"""The memory plan (issue 48, item 3): its activation bytes are exactly what autograd keeps, its
schedule counts the microbatches a stage holds, ``elastic-llm plan`` prints it, and ``train``
refuses a GPU run that does not fit before Ray starts, naming the fields that would make it fit.
The plan against measured peaks lives in ``elastic-llm bench memory`` (BENCHMARKS.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_llm.pipeline import memory
from elastic_llm.config import ConfigError, load_config
from elastic_llm.model import LOSS_CHUNK, ModelShape, build_stage
from elastic_llm.pipeline import device

REPO = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(vocab_size=96, dim=32, n_heads=4, n_layers=4, seq_len=16, ffn_hidden=48)


def saved_bytes(shape, stage, n_stages, precision, checkpointing, batch=2):
    """Bytes of every tensor autograd keeps for one microbatch's backward (not the stage's own
    parameters and buffers), plus what the stage itself holds: the token ids it reads, the output it sends on."""
    module = build_stage(shape, n_stages, stage, 0)
    module.checkpoint_layers = checkpointing == "layers"
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            kept[s.data_ptr()] = s.nbytes()
        return t

    first, last = stage == 0, stage == n_stages - 1
    wire = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randint(0, shape.vocab_size, (batch, shape.seq_len)) if first else torch.randn(batch, shape.seq_len, shape.dim).to(wire).requires_grad_(True)
    targets = torch.randint(0, shape.vocab_size, (batch, shape.seq_len)) if last else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = device.forward(precision, torch.device("cpu"), lambda: module.run(x, first, True, last, targets), not last)
    for held in ([x] if first else []) + ([out] if not last else [targets]):  # the tokens the stage reads, the output it sends on, the targets
        kept.setdefault(held.untyped_storage().data_ptr(), held.untyped_storage().nbytes())
    return sum(kept.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "layers"])
@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("batch", [2, 3 * LOSS_CHUNK // 16])  # 32 tokens; more than a chunk of the head's loss
def test_activation_bytes_are_what_autograd_keeps(precision, checkpointing, stage, batch):
    want = memory.activation_bytes(SHAPE, precision, checkpointing, 1, stage == 0, stage == 3, batch * SHAPE.seq_len)
    got = saved_bytes(SHAPE, stage, 4, precision, checkpointing, batch)
    assert abs(want - got) <= 0.005 * got + 16, (want, got)  # a few scalars (the loss, the norms' 1/rms) are left out


def test_checkpointing_keeps_a_fraction_and_bf16_less_than_fp32():
    shape = ModelShape(vocab_size=8192, dim=384, n_heads=6, n_layers=12, seq_len=256, ffn_hidden=896)  # llama-25m
    none = memory.activation_bytes(shape, "fp32", "none", 3, False, False, 1024)
    assert memory.activation_bytes(shape, "fp32", "layers", 3, False, False, 1024) < 0.1 * none
    assert memory.activation_bytes(shape, "bf16", "none", 3, False, False, 1024) < 0.75 * none


def test_in_flight_follows_the_schedule():
    cfg = load_config("jobs/tiny.yaml", ["parallel.microbatches=8"])
    assert memory.in_flight(cfg, 8) == [4, 3, 2, 1]  # 1F1B: stages - s
    assert memory.in_flight(load_config("jobs/tiny.yaml", ["parallel.schedule=gpipe"]), 4) == [4, 4, 4, 4]
    assert memory.in_flight(cfg, 2) == [2, 2, 2, 1]  # fewer microbatches than stages


def test_plan_adds_up_and_counts_what_each_mode_holds():
    cfg = load_config("jobs/llama-25m.yaml", ["durable.storage_path=null"])
    p = memory.plan(cfg)
    s0 = p.stages[0]
    assert s0.params == s0.grads == s0.optimizer // 2 == 4 * (384 * 8192 + 3 * (4 * 384 * 384 + 3 * 384 * 896 + 2 * 384))
    assert s0.device == s0.params + s0.grads + s0.optimizer + s0.in_flight * s0.activations + s0.working + s0.runtime
    assert s0.working == 0 and p.stages[-1].working == 8 * 4 * 256 * 8192  # the logits' gradients of one microbatch
    assert s0.snapshot_buffers == 2 * (s0.params + s0.optimizer) and p.object_store_per_node > 0
    redundant = memory.plan(load_config("jobs/llama-25m.yaml", ["durable.storage_path=null", "recovery.mode=redundant"]))
    assert redundant.stages[0].redundant > redundant.stages[1].params  # the successor's state and its activations
    two = memory.plan(load_config("jobs/llama-25m.yaml", ["durable.storage_path=null", "recovery.mode=redundant", "parallel.dp=2", "train.batch_size=32"]))
    assert two.stages[0].redundant - two.stages[1].collective == 4 * two.stages[1].params + 4 * two.stages[1].activations  # + the copy's gradients in the replicas' sum
    wide = memory.plan(load_config("jobs/llama-25m.yaml", ["durable.storage_path=null", "parallel.dp=2", "train.batch_size=32"]))
    assert wide.stages[0].collective == 2 * wide.stages[0].params
    ckpt = memory.plan(load_config("jobs/llama-25m.yaml", ["durable.storage_path=null", "train.activation_checkpointing=layers"]))
    assert ckpt.stages[1].activations == p.stages[1].activations_layers < p.stages[1].activations / 4 and ckpt.stages[1].working > 0


def test_a_plan_that_does_not_fit_names_what_would_make_it_fit():
    cfg = load_config("jobs/llama-1.5b.yaml", ["durable.storage_path=null"])
    with pytest.raises(memory.DoesNotFit, match="stage 0 needs .* GiB") as e:
        memory.check(cfg, 80 * memory.GIB, "an 80 GiB device")
    for fix in ("train.activation_checkpointing=layers", "train.precision=bf16", "parallel.microbatches=16", "parallel.stages=12"):
        assert fix in str(e.value)
    memory.check(load_config("jobs/llama-1.5b.yaml", ["durable.storage_path=null", "train.activation_checkpointing=layers"]), 80 * memory.GIB, "x")
    memory.check(cfg, 141 * memory.GIB, "an H200")  # 93 GiB fits 141
    with pytest.raises(ConfigError, match="parallel.gpu_memory_gib=80"):
        memory.check_up_front(load_config("jobs/llama-1.5b.yaml", ["durable.storage_path=null", "parallel.gpu_memory_gib=80"]))
    memory.check_up_front(load_config("jobs/llama-1.5b.yaml", ["durable.storage_path=null"]))  # memory unknown: the stages check their devices
    device.check_fits(cfg, torch.device("cpu"))  # a CPU stage has nothing to check
    half = load_config("jobs/llama-1.5b.yaml", ["durable.storage_path=null", "parallel.gpus_per_actor=0.5", "train.precision=bf16"])
    assert memory.share(half, 141 * memory.GIB) == 70.5 * memory.GIB and memory.share(cfg, 80.0) == 80.0
    assert memory.fits(half, memory.share(half, 141 * memory.GIB)) and not memory.fits(half, memory.share(half, 80 * memory.GIB))  # 59.7 GiB


def cli(*args):
    env = dict(os.environ, RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", "elastic_llm.cli", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_plan_command_prints_each_stage_and_whether_it_fits():
    out = cli("plan", "--config", "jobs/llama-1.5b.yaml", "--gpu-memory-gib", "141")
    assert out.returncode == 0, out.stderr
    assert "fits a 141 GiB device" in out.stdout and len([ln for ln in out.stdout.splitlines() if ln.split()[:1] in (["0"], ["5"])]) == 2
    out = cli("plan", "--config", "jobs/llama-1.5b.yaml", "--gpu-memory-gib", "80", "--json")
    assert out.returncode == 1
    plan = json.loads(out.stdout)
    assert not plan["fits"] and len(plan["stages"]) == 6 and plan["stages"][0]["in_flight"] == 6
    out = cli("plan", "--config", "jobs/llama-1.5b.yaml", "--set", "train.precision=bf16", "--set", "train.activation_checkpointing=layers", "--gpu-memory-gib", "80")
    assert out.returncode == 0 and "fits" in out.stdout


@pytest.mark.parametrize("args,expected", [
    (["plan", "--gpu-memory-gib", "0"], "parallel.gpu_memory_gib=0.0 must be > 0"),
    (["plan", "--set", "train.precision=fp16"], "train.precision='fp16' is unknown"),
    (["plan", "--set", "train.activation_checkpointing=all"], "train.activation_checkpointing='all' is unknown"),
    (["plan", "--nodes", "0"], "--nodes=0 must be >= 1"),
    (["train", "--config", "jobs/llama-1.5b.yaml", "--set", "parallel.gpu_memory_gib=80"], "set any of train.activation_checkpointing=layers"),
])
def test_bad_input_and_a_run_that_cannot_fit_exit_2(args, expected):
    out = cli(*args)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert expected in out.stderr and "Traceback" not in out.stderr
