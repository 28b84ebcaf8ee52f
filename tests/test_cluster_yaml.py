"""Tests of cluster.yaml, the Ray cluster launcher config for AWS.

Owns: that cluster.yaml passes the config preparation and schema validation ``ray up`` runs before
it talks to AWS (``prepare_config``, ``validate_config``), that the launcher refuses a typo'd key in
a copy of it, and the properties the cluster must keep: spot GPU workers over several instance
types, an on-demand head without GPUs, token authentication wherever Ray starts, a dashboard bound
to loopback, the spot watcher on every worker with flags the real CLI accepts, and setup that
installs ISA-L, the project and the Ray this machine runs.
Never: calls AWS (no bootstrap, no resource auto-detection), starts Ray, or uses the network.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from elastic_llm.cli import build_parser

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"
PROJECT_MOUNT = "~/elastic-llm"
TOKEN_FILE = "~/.ray/auth_token"
DASHBOARD_PORT = 8265
# EC2 families with accelerators: NVIDIA (p, g, gr), Gaudi (dl), Inferentia, Trainium, FPGA, video.
ACCELERATOR_FAMILY = re.compile(r"^(p|g|gr|dl|inf|trn|f|vt)\d")
NVIDIA_GPU_FAMILY = re.compile(r"^(p|g|gr)\d")
SHELL_OPERATOR = set("();<>|&")


def _load() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return _load()


@pytest.fixture(scope="module")
def prepared(cluster: dict[str, Any]) -> dict[str, Any]:
    """cluster.yaml as ``ray up`` has it after preparing it (defaults filled, setup merged)."""
    config = prepare_config(copy.deepcopy(cluster))
    validate_config(config)
    return config


def _head(cluster: dict[str, Any]) -> dict[str, Any]:
    return cluster["available_node_types"][cluster["head_node_type"]]


def _workers(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    types = cluster["available_node_types"]
    return {name: t for name, t in types.items() if name != cluster["head_node_type"]}


def _all_commands(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, command) for every shell command the launcher may run, node-type lists included."""
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    for key in keys:
        for cmd in config.get(key) or []:
            yield key, cmd
    for name, node_type in config["available_node_types"].items():
        for key in ("initialization_commands", "worker_setup_commands"):
            for cmd in node_type.get(key) or []:
                yield f"available_node_types.{name}.{key}", cmd


def _words(cmd: str) -> list[str]:
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def _spot_watcher_flags(cmd: str) -> list[str]:
    """The words after ``elastic-llm spot-watcher`` up to the first shell operator."""
    words = _words(cmd)
    for i in range(len(words) - 1):
        if words[i] == "elastic-llm" and words[i + 1] == "spot-watcher":
            flags = []
            for word in words[i + 2:]:
                if set(word) <= SHELL_OPERATOR:
                    break
                flags.append(word)
            return flags
    raise AssertionError(f"no `elastic-llm spot-watcher` in: {cmd}")


# ---------------------------------------------------------------------------------------------
# What `ray up` checks before it talks to AWS
# ---------------------------------------------------------------------------------------------


def test_ray_up_prepares_and_validates_it(prepared: dict[str, Any]) -> None:
    # the fixture ran prepare_config and validate_config; check what they are known to fill in
    assert prepared["cluster_synced_files"] == []
    for name, node_type in prepared["available_node_types"].items():
        assert "resources" in node_type, f"{name}: resources missing (the schema requires them)"


@pytest.mark.parametrize(
    "path, wrong",
    [
        (("idle_timeout_minutes",), "idle_timout_minutes"),
        (("available_node_types", "gpu-g5-spot", "min_workers"), "min_worker"),
        (("auth", "ssh_user"), "ssh_usr"),
    ],
    ids=["top-level", "node-type", "auth"],
)
def test_a_typo_is_refused_by_name(path: tuple[str, ...], wrong: str) -> None:
    config = _load()
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    parent[wrong] = parent.pop(path[-1])
    with pytest.raises(jsonschema.ValidationError) as refused:
        validate_config(prepare_config(config))
    assert wrong in refused.value.message


