"""The stage's AdamW and LR schedule (:mod:`elastic_llm.pipeline.optim`) against torch's own.

:class:`StageAdamW` runs torch's functional AdamW without ``torch.optim.Optimizer``: its updates must
equal ``torch.optim.AdamW`` + ``LambdaLR`` bit for bit, step by step, its snapshot fields must be
torch's, and a stage built and stepped with it must not load torch's compiler stack.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from elastic_llm.config import load_config
from elastic_llm.pipeline.optim import StageAdamW, StageSchedule, build_optimizer, lr_factor

pytestmark = pytest.mark.timeout(120)
CFG = load_config("jobs/tiny.yaml", ["train.warmup_steps=3", "train.max_steps=8", "train.weight_decay=0.1"])


def twin_modules():
    torch.manual_seed(3)
    a = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))
    b = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))
    b.load_state_dict(a.state_dict())
    return a, b


def torch_reference(module):
    """What build_optimizer built before: torch's AdamW (foreach) and LambdaLR, same groups."""
    t = CFG.train
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, t.warmup_steps, t.max_steps, t.min_lr / t.lr))
    return opt, sched


def test_every_step_equals_torchs_adamw_with_lambdalr_bit_for_bit():
    """Ten steps through warm-up and cosine decay, one of them with a parameter that got no
    gradient (AdamW leaves it and its state alone): parameters, moments, step counts and LRs
    equal torch's at every step."""
    mine, theirs = twin_modules()
    opt, sched = build_optimizer(mine, CFG.train)
    ref, ref_sched = torch_reference(theirs)
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        x = torch.randn(6, 12, generator=g)
        for m in (mine, theirs):
            m(x).square().mean().backward()
            if step == 4:
                m[1].weight.grad = None
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad(set_to_none=True)
        sched.step()
        ref_sched.step()
        for p, q in zip(mine.parameters(), theirs.parameters()):
            assert torch.equal(p, q), f"step {step}: parameters differ"
            assert p.grad is None and q.grad is None
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], ref.state[q][key]), f"step {step}: {key} differs"
        assert [gr["lr"] for gr in opt.param_groups] == [gr["lr"] for gr in ref.param_groups]
    assert opt.state[mine[1].weight]["step"].item() == 9  # the step without its gradient did not count


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before:UserWarning")
def test_snapshot_fields_are_torchs_so_old_and_new_snapshots_read_the_same():
    """The groups' fields and the schedule's state dict a snapshot records are the ones torch's
    AdamW and LambdaLR recorded (snapshots written before the change load, and the other way)."""
    mine, theirs = twin_modules()
    opt, sched = build_optimizer(mine, CFG.train)
    ref, ref_sched = torch_reference(theirs)
    for _ in range(3):
        sched.step()
        ref_sched.step()
    assert [{k: v for k, v in gr.items() if k != "params"} for gr in opt.param_groups] == [
        {k: v for k, v in gr.items() if k != "params"} for gr in ref.state_dict()["param_groups"]
    ]
    assert sched.state_dict() == ref_sched.state_dict()
    fresh_opt, fresh = build_optimizer(twin_modules()[0], CFG.train)
    fresh.load_state_dict(ref_sched.state_dict())  # a snapshot written by torch's LambdaLR
    fresh.step()
    ref_sched.step()
    assert fresh.last_epoch == ref_sched.last_epoch and fresh.base_lrs == ref_sched.base_lrs


def test_resume_stands_at_the_step_with_the_scaled_peak():
    """A stage rebuilt by CheckFree resumes the schedule at ``step`` with its peak LR scaled."""
    opt, sched = build_optimizer(twin_modules()[0], CFG.train)
    sched.resume(5, 0.5)
    t = CFG.train
    want = t.lr * 0.5 * lr_factor(5, t.warmup_steps, t.max_steps, t.min_lr / t.lr)
    assert [g["lr"] for g in opt.param_groups] == [want, want]
    assert [g["initial_lr"] for g in opt.param_groups] == [t.lr * 0.5] * 2
    assert sched.state_dict()["last_epoch"] == 5
    sched.step()
    assert opt.param_groups[0]["lr"] == t.lr * 0.5 * lr_factor(6, t.warmup_steps, t.max_steps, t.min_lr / t.lr)


