"""``train.precision: bf16`` (issue 48, item 1), on this CPU: a stage's forward and backward under
bf16 autocast with fp32 master weights, fp32 gradients and fp32 AdamW moments; activations and
their gradients cross stages in bf16 (the transport carries bf16 bits and refuses any other
dtype by name); snapshots keep the fp32 state and record the precision; a resume at the other
precision loads it; same seed, same losses; a restore continues bit for bit."""

import numpy as np
import pytest
import torch

from elastic_llm.config import ConfigError, load_config
from elastic_llm.pipeline.stage import StageWorker
from elastic_llm.pipeline.transport import Msg, ProtocolError
from elastic_llm.snapshot.records import ShardKey

from .test_transport import close, linked

SMALL = ["model.dim=64", "model.n_heads=4", "model.n_layers=4", "model.seq_len=16", "train.batch_size=4", "parallel.microbatches=1",
         "parallel.stages=2", "train.warmup_steps=1", "train.eval_every=0"]


def config(precision):
    return load_config("jobs/tiny.yaml", SMALL + [f"train.precision={precision}"])


def chain(cfg):
    return [StageWorker(cfg, s, 0) for s in range(cfg.parallel.stages)]


def batches(n, seed=0):
    g = np.random.default_rng(seed)
    return [(g.integers(0, 256, (4, 16)), g.integers(0, 256, (4, 16))) for _ in range(n)]


def train(workers, data, seen=None):
    """One microbatch per step through the stages in process, as the links hand it over (the
    activation and its gradient as the stage returns them: bf16 tensors in a bf16 run)."""
    losses = []
    for x, y in data:
        h = x
        for w in workers[:-1]:
            h = w.forward(0, h)
            if seen is not None:
                seen.append(("activation", h.dtype))
        losses.append(workers[-1].forward(0, h, y))
        grad = None
        for w in reversed(workers):
            grad = w.backward(0, grad)
            if seen is not None and grad is not None:
                seen.append(("gradient", grad.dtype))
        for w in workers:
            w.step()
    return losses


def test_bf16_computes_in_bf16_between_stages_and_keeps_fp32_weights_gradients_and_moments():
    seen = []
    workers = chain(config("bf16"))
    losses = train(workers, batches(3), seen)
    assert {what: dtype for what, dtype in seen} == {"activation": torch.bfloat16, "gradient": torch.bfloat16}
    for w in workers:
        assert all(p.dtype == torch.float32 for p in w.module.parameters())
        moments = [t for st in w.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.numel() > 1]
        assert moments and all(t.dtype == torch.float32 for t in moments)
    fp32 = train(chain(config("fp32")), batches(3))
    assert fp32 != losses  # it did compute in bf16 ...
    np.testing.assert_allclose(losses, fp32, rtol=2e-2)  # ... close to the fp32 run
    x, y = batches(1, seed=5)[0]
    h = workers[0].forward(0, x)
    assert workers[1].forward(0, h, y) > 0 and all(p.grad is None or p.grad.dtype == torch.float32 for p in workers[0].module.parameters())


def test_the_same_seed_gives_the_same_bf16_losses_and_a_restore_continues_bit_for_bit():
    data = batches(5)
    cfg = config("bf16")
    first = chain(cfg)
    assert train(first, data[:2]) == train(chain(cfg), data[:2])
    saved = [(buf.copy(), manifest) for buf, manifest in (w.capture_state() for w in first)]
    assert all('"precision": "bf16"' in manifest for _, manifest in saved)
    want = train(first, data[2:])
    fresh = chain(cfg)
    assert [w.load_state(*s) for w, s in zip(fresh, saved)] == [2, 2]
    assert train(fresh, data[2:]) == want


def test_a_state_trained_in_fp32_resumes_in_bf16_and_back():
    data = batches(4)
    fp32 = chain(config("fp32"))
    train(fp32, data[:2])
    saved = [(buf.copy(), manifest) for buf, manifest in (w.capture_state() for w in fp32)]
    bf16 = chain(config("bf16"))
    assert [w.load_state(*s) for w, s in zip(bf16, saved)] == [2, 2]
    for a, b in zip(fp32, bf16):  # the fp32 master state, loaded as it was
        for (n, p), q in zip(a.module.named_parameters(), b.module.parameters()):
            assert torch.equal(p, q), n
    resumed = train(bf16, data[2:])
    np.testing.assert_allclose(resumed, train(fp32, data[2:]), rtol=2e-2)
    back = chain(config("fp32"))
    assert [w.load_state(buf.copy(), m) for w, (buf, m) in zip(back, (w.capture_state() for w in bf16))] == [4, 4]


