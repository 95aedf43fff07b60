"""Run specs: defaults, a stable hash that ignores operational fields, and clear errors."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.simulations.profiles import SimulationError, load_profile
from tests.helpers import doc_blocks

MINIMAL = '[run]\nid = "demo"\n'


def test_minimal_spec_takes_defaults_and_hashes_stably() -> None:
    spec = RunSpec.from_toml(MINIMAL)
    assert spec.run.id == "demo"
    assert spec.algorithm.name == "diloco"
    assert spec.averaging.codec == "int8"
    assert len(spec.hash) == 32
    assert RunSpec.from_toml(MINIMAL).hash == spec.hash


def test_hash_changes_with_training_fields_but_not_with_bootstrap() -> None:
    base = RunSpec.from_toml(MINIMAL)
    other_codec = RunSpec.from_toml(MINIMAL + '[averaging]\ncodec = "fp16"\n')
    other_bootstrap = RunSpec.from_toml(MINIMAL + '[network]\nbootstrap = ["/ip4/1.2.3.4/tcp/1"]\n')
    assert other_codec.hash != base.hash
    assert other_bootstrap.hash == base.hash
    assert other_bootstrap.network.bootstrap == ("/ip4/1.2.3.4/tcp/1",)


def test_the_hash_pins_the_initial_weights_not_where_a_peer_keeps_them(tmp_path: Path) -> None:
    def spec(folder: str, digest: str) -> RunSpec:
        (tmp_path / folder).mkdir(exist_ok=True)
        path = tmp_path / folder / "run.toml"
        path.write_text(MINIMAL + f'[model]\ninit = "w.safetensors"\ninit_sha256 = "{digest}"\n')
        return RunSpec.load(path)

    here, there = spec("a", "0" * 64), spec("b", "0" * 64)
    assert here.model.init == str(tmp_path / "a" / "w.safetensors")  # beside the spec file
    assert here.hash == there.hash
    assert spec("c", "1" * 64).hash != here.hash
    assert here.hash != RunSpec.from_toml(MINIMAL).hash


def test_integers_are_accepted_where_floats_are_expected() -> None:
    spec = RunSpec.from_toml(MINIMAL + "[algorithm]\nouter_lr = 1\n")
    assert spec.algorithm.outer_lr == 1.0
    assert spec.hash == RunSpec.from_toml(MINIMAL + "[algorithm]\nouter_lr = 1.0\n").hash


def test_the_inner_lr_warms_up_then_decays_to_its_floor_and_stays() -> None:
    constant = RunSpec.from_toml(MINIMAL + "[algorithm]\ninner_lr = 1e-3\n").algorithm
    assert {constant.lr_at(step) for step in (0, 10, 10**6)} == {1e-3}
    text = (
        "[algorithm]\ninner_lr = 1e-3\nwarmup_steps = 10\ndecay_steps = 110\nmin_lr_ratio = 0.1\n"
    )
    algorithm = RunSpec.from_toml(MINIMAL + text).algorithm
    assert algorithm.lr_at(0) == pytest.approx(1e-4)  # the first step already moves
    assert algorithm.lr_at(4) == pytest.approx(5e-4)
    assert algorithm.lr_at(9) == pytest.approx(1e-3)
    assert algorithm.lr_at(60) == pytest.approx(0.55e-3)  # half-way down the cosine
    assert algorithm.lr_at(110) == algorithm.lr_at(5000) == pytest.approx(1e-4)
    decay = [algorithm.lr_at(step) for step in range(9, 111)]
    assert all(a >= b for a, b in itertools.pairwise(decay))


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ("", r"\[run\] section"),
        ("[run]\n", r"\[run\]: .*id"),
        ('[run]\nid = "a b"\n', "run.id must be"),
        ('[run]\nid = "x"\nprotocol_version = 1\n', "not supported"),
        (MINIMAL + "[modle]\n", "unknown section.*modle"),
        (MINIMAL + "[model]\nlayers = 2\n", "unknown key.*model.layers"),
        (MINIMAL + "[model]\nd_model = 130\nn_heads = 4\n", "multiple of model.n_heads"),
        (MINIMAL + '[model]\nd_model = "big"\n', "model.d_model must be int"),
        (MINIMAL + "[model]\nn_layers = true\n", "model.n_layers must be int"),
        (MINIMAL + "[algorithm]\nname = 'adam'\n", "algorithm.name"),
        (MINIMAL + "[algorithm]\ninner_steps = 0\n", "algorithm.inner_steps must be positive"),
        (MINIMAL + "[algorithm]\nouter_momentum = 1.0\n", "outer_momentum"),
        (MINIMAL + "[algorithm]\nwarmup_steps = -1\n", "warmup_steps and algorithm.decay"),
        (MINIMAL + "[algorithm]\nwarmup_steps = 50\ndecay_steps = 50\n", "must exceed"),
        (MINIMAL + "[algorithm]\nmin_lr_ratio = 0.0\n", r"min_lr_ratio must be in \(0, 1\]"),
        (MINIMAL + "[algorithm]\nmin_lr_ratio = 1.5\n", r"min_lr_ratio must be in \(0, 1\]"),
        (MINIMAL + "[averaging]\ncodec = 'zip'\n", "averaging.codec 'zip' is unknown"),
        (MINIMAL + "[averaging]\ngroup_size = 1\n", "group_size must be at least 2"),
        (MINIMAL + "[averaging]\nsender_timeout_seconds = 30.0\n", "reducer_timeout_seconds"),
        (MINIMAL + "[data]\nsource = 'files'\n", "data.paths"),
        (MINIMAL + "[model]\ninit = 'w.safetensors'\n", "go together"),
        (MINIMAL + "[model]\ninit = 'w'\ninit_sha256 = 'abc'\n", "64 lowercase hex"),
        (MINIMAL + "[network]\nbootstrap = 'x'\n", "list of strings"),
        (MINIMAL + "model = 3\n", r"unknown key.*run.model"),
        ("[run\n", "not valid TOML"),
        (MINIMAL + "x = " + "[" * 3000 + "]" * 3000, "nested too deeply"),
    ],
)
def test_bad_specs_are_refused_with_the_key_named(toml: str, match: str) -> None:
    with pytest.raises(RunSpecError, match=match):
        RunSpec.from_toml(toml)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(MINIMAL + "[averaging]\ngroup_size = 0\n")
    with pytest.raises(RunSpecError, match=r"run.toml: averaging.group_size"):
        RunSpec.load(path)
    with pytest.raises(RunSpecError, match="cannot read"):
        RunSpec.load(tmp_path / "missing.toml")


def test_the_docs_example_spec_is_valid() -> None:
    # The run spec reference (docs/runs.md, linked from the README), every key at its default.
    (example,) = [block for _, block in doc_blocks("toml") if "[run]" in block]
    spec = RunSpec.from_toml(example)
    assert spec.run.id == "shakespeare-example"
    assert spec == RunSpec.from_toml(example)


def test_the_docs_example_profile_is_valid(tmp_path: Path) -> None:
    (example,) = [block for _, block in doc_blocks("toml") if "[[peer]]" in block]
    path = tmp_path / "peers.toml"
    path.write_text(example)
    profiles = load_profile(path, 3)
    assert [p.slowdown for p in profiles] == [1.0, 2.5, 1.0]
    assert profiles[1].upload_bytes_per_second == 2e6
    path.write_text("[[peer]]\nslowdwn = 2\n")
    with pytest.raises(SimulationError, match="slowdwn"):
        load_profile(path, 1)


def test_the_spec_knows_every_built_in_codec_and_one_registered_from_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from swarmgrad.compression import base, codec_names, register
    from swarmgrad.compression.floating import Float16
    from swarmgrad.compression.traits import BUILTIN, Traits

    # The torch-free table says of each built-in codec what its class says.
    assert base.registered_traits() == BUILTIN
    assert set(codec_names()) == set(BUILTIN)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # the registration ends here

    @register
    class Halves(Float16):  # a user's own codec, known only to the registry
        name = "test-halves"
        traits = Traits()  # declares nothing: safe for neither open runs nor the pipeline

    spec = RunSpec.from_toml(MINIMAL + "[averaging]\ncodec = 'test-halves'\n")
    assert spec.averaging.codec == "test-halves"
    with pytest.raises(RunSpecError, match=re.escape("'test-halves' is not safe for trust.mode")):
        RunSpec.from_toml(MINIMAL + "[averaging]\ncodec = 'test-halves'\n[trust]\nmode = 'open'\n")

    @register
    class CheckedHalves(Float16):
        name = "test-checked-halves"
        traits = Traits(open_runs=True)

    spec = RunSpec.from_toml(
        MINIMAL + "[averaging]\ncodec = 'test-checked-halves'\n[trust]\nmode = 'open'\n"
    )
    assert spec.trust.open


@pytest.mark.parametrize("codec", ["topk", "powersgd"])
def test_an_open_run_refuses_a_codec_whose_values_cannot_be_checked(codec: str) -> None:
    with pytest.raises(RunSpecError) as refused:
        RunSpec.from_toml(MINIMAL + f"[averaging]\ncodec = '{codec}'\n[trust]\nmode = 'open'\n")
    message = str(refused.value)
    assert "cannot be screened" in message
    assert "use none, fp16, bf16, int8, int4" in message  # what the codecs say is safe


def test_a_spec_is_checked_without_importing_torch() -> None:
    # ``status``, ``runs`` and ``publish`` read specs: the codec checks must not pull torch in.
    code = (
        "import sys; from swarmgrad.node.runspec import RunSpec; "
        'RunSpec.from_toml(\'[run]\\nid = "x"\\n[averaging]\\ncodec = "int4"\\n'
        "[trust]\\nmode = \"open\"\\n'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_open_runs_default_to_groups_whose_parts_can_judge_their_members() -> None:
    from swarmgrad.node.runspec import OPEN_GROUP_SIZE, OPEN_JUDGED_GROUP_SIZE
    from swarmgrad.node.trust.observations import MIN_JUDGED_MEMBERS

    # The owner's own values stay out of its part: a group needs one member more.
    assert OPEN_JUDGED_GROUP_SIZE == MIN_JUDGED_MEMBERS + 1
    open_spec = RunSpec.from_toml('[run]\nid = "x"\n[trust]\nmode = "open"\n')
    assert open_spec.averaging.group_size == OPEN_GROUP_SIZE
    assert open_spec.warnings() == []
    trusted = RunSpec.from_toml('[run]\nid = "x"\n')
    assert trusted.averaging.group_size == 4
    small = RunSpec.from_toml(
        '[run]\nid = "x"\n[averaging]\ngroup_size = 4\n[trust]\nmode = "open"\n'
    )
    assert small.averaging.group_size == 4  # what the spec says stands, with a warning
    (warning,) = small.warnings()
    assert "group_size = 4" in warning
    assert "noise is merely clipped" in warning
    # The demo's 256 is the most an open run's groups may hold; a trusted run may go past it.
    for size, refused in ((256, False), (257, True)):
        text = f'[run]\nid = "x"\n[averaging]\ngroup_size = {size}\n'
        assert RunSpec.from_toml(text).averaging.group_size == size
        if refused:
            with pytest.raises(RunSpecError, match="open run's groups hold at most 256"):
                RunSpec.from_toml(text + '[trust]\nmode = "open"\n')
        else:
            assert RunSpec.from_toml(text + '[trust]\nmode = "open"\n').warnings() == []


def test_every_mistake_in_a_spec_is_reported_at_once_with_the_name_it_likely_meant() -> None:
    text = (
        '[run]\nid = "x"\n[modle]\nd_model = 64\n'
        '[averaging]\ncodek = "int8"\ngroup_size = "four"\n[data]\nbatch_sise = 3\n'
    )
    with pytest.raises(RunSpecError) as refused:
        RunSpec.from_toml(text)
    message = str(refused.value)
    assert message.startswith("4 problems:\n"), message
    assert "unknown section(s) [modle] (did you mean [model]?)" in message
    assert "averaging.codek (did you mean averaging.codec?)" in message
    assert "averaging.group_size must be int, got 'four'" in message
    assert "data.batch_sise (did you mean data.batch_size?)" in message
    assert len(refused.value.problems) == 4
    # One mistake reads as before: one line.
    with pytest.raises(RunSpecError, match=r"^unknown key\(s\) data.batch_sise \(did you mean"):
        RunSpec.from_toml('[run]\nid = "x"\n[data]\nbatch_sise = 3\n')


def test_a_codecs_options_are_checked_by_name_and_change_the_hash() -> None:
    from swarmgrad.node.swarm_config import allreduce_config

    def spec(options: str = "") -> RunSpec:
        return RunSpec.from_toml(f'[run]\nid = "r"\n[averaging]\ncodec = "sparse"\n{options}')

    tuned = spec("codec_options = { bits = 4, density = 0.03125 }\n")
    assert spec().hash != tuned.hash
    assert spec().hash == spec("codec_options = {}\n").hash  # no options: the hash as before
    codec = allreduce_config(tuned).make_codec()
    assert (codec.bits, codec.k) == (4, 128)  # type: ignore[attr-defined]
    with pytest.raises(RunSpecError, match="codec 'sparse' takes density, bits, chunk"):
        spec("codec_options = { rank = 4 }\n")
    with pytest.raises(RunSpecError, match=r"codec_options\.bits must be a number"):
        spec('codec_options = { bits = "two" }\n')
    with pytest.raises(ValueError, match="bits must be 2 or 4"):  # said at the node's start
        allreduce_config(spec("codec_options = { bits = 3 }\n"))


def test_a_result_codec_is_checked_and_changes_the_hash_only_when_given() -> None:
    from swarmgrad.node.swarm_config import allreduce_config

    def spec(averaging: str, trust: str = "") -> RunSpec:
        return RunSpec.from_toml(f'[run]\nid = "r"\n[averaging]\n{averaging}\n{trust}')

    sparse = spec('codec = "sparse"')
    dense_results = spec('codec = "sparse"\nresult_codec = "int8"')
    assert sparse.hash == spec('codec = "sparse"\nresult_codec = ""').hash  # as before
    assert dense_results.hash != sparse.hash
    assert allreduce_config(dense_results).make_result_codec().name == "int8"
    assert allreduce_config(sparse).make_result_codec().name == "sparse"
    assert sparse.differences(dense_results.canonical()) == [
        "averaging.result_codec: here None, there 'int8'"
    ]
    with pytest.raises(RunSpecError, match=r"averaging\.result_codec 'int9' is unknown"):
        spec('result_codec = "int9"')
    # Open runs check what owners send: a result codec must be safe for them too.
    with pytest.raises(RunSpecError, match=r"averaging\.result_codec: codec 'sparse' is not safe"):
        spec('result_codec = "sparse"', '[trust]\nmode = "open"')
    opened = spec('result_codec = "int8"', '[trust]\nmode = "open"')
    assert allreduce_config(opened).result_codec == "int8"
    assert allreduce_config(spec("", '[trust]\nmode = "open"')).result_codec == "fp16"
