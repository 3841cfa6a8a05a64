"""Tests of hipress.config: strict validation, readable errors, precedence, round trips."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from hipress.config import (
    HiPressConfig,
    config_from_dict,
    dump_effective,
    load_config,
    summarize_effective,
)
from hipress.errors import ConfigError, HiPressError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def _write(tmp_path, text, name="job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _error(data):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, origin="job.yaml")
    return str(info.value)


# ----------------------------------------------------------------------------- defaults
def test_defaults_match_schema():
    cfg = load_config(env={})
    assert cfg == HiPressConfig()
    assert cfg.job.command == [] and cfg.job.args == []
    assert cfg.cluster.np == 1 and cfg.cluster.hosts is None and cfg.cluster.env == {}
    assert cfg.compression.algorithm == "none"
    assert cfg.compression.memory == "auto"
    assert cfg.compression.min_compress_bytes == 65536
    assert cfg.compression.warmup_steps == 0 and cfg.compression.rules == []
    assert cfg.sync.strategy == "auto" and cfg.sync.partitions is None
    assert cfg.sync.partition_bytes == 4194304
    assert cfg.sync.fusion_threshold_bytes == 67108864
    assert cfg.sync.cycle_time_ms == 20.0
    assert cfg.sync.stall_warning_s == 60.0 and cfg.sync.stall_shutdown_s == 0.0
    assert cfg.sync.compute_threads == 0 and cfg.sync.plan == "none"
    assert cfg.sync.plan_observe_steps == 3 and cfg.sync.plan_save is None
    assert cfg.timeline is None and cfg.logging.level == "INFO"


def test_empty_yaml_file_is_defaults(tmp_path):
    assert load_config(_write(tmp_path, ""), env={}) == HiPressConfig()
    assert load_config(_write(tmp_path, "# only a comment\n"), env={}) == HiPressConfig()


# ----------------------------------------------------------------------------- unknown keys
def test_unknown_key_names_path_and_valid_keys():
    msg = _error({"compression": {"algoritm": "onebit"}})
    assert "invalid HiPress config in job.yaml" in msg
    assert ("compression.algoritm: unknown key (did you mean 'algorithm'?); valid keys: "
            "algorithm, params, memory, min_compress_bytes, warmup_steps, rules") in msg


def test_unknown_top_level_key():
    msg = _error({"compresion": {}})
    assert "compresion: unknown key (did you mean 'compression'?); valid keys: job, cluster, " \
           "compression, sync, timeline, logging" in msg


def test_unknown_key_inside_rule_list_item():
    msg = _error({"compression": {"rules": [{"pattern": "*.bias"}, {"patern": "x"}]}})
    assert "compression.rules[1].patern: unknown key (did you mean 'pattern'?); valid keys: " \
           "pattern, algorithm, params" in msg
    assert "compression.rules[1].pattern: required key is missing" in msg


def test_unknown_keys_in_sync_cluster_job_logging():
    assert "sync.stall_shutdown: unknown key (did you mean 'stall_shutdown_s'?)" in _error(
        {"sync": {"stall_shutdown": 5}})
    assert "cluster.nodes: unknown key; valid keys: np, hosts, hostfile, network_interface, " \
           "ssh_port, env" in _error({"cluster": {"nodes": 2}})
    assert "job.cmd: unknown key" in _error({"job": {"cmd": ["x"]}})
    assert "logging.lvl: unknown key" in _error({"logging": {"lvl": "INFO"}})


# ----------------------------------------------------------------------------- types/ranges
@pytest.mark.parametrize(
    "data, expected",
    [
        ({"cluster": {"np": 0}}, "cluster.np: expected a value >= 1, got 0"),
        ({"cluster": {"np": "4"}}, "cluster.np: expected an integer, got '4'"),
        ({"cluster": {"np": True}}, "cluster.np: expected an integer, got True"),
        ({"cluster": {"np": 2.5}}, "cluster.np: expected an integer, got 2.5"),
        ({"cluster": {"ssh_port": 70000}}, "cluster.ssh_port: expected a value <= 65535"),
        ({"sync": {"stall_shutdown_s": -1}}, "sync.stall_shutdown_s: expected a value >= 0"),
        ({"sync": {"stall_warning_s": 0}}, "sync.stall_warning_s: expected a value > 0"),
        ({"sync": {"stall_warning_s": float("inf")}},
         "sync.stall_warning_s: expected a finite number, got inf"),
        ({"sync": {"stall_shutdown_s": float("nan")}},
         "sync.stall_shutdown_s: expected a finite number, got nan"),
        ({"sync": {"cycle_time_ms": float("inf")}},
         "sync.cycle_time_ms: expected a finite number, got inf"),
        ({"sync": {"cycle_time_ms": -1.0}}, "sync.cycle_time_ms: expected a value > 0"),
        ({"sync": {"partitions": 0}}, "sync.partitions: expected a value >= 1, got 0"),
        ({"sync": {"compute_threads": -1}}, "sync.compute_threads: expected a value >= 0"),
        ({"sync": {"plan_observe_steps": -1}},
         "sync.plan_observe_steps: expected a value >= 0, got -1"),
        ({"sync": {"strategy": "allreduce"}},
         "sync.strategy: expected one of 'auto', 'ps' or 'ring', got 'allreduce'"),
        ({"compression": {"memory": "ef"}},
         "compression.memory: expected one of 'auto', 'none', 'residual' or 'dgc', got 'ef'"),
        ({"compression": {"min_compress_bytes": -1}},
         "compression.min_compress_bytes: expected a value >= 0, got -1"),
        ({"compression": {"warmup_steps": "ten"}},
         "compression.warmup_steps: expected an integer, got 'ten'"),
        ({"compression": {"rules": {"pattern": "*"}}}, "compression.rules: expected a list"),
        ({"compression": 5}, "compression: expected a mapping (key: value), got 5"),
        ({"timeline": 3}, "timeline: expected a string, got 3"),
        ({"logging": {"level": "LOUD"}},
         "logging.level: unknown log level 'LOUD'; valid levels: DEBUG, INFO, WARNING"),
        ({"job": {"command": [True]}}, "must be a string, not a boolean"),
        ({"cluster": {"env": {"A": True}}}, "the value of A must be a string, not a boolean"),
    ],
)
def test_wrong_types_and_ranges_say_what_is_expected(data, expected):
    assert expected in _error(data)


def test_all_problems_reported_at_once():
    msg = _error({"cluster": {"np": 0}, "sync": {"strategy": "x"}, "foo": 1})
    lines = msg.splitlines()
    assert lines[0] == "invalid HiPress config in job.yaml:"
    assert len(lines) == 4
    assert any(line.startswith("  cluster.np:") for line in lines)
    assert any(line.startswith("  sync.strategy:") for line in lines)
    assert any(line.startswith("  foo: unknown key") for line in lines)


def test_config_error_is_value_error_and_hipress_error():
    with pytest.raises(ValueError):
        config_from_dict({"x": 1})
    with pytest.raises(HiPressError):
        config_from_dict({"x": 1})


def test_log_level_any_case_is_normalized():
    assert config_from_dict({"logging": {"level": "debug"}}).logging.level == "DEBUG"


# ----------------------------------------------------------------------------- compression
def test_unknown_algorithm_lists_valid_codecs():
    from hipress.codecs import codec_names

    msg = _error({"compression": {"algorithm": "onebitt"}})
    assert "compression.algorithm: unknown codec 'onebitt'" in msg
    assert "valid codecs: " + ", ".join(codec_names()) in msg
    assert "ending in .hpc" in msg
    msg = _error({"compression": {"rules": [{"pattern": "*", "algorithm": "zip"}]}})
    assert "compression.rules[0].algorithm: unknown codec 'zip'" in msg


def test_every_registered_codec_and_hpc_path_accepted():
    from hipress.codecs import codec_names

    for name in codec_names():
        assert config_from_dict({"compression": {"algorithm": name}}).compression.algorithm == name
    cfg = config_from_dict({"compression": {"algorithm": "specs/mine.hpc", "params": {"k": 1}}})
    assert cfg.compression.algorithm == "specs/mine.hpc"
    assert cfg.compression.params == {"k": 1}


def test_codec_params_checked_against_constructor():
    msg = _error({"compression": {"algorithm": "topk", "params": {"ratoi": 0.01}}})
    assert "compression.params: unknown parameter(s) 'ratoi' for codec 'topk'; " \
           "valid parameters: ratio" in msg
    msg = _error({"compression": {"algorithm": "topk", "params": {"ratio": 2.0}}})
    assert "compression.params: codec 'topk' refuses these params:" in msg and "2.0" in msg
    msg = _error({"compression": {"algorithm": "fp16", "params": {"ratio": 0.1}}})
    assert "valid parameters: (none)" in msg
    cfg = config_from_dict({"compression": {"algorithm": "topk", "params": {"ratio": 0.01}}})
    assert cfg.compression.params == {"ratio": 0.01}


def test_rules_parse_with_defaults():
    cfg = config_from_dict({"compression": {"rules": [
        {"pattern": "*.bias"}, {"pattern": "fc*", "algorithm": "topk", "params": {"ratio": 0.1}}]}})
    r0, r1 = cfg.compression.rules
    assert (r0.pattern, r0.algorithm, r0.params) == ("*.bias", "none", {})
    assert (r1.pattern, r1.algorithm, r1.params) == ("fc*", "topk", {"ratio": 0.1})
    assert "compression.rules[0].pattern: expected a non-empty string" in _error(
        {"compression": {"rules": [{"pattern": ""}]}})


# ----------------------------------------------------------------------------- job/cluster
def test_command_string_is_split_without_shell_and_numbers_become_strings():
    cfg = config_from_dict({"job": {"command": "python train.py --name 'a b' $HOME",
                                    "args": ["--epochs", 5, "--lr", 0.5]}})
    assert cfg.job.command == ["python", "train.py", "--name", "a b", "$HOME"]
    assert cfg.job.args == ["--epochs", "5", "--lr", "0.5"]
    assert "cannot split job.command" in _error({"job": {"command": "python 'unclosed"}})


def test_cluster_hosts_and_env():
    cfg = config_from_dict({"cluster": {"hosts": "node-1:2,10.0.0.3:1", "env": {"N": 4}}})
    assert cfg.cluster.hosts == "node-1:2,10.0.0.3:1"
    assert cfg.cluster.env == {"N": "4"}
    assert config_from_dict({"cluster": {"hosts": ["a:2", "b:2"]}}).cluster.hosts == ["a:2", "b:2"]
    assert "separate hosts with commas, not spaces" in _error({"cluster": {"hosts": "a:2 b:2"}})
    assert "at least 1 slot" in _error({"cluster": {"hosts": "a:0"}})
    assert "give either hosts or hostfile, not both" in _error(
        {"cluster": {"hosts": "a:1", "hostfile": "hf"}})


# ----------------------------------------------------------------------------- files
def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"), env={})
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(_write(tmp_path, "sync: [unclosed\n"), env={})
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(_write(tmp_path, "- a\n- b\n"), env={})
    with pytest.raises(ConfigError, match="found duplicate key 'strategy'"):
        load_config(_write(tmp_path, "sync:\n  strategy: ps\n  strategy: ring\n"), env={})
    path = _write(tmp_path, "sync:\n  strategy: tree\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"invalid HiPress config in {path}:")


# ----------------------------------------------------------------------------- precedence
def test_precedence_defaults_yaml_env_overrides(tmp_path):
    path = _write(tmp_path, "sync:\n  strategy: ps\n  stall_timeout_s: 30\n"
                            "compression:\n  algorithm: fp16\ntimeline: /yaml.json\n")
    # YAML over defaults (keys not in the file keep their defaults).
    cfg = load_config(path, env={})
    assert (cfg.sync.strategy, cfg.sync.stall_shutdown_s) == ("ps", 30.0)  # the old key
    assert cfg.compression.algorithm == "fp16" and cfg.timeline == "/yaml.json"
    assert cfg.sync.cycle_time_ms == 20.0
    # Environment over YAML.
    env = {"HIPRESS_STRATEGY": "ring", "HIPRESS_STALL_TIMEOUT": "2.5",
           "HIPRESS_COMPRESSION": "bf16", "HIPRESS_TIMELINE": "/env.json",
           "HIPRESS_LOG_LEVEL": "debug"}
    cfg = load_config(path, env=env)
    assert (cfg.sync.strategy, cfg.sync.stall_shutdown_s) == ("ring", 2.5)
    assert cfg.compression.algorithm == "bf16" and cfg.timeline == "/env.json"
    assert cfg.logging.level == "DEBUG"
    # Overrides over environment.
    cfg = load_config(path, env=env, overrides={"sync.strategy": "ps", "timeline": None,
                                                "compression.params.ratio": 0.1,
                                                "compression.algorithm": "topk"})
    assert cfg.sync.strategy == "ps" and cfg.timeline is None
    assert cfg.compression.algorithm == "topk" and cfg.compression.params == {"ratio": 0.1}
    assert cfg.sync.stall_shutdown_s == 2.5  # untouched keys keep the env value


def test_switching_codec_drops_the_old_codecs_params(tmp_path):
    path = _write(tmp_path, "compression:\n  algorithm: topk\n  params: {ratio: 0.05}\n")
    cfg = load_config(path, env={"HIPRESS_COMPRESSION": "onebit"})
    assert cfg.compression.algorithm == "onebit" and cfg.compression.params == {}
    cfg = load_config(path, env={"HIPRESS_COMPRESSION": "topk"})  # same codec: params kept
    assert cfg.compression.params == {"ratio": 0.05}
    cfg = load_config(path, env={}, overrides={"compression.params.ratio": 0.2,
                                               "compression.algorithm": "randomk"})
    assert cfg.compression.algorithm == "randomk" and cfg.compression.params == {"ratio": 0.2}


def test_hipress_config_env_names_the_file(tmp_path):
    path = _write(tmp_path, "cluster:\n  np: 3\n")
    other = _write(tmp_path, "cluster:\n  np: 5\n", "other.yaml")
    assert load_config(env={"HIPRESS_CONFIG": path}).cluster.np == 3
    assert load_config(other, env={"HIPRESS_CONFIG": path}).cluster.np == 5  # path wins
    assert load_config(env={"HIPRESS_CONFIG": ""}) == HiPressConfig()  # empty = unset
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(env={"HIPRESS_CONFIG": str(tmp_path / "missing.yaml")})


def test_process_environment_is_read_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HIPRESS_CONFIG", _write(tmp_path, "sync:\n  strategy: ps\n"))
    monkeypatch.setenv("HIPRESS_STALL_TIMEOUT", "7")
    cfg = load_config()
    assert cfg.sync.strategy == "ps" and cfg.sync.stall_shutdown_s == 7.0


def test_empty_env_values_are_ignored(tmp_path):
    cfg = load_config(env={"HIPRESS_STRATEGY": "", "HIPRESS_TIMELINE": ""})
    assert cfg.sync.strategy == "auto" and cfg.timeline is None


def test_errors_name_their_source(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(env={"HIPRESS_STRATEGY": "tree"})
    assert "sync.strategy: expected one of 'auto', 'ps' or 'ring', got 'tree' " \
           "(from environment HIPRESS_STRATEGY)" in str(info.value)
    with pytest.raises(ConfigError, match=r"HIPRESS_STALL_TIMEOUT='soon' must be a number"):
        load_config(env={"HIPRESS_STALL_TIMEOUT": "soon"})
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"cluster.np": 0})
    assert "cluster.np: expected a value >= 1, got 0 (from override)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"sync.strategi": "ps"})
    assert "sync.strategi: unknown key (did you mean 'strategy'?)" in str(info.value)
    assert "(from override)" in str(info.value)
    with pytest.raises(ConfigError, match="timeline is '/t.json', not a mapping"):
        load_config(env={}, overrides={"timeline": "/t.json", "timeline.x": 1})


def test_override_with_mapping_value():
    cfg = load_config(env={}, overrides={"sync": {"strategy": "ring", "partitions": 2}})
    assert cfg.sync.strategy == "ring" and cfg.sync.partitions == 2


# ----------------------------------------------------------------------------- output
def test_to_yaml_round_trip(tmp_path):
    cfg = config_from_dict({
        "job": {"command": ["python", "t.py"], "args": ["--x", "a b"]},
        "cluster": {"np": 3, "env": {"Q": 'has "quotes"'}},
        "compression": {"algorithm": "topk", "params": {"ratio": 0.05},
                        "rules": [{"pattern": "*.bias", "algorithm": "none"}]},
        "sync": {"strategy": "ring", "partitions": 4},
        "timeline": "/tmp/t.json",
    })
    text = cfg.to_yaml()
    assert load_config(_write(tmp_path, text), env={}) == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
    assert HiPressConfig.from_yaml(_write(tmp_path, text, "b.yaml")) == cfg
    assert list(yaml.safe_load(text)) == ["job", "cluster", "compression", "sync", "timeline",
                                          "logging", "transport"]


def test_dump_effective():
    cfg = config_from_dict({"compression": {"algorithm": "onebit"}})
    text = dump_effective(cfg)
    lines = text.splitlines()
    assert lines[0] == "effective HiPress config:"
    assert "    algorithm: onebit" in lines
    assert yaml.safe_load("\n".join(line[2:] for line in lines[1:])) == cfg.to_dict()


def test_summarize_effective_is_one_line_with_code_overrides():
    cfg = config_from_dict({"compression": {"algorithm": "onebit", "min_compress_bytes": 4096,
                                            "rules": [{"pattern": "*.bias"}]},
                            "cluster": {"np": 1}, "sync": {"stall_timeout_s": 20}})
    line = summarize_effective(cfg, 2, 2, {"DistributedOptimizer": "dgc"})
    assert line == (
        "HiPress: 2 ranks (2 on this host) | gradients: dgc (DistributedOptimizer) | "
        "policy: onebit, min 4 KiB, warm-up 0, memory auto, rules *.bias->none | sync: auto, "
        "partitions 4 MiB, fusion 64 MiB, cycle 20-80 ms, stall warning 60 s, shutdown 20 s, "
        "plan none | timeline off")
    plain = summarize_effective(config_from_dict({}), 1, 1)
    assert plain.startswith("HiPress: 1 rank (1 on this host) | policy: none, min 64 KiB")
    assert "gradients:" not in plain and "\n" not in plain
    fixed = config_from_dict({"sync": {"cycle_time_ms": 20, "max_cycle_time_ms": 20}})
    assert ", cycle 20 ms," in summarize_effective(fixed, 1, 1)
    # a longest cycle under the cycle counts as the cycle (the engine takes the larger)
    long_ = config_from_dict({"sync": {"cycle_time_ms": 100, "max_cycle_time_ms": 80}})
    assert ", cycle 100 ms," in summarize_effective(long_, 1, 1)


# ----------------------------------------------------------------------------- configs/
def test_configs_directory_has_the_examples():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"default.yaml", "digits-torch.yaml", "dgc-ring.yaml", "powersgd.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_file_loads(path):
    cfg = load_config(path, env={})
    assert isinstance(cfg, HiPressConfig)


def test_default_yaml_lists_every_key_with_its_default():
    path = os.path.join(REPO, "configs", "default.yaml")
    with open(path) as fh:
        raw = yaml.safe_load(fh)
    assert raw == HiPressConfig().to_dict()
    assert load_config(path, env={}) == HiPressConfig()


def test_digits_torch_job():
    cfg = load_config(os.path.join(REPO, "configs", "digits-torch.yaml"), env={})
    assert cfg.job.command == ["python", "examples/torch/train_digits.py"]
    assert cfg.job.args == ["--epochs", "5"]
    assert cfg.cluster.np == 4
    assert cfg.compression.algorithm == "onebit"
    assert cfg.sync.strategy == "auto"
    assert cfg.compression.rules[0].pattern == "*.bias"
    assert cfg.compression.rules[0].algorithm == "none"
    assert cfg.compression.min_compress_bytes > 0


def test_fusion_threshold_and_cycle_time_from_the_environment():
    cfg = load_config(env={"HIPRESS_FUSION_THRESHOLD": "1048576", "HIPRESS_CYCLE_TIME": "2.5"})
    assert cfg.sync.fusion_threshold_bytes == 1 << 20
    assert cfg.sync.cycle_time_ms == 2.5
    with pytest.raises(ConfigError, match="HIPRESS_FUSION_THRESHOLD='64MB' must be an integer"):
        load_config(env={"HIPRESS_FUSION_THRESHOLD": "64MB"})
    with pytest.raises(ConfigError, match="number of milliseconds"):
        load_config(env={"HIPRESS_CYCLE_TIME": "fast"})