def test_provider_keys_are_ones_the_schema_names(cluster: dict[str, Any]) -> None:
    # the schema lets `provider` carry any key, so a typo there (cache_stoped_nodes) would be
    # silently ignored by `ray up`: hold the keys to the ones the schema lists
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    known = set(schema["properties"]["provider"]["properties"])
    unknown = set(cluster["provider"]) - known
    assert not unknown, f"provider keys Ray does not know: {sorted(unknown)}; fix the spelling"


def test_node_configs_are_run_instances_parameters(cluster: dict[str, Any]) -> None:
    # node_config goes to EC2's RunInstances as it is: check it against botocore's offline model of
    # that call (names, nesting, types, instance type names), which the launcher schema does not
    botocore_session = pytest.importorskip("botocore.session")
    from botocore.validate import ParamValidator

    shape = botocore_session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    for name, node_type in cluster["available_node_types"].items():
        node_config = node_type["node_config"]
        report = ParamValidator().validate({**node_config, "MinCount": 1, "MaxCount": 1}, shape)
        assert not report.has_errors(), f"{name}.node_config: {report.generate_report()}"
        assert node_config["InstanceType"] in shape.members["InstanceType"].enum, \
            f"{name}: {node_config['InstanceType']} is not an EC2 instance type"


# ---------------------------------------------------------------------------------------------
# The cluster's shape
# ---------------------------------------------------------------------------------------------


def test_every_worker_type_is_spot_and_there_are_several_gpu_types(cluster: dict[str, Any]) -> None:
    workers = _workers(cluster)
    for name, node_type in workers.items():
        market = node_type["node_config"].get("InstanceMarketOptions", {}).get("MarketType")
        assert market == "spot", f"{name}: InstanceMarketOptions.MarketType is {market!r}, not 'spot'"
        family = node_type["node_config"]["InstanceType"].split(".")[0]
        assert NVIDIA_GPU_FAMILY.match(family), f"{name}: {family} is not an NVIDIA GPU family"
        assert node_type["resources"].get("GPU", 0) >= 1, f"{name}: advertises no GPU"
    gpu_types = {t["node_config"]["InstanceType"] for t in workers.values()}
    assert len(gpu_types) >= 2, f"one spot GPU instance type ({gpu_types}): add another for capacity"
    assert cluster["max_workers"] >= max(t["max_workers"] for t in workers.values())


def test_head_is_on_demand_without_gpu(cluster: dict[str, Any]) -> None:
    head = _head(cluster)
    assert "InstanceMarketOptions" not in head["node_config"], "the head must be on-demand"
    assert head["resources"].get("GPU", 0) == 0
    family = head["node_config"]["InstanceType"].split(".")[0]
    assert not ACCELERATOR_FAMILY.match(family), f"the head's {family} is an accelerator family"
    assert head.get("max_workers", 0) == 0


def test_spot_nodes_are_terminated_not_stopped(cluster: dict[str, Any]) -> None:
    assert cluster["provider"]["type"] == "aws"
    assert cluster["provider"]["cache_stopped_nodes"] is False
    assert cluster["auth"]["ssh_user"] == "ubuntu"


# ---------------------------------------------------------------------------------------------
# Security: token auth, loopback dashboard
# ---------------------------------------------------------------------------------------------


def test_every_ray_start_sets_token_auth(cluster: dict[str, Any]) -> None:
    keys = ("head_start_ray_commands", "worker_start_ray_commands")
    starts = [c for k in keys for c in cluster[k] if "ray start" in c]
    assert len(starts) >= 2
    for cmd in starts:
        auth = cmd.find("RAY_AUTH_MODE=token")
        assert 0 <= auth < cmd.index("ray start"), f"ray start without RAY_AUTH_MODE=token before it: {cmd}"


