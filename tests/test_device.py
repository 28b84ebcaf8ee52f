"""A stage's device (``elastic_llm.pipeline.device``): the choice from ``parallel.gpus_per_actor``
and what the process sees, never a silent CPU run; GPU ids in any form Ray gives;
``train.deterministic``. Runs on this CPU machine (no CUDA): a stage that asks for a GPU here
must refuse to start."""

import numpy as np
import pytest
import torch

from elastic_llm.config import ConfigError, load_config
from elastic_llm.pipeline.device import NoDevice, gpu_ids, stage_device
from elastic_llm.pipeline.stage import StageWorker

SMALL = ["model.dim=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=16", "train.batch_size=4", "parallel.microbatches=1",
         "parallel.stages=1", "train.warmup_steps=1"]


def test_a_stage_trains_on_cuda_when_it_asked_for_a_gpu_and_sees_one_and_on_cpu_when_it_asked_for_none():
    assert stage_device(0.0, cuda_available=True).type == "cpu"  # asked for none: the CPU even where a GPU is free
    assert stage_device(1.0, cuda_available=True).type == "cuda"
    assert stage_device(0.5, cuda_available=True).type == "cuda"  # a shared GPU


def test_a_stage_that_asked_for_a_gpu_and_sees_none_refuses_naming_the_field_and_the_fix():
    with pytest.raises(NoDevice) as err:
        stage_device(1.0, cuda_available=False, visible="")
    text = str(err.value)
    assert "parallel.gpus_per_actor=1" in text and "sees no CUDA device" in text and "CUDA_VISIBLE_DEVICES ''" in text
    assert "set parallel.gpus_per_actor=0" in text and "CUDA build of torch" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the stage would train on it")
def test_a_stage_process_asked_for_a_gpu_on_a_machine_without_one_does_not_start():
    cfg = load_config("jobs/tiny.yaml", SMALL + ["parallel.gpus_per_actor=1"])
    with pytest.raises(NoDevice, match="parallel.gpus_per_actor=1 but this stage process sees no CUDA device"):
        StageWorker(cfg, 0, 0)


def test_gpu_ids_are_kept_in_any_form_ray_gives_them():
    uuid = "GPU-5e2c1b0a-8f3d-4c1e-9a7b-2d6f0e4c3b21"
    assert gpu_ids([0, 3]) == ("0", "3")
    assert gpu_ids(["1", uuid]) == ("1", uuid)  # int() of a UUID raised before
    assert ",".join(gpu_ids([uuid, 2])) == f"{uuid},2"  # what CUDA_VISIBLE_DEVICES takes
    assert gpu_ids([]) == ()


@pytest.mark.parametrize(("value", "expected"), [
    ("parallel.gpus_per_actor=2", "parallel.gpus_per_actor=2: a stage trains on one device"),
    ("parallel.gpus_per_actor=1.5", "use 1 (or a fraction like 0.5 to share a GPU)"),
    ("train.deterministic=maybe", "train.deterministic"),
])
def test_more_than_one_gpu_per_stage_and_a_deterministic_that_is_not_a_bool_are_refused(value, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_config("jobs/tiny.yaml", [value])
    assert load_config("jobs/tiny.yaml", ["parallel.gpus_per_actor=1"]).parallel.gpus_per_actor == 1.0


def test_deterministic_turns_on_torchs_deterministic_algorithms_for_the_stage_and_it_still_trains_on_cpu():
    g = np.random.default_rng(0)
    x, y = g.integers(0, 256, (4, 16)), g.integers(0, 256, (4, 16))
    try:
        losses = []
        for on in (True, False):
            worker = StageWorker(load_config("jobs/tiny.yaml", SMALL + [f"train.deterministic={str(on).lower()}"]), 0, 0)
            assert torch.are_deterministic_algorithms_enabled() is on
            losses.append(float(worker.forward(0, x, y)))
            worker.backward(0, None)
            worker.step()
        assert losses[0] == losses[1]  # the same seed and data: the same first loss either way on the CPU
    finally:
        torch.use_deterministic_algorithms(False)