def test_the_links_carry_bf16_bits_at_half_the_bytes_and_name_a_dtype_they_refuse():
    a, b = ShardKey(0, 0), ShardKey(1, 0)
    ts = linked([a, b])
    try:
        act = torch.randn(4, 16, 64).to(torch.bfloat16)
        ts[a].send(b, Msg.ACT, 0, 1, act)
        got = ts[b].recv(a, Msg.ACT, 0, 1)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), act.view(torch.int16))
        assert ts[a].sent[Msg.ACT] == act.numel() * 2  # half of float32's bytes
        ts[a].send(b, Msg.ACT, 1, 1, act.float())
        assert ts[b].recv(a, Msg.ACT, 1, 1).dtype == np.float32
        with pytest.raises(ProtocolError, match="only float32 and bfloat16 tensors travel between stages, got torch.float16"):
            ts[a].send(b, Msg.ACT, 2, 1, act.half())
    finally:
        close(ts)


def test_an_unknown_precision_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="train.precision='fp16' is unknown: use one of fp32, bf16"):
        load_config("jobs/tiny.yaml", ["train.precision=fp16"])


def saved_bytes(worker, x, y=None):
    """Bytes autograd keeps for the backward of one forward of ``worker`` (its saved tensors)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = worker.forward(0, x, y)
    return total[0], out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_keeps_less_for_the_backward_and_gives_the_same_gradients_bit_for_bit(precision):
    """``train.activation_checkpointing: layers``: each layer keeps only its input and runs again
    in the backward: the same losses, input gradients and parameter gradients, bit for bit (same
    kernels on the same inputs), with a fraction of the saved activations."""
    data = batches(3)
    plain = chain(config(precision))
    kept = chain(load_config("jobs/tiny.yaml", SMALL + [f"train.precision={precision}", "train.activation_checkpointing=layers"]))
    assert train(kept, data) == train(plain, data)
    for a, b in zip(plain, kept):
        for (n, p), q in zip(a.module.named_parameters(), b.module.parameters()):
            assert torch.equal(p, q), n
    x, _ = batches(1, seed=7)[0]
    full, h = saved_bytes(plain[0], x)
    less, h2 = saved_bytes(kept[0], x)
    assert torch.equal(h, h2) and less < 0.5 * full, (less, full)
    g1, g2 = plain[0].backward(0, torch.ones_like(h)), kept[0].backward(0, torch.ones_like(h2))
    assert g1 is None and g2 is None  # stage 0 starts from tokens
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain[0].module.parameters(), kept[0].module.parameters()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_with_checkpointing_the_head_loss_runs_in_chunks_that_keep_no_logits(precision):
    """A microbatch of more than ``LOSS_CHUNK`` tokens: the head's loss runs in chunks recomputed
    in the backward (no logits kept for it), and its loss and gradients equal the plain head's up
    to rounding (a sum of chunk sums over the token count is the same mean, in another order)."""
    from elastic_llm.model import LOSS_CHUNK, ModelShape, build_stage
    from elastic_llm.pipeline import device

    shape = ModelShape(vocab_size=512, dim=32, n_heads=2, n_layers=2, seq_len=LOSS_CHUNK, ffn_hidden=64)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, LOSS_CHUNK, 32, generator=g), torch.randint(0, 512, (3, LOSS_CHUNK), generator=g)
    def one(ck):
        m = build_stage(shape, 2, 1, 0)
        m.checkpoint_layers = ck
        kept = []
        inp = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda s: kept.append(s.untyped_storage().nbytes()) or s, lambda s: s):
            loss = device.forward(precision, torch.device("cpu"), lambda: m.run(inp, False, True, True, t), False)
        loss.backward()
        return loss.detach(), inp.grad, [p.grad for p in m.parameters()], max(kept)

    (l0, g0, p0, big0), (l1, g1, p1, big1) = one(False), one(True)
    tol = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(l1, l0, **tol)
    torch.testing.assert_close(g1, g0, **tol)
    for a, b in zip(p1, p0):
        torch.testing.assert_close(a, b, **tol)
    assert big0 >= 3 * LOSS_CHUNK * 512 * 4 > big1  # the plain head keeps the whole microbatch's log-probabilities; the chunks keep none
