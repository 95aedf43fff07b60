"""Node processes train on the run's own shards (text, jsonl, parquet) with the run's tokenizer,
and the export carries that tokenizer."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from swarmgrad.node.training.export import export
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate
from tests.unit.test_shards import make_shards


def test_a_swarm_trains_on_file_shards_with_a_given_tokenizer(tmp_path: Path) -> None:
    tokenizer, digest = make_shards(tmp_path / "data")
    folder = tmp_path / "data"
    spec = (
        DEMO_SPEC.replace("group_size = 256", "group_size = 2")
        .replace("vocab_size = 2048", "vocab_size = 320")
        .replace(
            'source = "demo"',
            f'source = "files"\npaths = ["{folder}/a.txt", "{folder}/b-*.jsonl", '
            f'"{folder}/c.parquet"]\ntokenizer = "{tokenizer}"\ntokenizer_sha256 = "{digest}"',
        )
    )
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(spec)
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(nodes=2, rounds=2, spec_path=spec_path, profile_path=None, out_dir=out)
    )
    assert summary["ok"]
    assert summary["replicas_identical"]
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    hf_dir = tmp_path / "hf"
    export(out / "checkpoints" / "node-0", hf_dir, cache_dir=tmp_path / "cache")
    exported = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert exported.get_vocab() == Tokenizer.from_file(str(tokenizer)).get_vocab()