def test_head_binds_the_dashboard_to_loopback_and_runs_the_autoscaler(cluster: dict[str, Any]) -> None:
    (start,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    words = _words(start)
    assert "--head" in words
    assert "--dashboard-host=127.0.0.1" in words
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in words, "without it no worker is launched"


def test_no_command_binds_all_interfaces(prepared: dict[str, Any]) -> None:
    # every host a command binds to (--dashboard-host=..., --node-ip-address=..., --host ...) is loopback
    for where, cmd in _all_commands(prepared):
        words = _words(cmd)
        for i, w in enumerate(words):
            flag, _, value = w.partition("=")
            if flag.endswith("-host") or flag == "--node-ip-address":
                value = value or (words[i + 1] if i + 1 < len(words) else "")
                assert value == "127.0.0.1", f"{where}: {flag} {value!r} is not loopback: {cmd}"


def test_no_security_group_rule_opens_the_dashboard(cluster: dict[str, Any]) -> None:
    rules = cluster["provider"].get("security_group", {}).get("IpPermissions", [])
    for rule in rules:
        low, high = rule.get("FromPort", 0), rule.get("ToPort", 65535)
        assert not low <= DASHBOARD_PORT <= high, f"a security-group rule opens {DASHBOARD_PORT}: {rule}"


def test_the_auth_token_is_mounted_and_exported_for_later_shells(prepared: dict[str, Any]) -> None:
    assert prepared["file_mounts"].get(TOKEN_FILE) == TOKEN_FILE
    bashrc = [c for c in prepared["setup_commands"] if "export RAY_AUTH_MODE=token" in c and "~/.bashrc" in c]
    assert bashrc, "setup must append `export RAY_AUTH_MODE=token` to ~/.bashrc (ray job submit on the head)"


# ---------------------------------------------------------------------------------------------
# Setup: ISA-L, torch, the project, the pinned Ray
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["head", "worker"])
def test_setup_installs_isal_and_the_project(prepared: dict[str, Any], node: str) -> None:
    setup = prepared[f"{node}_setup_commands"]  # setup_commands merged in by prepare_config
    assert any("apt-get" in c and "install" in c and "libisal2" in c for c in setup), f"{node}: no libisal2"
    assert prepared["file_mounts"].get(PROJECT_MOUNT) == ".", f"the checkout is not mounted at {PROJECT_MOUNT}"
    installs = [c for c in setup if "pip install" in c and PROJECT_MOUNT in _words(c)]
    assert installs, f"{node}: no `pip install -e {PROJECT_MOUNT}`"
    assert any(re.search(r"\btorch==", c) for c in setup), f"{node}: torch is not installed (pinned)"


def test_no_quoted_tilde(prepared: dict[str, Any]) -> None:
    # bash expands ~ only unquoted: pip install -e "~/elastic-llm" would look for a directory named ~
    for where, cmd in _all_commands(prepared):
        assert not re.search(r"[\"']~", cmd), f"{where}: quoted ~ is not expanded: {cmd}"


def test_ray_pin_is_the_installed_ray(prepared: dict[str, Any]) -> None:
    for node in ("head", "worker"):
        pins = [m for c in prepared[f"{node}_setup_commands"] for m in re.findall(r"\bray\[([^\]]*)\]==([\w.]+)", c)]
        assert pins, f"{node}: Ray is not pinned in setup (the launcher would resolve another)"
        for extras, version in pins:
            assert version == ray.__version__, f"{node}: pins ray {version}, this machine runs {ray.__version__}"
            assert {"default", "train"} <= {e.strip() for e in extras.split(",")}


def test_torch_is_the_same_version_on_head_and_workers(prepared: dict[str, Any]) -> None:
    def pins(node: str) -> set[str]:
        return {v for c in prepared[f"{node}_setup_commands"] for v in re.findall(r"\btorch==([\w.]+)", c)}

    assert len(pins("head")) == 1 and pins("head") == pins("worker"), (pins("head"), pins("worker"))


# ---------------------------------------------------------------------------------------------
# The spot watcher
# ---------------------------------------------------------------------------------------------


def test_every_worker_starts_the_spot_watcher_after_ray(cluster: dict[str, Any]) -> None:
    starts = cluster["worker_start_ray_commands"]
    ray_at = [i for i, c in enumerate(starts) if "ray start" in c]
    watcher_at = [i for i, c in enumerate(starts) if "elastic-llm spot-watcher" in c]
    assert ray_at and watcher_at, "worker_start_ray_commands must start Ray and then the spot watcher"
    assert min(watcher_at) > max(ray_at)
    for i in watcher_at:
        words = _words(starts[i])
        assert "nohup" in words and "&" in words, f"the watcher must run in the background: {starts[i]}"
        auth = starts[i].find("RAY_AUTH_MODE=token")
        assert 0 <= auth < starts[i].index("elastic-llm spot-watcher"), "the watcher joins Ray: it needs token auth"
    assert all("spot-watcher" not in c for c in cluster["head_start_ray_commands"]), "the head is on-demand"


