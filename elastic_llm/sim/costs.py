"""The simulation's cost model: what each simulated operation takes, from a small YAML profile.

Owns: :class:`CostModel` (the figures: compute per sequence and stage, gradient exchange, process
start, warm standby adoption, failure detection, state transfer, snapshot copy, parity and
durable flush bandwidths), loading a profile by name (``cpu-2core``: measured by this project's benchmarks on
its 2-core VM by ``elastic-llm bench calibrate`` from the benchmarks, never from a replay;
``gpu-a100``: derived from published figures, marked as such in the file) or from
a path, and the arithmetic of a step's and a transfer's simulated seconds. Never reads a clock,
never runs anything: :mod:`elastic_llm.sim.actors` and :mod:`elastic_llm.sim.snapshots` ask it how long things take.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import yaml

PROFILES = Path(__file__).with_name("profiles")
MB = 1e6


class CostError(ValueError):
    """A cost profile is missing or malformed; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class CostModel:
    name: str
    provenance: str  # where the figures come from: "measured ..." or "published ..."
    seq_stage_s: float  # forward + backward of one sequence through one stage
    allreduce_s: float  # the gradient exchange and optimizer update at the end of a step
    actor_start_s: float  # a new stage process: start, import, build its layers
    adopt_s: float  # a warm standby becomes a stage (its process is already up)
    detect_process_s: float  # a stage process died: until its step's call fails
    detect_node_s: float  # a node died: until the run's node probe declares it dead
    network_mb_s: float  # stage state copied actor to actor (dp peer, drain move, grow)
    restore_mb_s: float  # a stage loads its state from its node's snapshot manager
    parity_mb_s: float  # parity encode (per version) and decode (per rebuilt shard), per node
    copy_mb_s: float  # a stage's snapshot copy into its node's object store
    flush_mb_s: float  # a node's manager writes (and a stage reads back) durable checkpoint shards
    state_bytes_per_param: float = 12.0  # fp32 weights + two Adam moments
    cores: float = 0.0  # > 0: every simulated node shares this many cores (a loopback cluster on one machine); 0: each actor has its own device
    snapshot_step_s: float = 0.0  # what a step that begins a snapshot version costs beyond a clean one (copies, parity, object moves)
    call_cpu_s: float = 0.0  # the driver's CPU per actor call (bench transport's driver_calls); 0: not charged
    relayed_cpu_s: float = 0.0  # the driver's CPU per stage report relayed by its replica's stage 0 (bench transport's relayed_report_us)
    sequence_tokens: int = 0  # tokens of the sequence seq_stage_s is for (a report's tokens and tokens per dollar); 0: the config's model.seq_len
    replica_s: float = 0.0  # on shared cores: what each replica beyond the first adds to a step besides the exchange (its calls, update, snapshot slice)
    # recovery.mode redundant: what each stage's copy of its successor adds to its compute and exchange (its forward and backward
    # over every microbatch, its gradients in the replicas' sum): bench convergence's redundant step on tiny, 1.77-1.87x of no fault
    # tolerance (median 1.79x); a profile may set its own. Bamboo hides part of this in pipeline bubbles, which is not modelled.
    redundant_extra: float = 0.79

    def step_s(self, stages: int, microbatches: int, batch: int, width: int, snapshot: bool = False, redundant: bool = False) -> float:
        """One 1F1B step: (m + S - 1) slots of a microbatch of batch / (width x m) sequences, or,
        on shared cores, the whole step's work over the cores when that takes longer (the other
        actors fill a stage's bubble, and each replica beyond the first adds ``replica_s``); then
        the gradient exchange (both ``redundant_extra`` more with redundant copies), and the
        snapshot's cost."""
        per_mb = batch / (width * microbatches)
        compute = (microbatches + stages - 1) * per_mb * self.seq_stage_s
        if self.cores > 0:
            compute = max(compute, batch * stages * self.seq_stage_s / self.cores + (width - 1) * self.replica_s)
        work = compute + (self.allreduce_s if width > 1 else 0.0)
        return work * (1.0 + (self.redundant_extra if redundant else 0.0)) + (self.snapshot_step_s if snapshot else 0.0)

    def shard_mb(self, parameters: int, stages: int, width: int) -> float:
        """Megabytes of one (stage, replica) shard of the training state (a 1/width slice)."""
        return parameters * self.state_bytes_per_param / stages / max(width, 1) / MB

    def stage_mb(self, parameters: int, stages: int) -> float:
        """Megabytes of one stage's whole training state."""
        return parameters * self.state_bytes_per_param / stages / MB

    def describe(self) -> str:
        return f"cost model {self.name!r} ({self.provenance})"


def load_costs(name_or_path: str) -> CostModel:
    """A profile by name (a file in ``elastic_llm/sim/profiles``) or path."""
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILES / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PROFILES.glob("*.yaml"))
        raise CostError(f"cost model {name_or_path!r} is neither a file nor a profile: pass a YAML file or one of {known}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CostError(f"{path}: not valid YAML ({e}): fix the file") from None
    if not isinstance(raw, dict):
        raise CostError(f"{path}: a cost model is a mapping of figures: see {PROFILES / 'cpu-2core.yaml'}")
    names = {f.name for f in fields(CostModel)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise CostError(f"{path}: unknown field(s) {unknown}: the fields are {sorted(names)}")
    missing = sorted(f.name for f in fields(CostModel) if f.name not in raw and f.default is MISSING)
    if missing:
        raise CostError(f"{path}: missing field(s) {missing}: every figure must be given")
    for f in fields(CostModel):
        if f.name in ("name", "provenance") or f.name not in raw:
            continue
        v = raw[f.name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise CostError(f"{path}: {f.name}={v!r} must be a number >= 0 (seconds, or MB/s for bandwidths)")
        if f.name.endswith("_mb_s") and v == 0:
            raise CostError(f"{path}: {f.name}=0: a bandwidth must be > 0")
    return CostModel(**{**raw, "name": str(raw["name"]), "provenance": str(raw["provenance"])})