def test_a_group_of_its_own_keeps_its_own_weight_decay():
    p = torch.nn.Parameter(torch.ones(3))
    opt = StageAdamW([{"params": [p], "weight_decay": 0.5}], lr=0.1, betas=(0.9, 0.99))
    StageSchedule(opt, lambda s: 1.0)
    assert opt.param_groups[0]["weight_decay"] == 0.5 and opt.param_groups[0]["initial_lr"] == 0.1
    p.grad = torch.zeros(3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), 1 - 0.1 * 0.5))  # zero gradient: only the decoupled decay moved it


def last_line_printed(code: str) -> str:
    """The last line ``code`` prints, run in a fresh Python process (which must succeed)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_stage_built_and_stepped_loads_no_compiler_stack():
    """A fresh process builds a stage, trains it a step and captures its state without loading
    ``torch._dynamo`` or ``torch._inductor`` (1.3 s of CPU each stage process used to pay)."""
    code = (
        "import sys; sys.path[:0] = ['.', 'tests']\n"
        "from test_durable import trained_workers, config\n"
        "ws = trained_workers(config(2), 2)\n"
        "ws[0].capture_state({'epoch': 0, 'index': 1})\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    assert last_line_printed(code) == "[]"


def test_a_stage_process_imports_no_pyarrow():
    """What a stage process loads (its actor class, the stage, the plans and positions it is
    sent) and a stage built with its state captured leave ``pyarrow`` out (0.14 s of CPU a
    stage process paid at its start, on a recovery's new process too): a stage reads no data."""
    code = (
        "import sys\n"
        "import elastic_llm.pipeline.stage_actor, elastic_llm.pipeline.plan, elastic_llm.stream\n"
        "from elastic_llm.config import load_config\n"
        "from elastic_llm.pipeline.stage import StageWorker\n"
        "cfg = load_config('jobs/tiny.yaml', ['model.dim=64', 'model.n_heads=4', 'model.seq_len=16', 'model.n_layers=2', 'parallel.stages=2'])\n"
        "StageWorker(cfg, 1, 0).capture_state({'epoch': 0, 'index': 1})\n"
        "print('pyarrow' in sys.modules)\n"
    )
    assert last_line_printed(code) == "False"


def test_a_warmed_up_process_imports_nothing_at_its_first_step():
    """A warm standby's ``warm_up`` pays torch's lazy imports before it is adopted: the first
    step of a stage built after it (forward, a backward given its successor's gradient, AdamW)
    loads no module. Torch imports its symbolic-shape module (sympy, 0.4 s of CPU) at the first
    backward given a gradient; the warm-up once skipped that path, and every adopted standby's
    first step ran 0.4-0.7 s slower than a steady one."""
    code = (
        "import sys; sys.path[:0] = ['.', 'tests']\n"
        "import numpy as np, ray, ray.runtime_context  # loaded in every Ray worker\n"
        "from test_durable import config\n"
        "from elastic_llm.pipeline.stage import StageWorker, warm_up\n"
        "cfg = config(2)\n"
        "warm_up(cfg)\n"
        "ws = [StageWorker(cfg, s, 0) for s in range(2)]\n"
        "g = np.random.default_rng(1)\n"
        "x, y = g.integers(0, 256, (4, 16)), g.integers(0, 256, (4, 16))\n"
        "before = set(sys.modules)\n"
        "ws[1].forward(0, ws[0].forward(0, x), y)\n"
        "ws[0].backward(0, ws[1].backward(0, None))\n"
        "ws[0].step(); ws[1].step()\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    assert last_line_printed(code) == "[]"