def _subcommand_options(parser: argparse.ArgumentParser, name: str) -> set[str]:
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(subparsers.choices[name]._option_string_actions)


def test_every_spot_watcher_flag_is_accepted_by_the_cli(prepared: dict[str, Any]) -> None:
    parser = build_parser()
    # spelled out in full: argparse also accepts a prefix (--interval for --interval-s), which
    # would break the day another flag shares the prefix
    options = _subcommand_options(parser, "spot-watcher")
    seen = 0
    for where, cmd in _all_commands(prepared):
        if "elastic-llm spot-watcher" not in cmd:
            continue
        seen += 1
        flags = [f for f in _spot_watcher_flags(cmd) if f not in ("--help", "-h")]
        for flag in flags:
            if flag.startswith("-"):
                assert flag.split("=", 1)[0] in options, \
                    f"{where}: spot-watcher has no option {flag} (it has {sorted(options)})"
        try:
            args = parser.parse_args(["spot-watcher", *flags])
        except SystemExit:
            pytest.fail(f"{where}: `elastic-llm spot-watcher {' '.join(flags)}` is refused by the CLI parser")
        assert args.command == "spot-watcher"
    assert seen, "cluster.yaml never runs `elastic-llm spot-watcher`"


def test_head_sets_fast_node_failure_detection_that_ray_start_accepts(cluster: dict[str, Any]) -> None:
    import json
    import shlex

    from ray.scripts.scripts import start

    (command,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    args = shlex.split(command.split("ray start", 1)[1])
    (flag,) = [a for a in args if a.startswith("--system-config=")]
    config = json.loads(flag.split("=", 1)[1])
    # a vanished node is declared dead after threshold missed checks: within 5 s, not Ray's ~15 s
    detect_ms = config["health_check_failure_threshold"] * (config["health_check_period_ms"] + config.get("health_check_timeout_ms", 0))
    assert detect_ms <= 6000, config
    ctx = start.make_context("start", args, resilient_parsing=True)  # ray start's own parser takes the flag
    assert ctx.params["system_config"] == config


def test_workers_say_they_are_spot_and_the_head_gives_runs_a_durable_tier(cluster: dict[str, Any]) -> None:
    """Each worker's Ray node carries the label a run reads to know it is on spot nodes (its
    market, from EC2's metadata), in the form ``ray start`` parses; the head makes the S3 bucket
    of the runs' durable tier (the Python it runs compiles) and exports its URI where Ray starts,
    so ``durable.storage_path: cluster`` finds it."""
    from ray._private.label_utils import parse_node_labels_string
    from ray.scripts.scripts import start

    from elastic_llm.config.loading import DURABLE_ENV
    from elastic_llm.config.rules import SPOT_LABEL

    (command,) = [c for c in cluster["worker_start_ray_commands"] if "ray start" in c]
    expanded = command.replace("${MARKET:-spot}", "spot").replace("${ZONE:+,elastic-llm.io/failure-domain=$ZONE}", ",elastic-llm.io/failure-domain=us-west-2a")
    ctx = start.make_context("start", shlex.split(expanded.split("ray start", 1)[1]), resilient_parsing=True)
    assert parse_node_labels_string(ctx.params["labels"]) == {SPOT_LABEL: "spot", "elastic-llm.io/failure-domain": "us-west-2a"}
    assert "instance-life-cycle" in command
    (head,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    assert head.index(f"export {DURABLE_ENV}=") < head.index("ray start")
    (bucket,) = [c for c in cluster["head_setup_commands"] if "create_bucket" in c]
    compile(shlex.split(bucket.split("python3 -c", 1)[1])[0], "head-setup", "exec")
    assert "~/.elastic-llm-durable" in bucket and "~/.elastic-llm-durable" in head
