"""Configuration layers: run spec < SWARMGRAD_* environment < command line, with errors that say
which layer holds the bad value."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from swarmgrad.node.config import CommandLine, ConfigError, home, node_config
from swarmgrad.node.runspec import ModelSection, RunSpec, RunSpecError
from swarmgrad.node.training.model import build_model, save_weights

SPEC = """\
[run]
id = "r"

[network]
bootstrap = ["/ip4/127.0.0.1/tcp/1/p2p/A"]

[node]
checkpoint_every_rounds = 5
metrics_address = "127.0.0.1:9100"
"""


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(SPEC)
    return path


def _env(tmp_path: Path, **variables: str) -> dict[str, str]:
    return {"SWARMGRAD_HOME": str(tmp_path / "home"), **variables}


def test_each_layer_overrides_the_one_before(spec: Path, tmp_path: Path) -> None:
    from_spec = node_config(spec_path=spec, environ=_env(tmp_path))
    assert from_spec.settings.checkpoint_every_rounds == 5
    assert from_spec.settings.metrics_address == "127.0.0.1:9100"
    assert from_spec.settings.keep_checkpoints == 3  # the default: in no layer

    env = _env(
        tmp_path, SWARMGRAD_CHECKPOINT_EVERY_ROUNDS="7", SWARMGRAD_METRICS_ADDRESS="0.0.0.0:9200"
    )
    from_env = node_config(spec_path=spec, environ=env)
    assert from_env.settings.checkpoint_every_rounds == 7
    assert from_env.settings.metrics_address == "0.0.0.0:9200"

    from_cli = node_config(
        spec_path=spec,
        environ=env,
        # None: not given
        cli=CommandLine(settings={"checkpoint_every_rounds": 9, "metrics_address": None}),
    )
    assert from_cli.settings.checkpoint_every_rounds == 9
    assert from_cli.settings.metrics_address == "0.0.0.0:9200"


def test_node_settings_are_not_part_of_the_run(spec: Path, tmp_path: Path) -> None:
    plain = RunSpec.from_toml('[run]\nid = "r"\n')
    config = node_config(spec_path=spec, environ=_env(tmp_path, SWARMGRAD_DEVICE="cpu"))
    assert config.spec.hash == plain.hash  # [node] and [network] are outside the hash


def test_bad_values_name_their_layer(spec: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SWARMGRAD_PORT must be an integer, got 'http'"):
        node_config(spec_path=spec, environ=_env(tmp_path, SWARMGRAD_PORT="http"))
    with pytest.raises(ConfigError, match="SWARMGRAD_DEVICE must be one of auto, cpu, cuda"):
        node_config(spec_path=spec, environ=_env(tmp_path, SWARMGRAD_DEVICE="tpu"))
    with pytest.raises(ConfigError, match="--device must be one of"):
        node_config(
            spec_path=spec, environ=_env(tmp_path), cli=CommandLine(settings={"device": "tpu"})
        )
    with pytest.raises(ConfigError, match="--metrics-address must be host:port, 'auto' or 'off'"):
        node_config(
            spec_path=spec,
            environ=_env(tmp_path),
            cli=CommandLine(settings={"metrics_address": "9464"}),
        )
    with pytest.raises(ConfigError, match="--keep-checkpoints must be positive"):
        node_config(
            spec_path=spec,
            environ=_env(tmp_path),
            cli=CommandLine(settings={"keep_checkpoints": 0}),
        )
    with pytest.raises(ConfigError, match=r"SWARMGRAD_CHECKPOINT_EVERY_SECONDS must be 0 \(off\)"):
        node_config(
            spec_path=spec,
            environ=_env(tmp_path) | {"SWARMGRAD_CHECKPOINT_EVERY_SECONDS": "-5"},
            cli=CommandLine(),
        )
    bad_spec = tmp_path / "bad.toml"
    bad_spec.write_text('[run]\nid = "r"\n[node]\ndevice = "tpu"\n')
    with pytest.raises(RunSpecError, match=r"node\.device must be one of"):
        node_config(spec_path=bad_spec, environ=_env(tmp_path))


def test_unknown_keys_and_variables_are_errors(spec: Path, tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text('[run]\nid = "r"\n[node]\ncheckpoint_every = 5\n')
    with pytest.raises(RunSpecError, match=r"unknown key\(s\) node.checkpoint_every"):
        node_config(spec_path=typo, environ=_env(tmp_path))
    with pytest.raises(ConfigError, match="SWARMGRAD_METRICS_ADRESS"):
        node_config(spec_path=spec, environ=_env(tmp_path, SWARMGRAD_METRICS_ADRESS="x:1"))
    with pytest.raises(ConfigError, match="SWARMGRAD_HOEM"):
        home({"SWARMGRAD_HOEM": "/tmp"})


def test_bootstrap_addresses_from_every_layer_are_used_together(spec: Path, tmp_path: Path) -> None:
    maddrs_file = tmp_path / "bootstrap.json"
    maddrs_file.write_text(json.dumps({"maddrs": ["/ip4/127.0.0.1/tcp/4/p2p/D"]}))
    env = _env(
        tmp_path, SWARMGRAD_BOOTSTRAP="/ip4/127.0.0.1/tcp/2/p2p/B, /ip4/127.0.0.1/tcp/1/p2p/A"
    )
    config = node_config(
        spec_path=spec,
        environ=env,
        cli=CommandLine(bootstrap=["/ip4/127.0.0.1/tcp/3/p2p/C"], bootstrap_file=maddrs_file),
    )
    assert config.swarm.bootstrap == tuple(f"/ip4/127.0.0.1/tcp/{i}/p2p/{c}" for i, c in
                                           zip(range(1, 5), "ABCD", strict=True))  # fmt: skip
    maddrs_file.write_text("{}")
    with pytest.raises(ConfigError, match="--bootstrap-file"):
        node_config(spec_path=spec, environ=env, cli=CommandLine(bootstrap_file=maddrs_file))


@pytest.mark.parametrize(
    "maddr", ["foo", "127.0.0.1:4000", "/ip4/203.0.113.5/tcp/31337", "/ip4/1.2.3.4/tcp/x/p2p/A"]
)
def test_a_bootstrap_address_that_is_no_multiaddr_is_a_config_error(
    spec: Path, tmp_path: Path, maddr: str
) -> None:
    # Not a network failure to retry: nothing was dialed, and the message says what is expected.
    with pytest.raises(ConfigError, match=r"is not a peer's multiaddr: expected one like /ip4/"):
        node_config(spec_path=spec, environ=_env(tmp_path), cli=CommandLine(bootstrap=[maddr]))


def test_listening_everywhere_needs_an_address_to_announce(spec: Path, tmp_path: Path) -> None:
    everywhere = r"--host 0\.0\.0\.0 listens everywhere: set node\.public_host"
    with pytest.raises(ConfigError, match=everywhere):
        node_config(
            spec_path=spec, environ=_env(tmp_path), cli=CommandLine(settings={"host": "0.0.0.0"})
        )
    config = node_config(
        spec_path=spec,
        environ=_env(tmp_path, SWARMGRAD_PUBLIC_HOST="trainer-1"),
        cli=CommandLine(settings={"host": "0.0.0.0"}),
    )
    assert (config.swarm.host, config.swarm.public_host) == ("0.0.0.0", "trainer-1")


def test_paths_default_under_swarmgrad_home(spec: Path, tmp_path: Path) -> None:
    config = node_config(spec_path=spec, environ=_env(tmp_path))
    assert config.identity_path == tmp_path / "home" / "identity.key"
    assert config.checkpoint_dir == tmp_path / "home" / "checkpoints" / "r"
    assert config.cache_dir == tmp_path / "home" / "cache"
    # An open run's bans are kept with the run's checkpoints.
    assert config.swarm.bans_path == config.checkpoint_dir / "bans.json"


def test_the_discovery_backend_and_a_dht_secret_reach_the_swarm(spec: Path, tmp_path: Path) -> None:
    env = _env(tmp_path, SWARMGRAD_DISCOVERY="libp2p", SWARMGRAD_DHT_SECRET="our run")
    config = node_config(spec_path=spec, environ=env)
    assert (config.swarm.discovery, config.swarm.dht_secret) == ("libp2p", "our run")
    assert config.spec.hash == RunSpec.from_toml('[run]\nid = "r"\n').hash  # never announced
    with pytest.raises(ConfigError, match="--discovery must be one of hivemind, libp2p"):
        node_config(
            spec_path=spec, environ=_env(tmp_path), cli=CommandLine(settings={"discovery": "mdns"})
        )
    with pytest.raises(ConfigError, match=r"SWARMGRAD_DHT_SECRET.*needs node\.discovery"):
        node_config(spec_path=spec, environ=_env(tmp_path, SWARMGRAD_DHT_SECRET="s"))


def test_initial_weights_are_checked_before_the_node_starts(tmp_path: Path) -> None:
    model = ModelSection(d_model=32, n_heads=2, n_layers=1, seq_len=16, vocab_size=64)
    donor = build_model(model, seed=7)
    digest = save_weights(donor, tmp_path / "warm.safetensors")
    smaller = save_weights(
        build_model(dataclasses.replace(model, d_model=16), seed=7), tmp_path / "small.safetensors"
    )
    shape = "[model]\nd_model = 32\nn_heads = 2\nn_layers = 1\nseq_len = 16\nvocab_size = 64\n"

    def configure(init: str, sha: str) -> Path:
        path = tmp_path / "run.toml"
        path.write_text(f'{SPEC}{shape}init = "{init}"\ninit_sha256 = "{sha}"\n')
        return path

    config = node_config(spec_path=configure("warm.safetensors", digest), environ=_env(tmp_path))
    started = build_model(config.spec.model, seed=0)  # the seed no longer matters
    for (name, mine), theirs in zip(
        started.state_dict().items(), donor.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs), name

    with pytest.raises(ConfigError, match=f"has SHA-256 {smaller}.*not the weights"):
        node_config(spec_path=configure("small.safetensors", digest), environ=_env(tmp_path))
    wrong_shape = r"embed.weight is torch.float32 \[64, 16\] .* needs floating point \[64, 32\]"
    with pytest.raises(ConfigError, match=wrong_shape):
        node_config(spec_path=configure("small.safetensors", smaller), environ=_env(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot read .*gone\.safetensors"):
        node_config(spec_path=configure("gone.safetensors", digest), environ=_env(tmp_path))
    (tmp_path / "junk.safetensors").write_bytes(b"\x08" + bytes(40))
    junk = hashlib.sha256((tmp_path / "junk.safetensors").read_bytes()).hexdigest()
    with pytest.raises(ConfigError, match="not a safetensors file"):
        node_config(spec_path=configure("junk.safetensors", junk), environ=_env(tmp_path))
