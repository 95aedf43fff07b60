"""The run spec: its sections together, the checks that span sections, its hash, and reading
it from TOML (every section's keys and types checked, each message naming ``section.key``)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmgrad.compression.traits import refusal
from swarmgrad.node.runspec.algorithm import CARRY_EPOCHS, AlgorithmSection
from swarmgrad.node.runspec.averaging import AveragingSection
from swarmgrad.node.runspec.data import DataSection
from swarmgrad.node.runspec.errors import RunSpecError
from swarmgrad.node.runspec.model import ModelSection
from swarmgrad.node.runspec.operational import NetworkSection, NodeSection, TrackingSection
from swarmgrad.node.runspec.pipeline import PipelineSection
from swarmgrad.node.runspec.run import RunSection
from swarmgrad.node.runspec.trust import (
    OPEN_GROUP_SIZE,
    OPEN_JUDGED_GROUP_SIZE,
    OPEN_MAX_GROUP_SIZE,
    TrustSection,
)

#: Sections that say how a node takes part, not what the run is: outside the hash.
OPERATIONAL = frozenset({"network", "node", "tracking"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    run: RunSection
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    averaging: AveragingSection = field(default_factory=AveragingSection)
    trust: TrustSection = field(default_factory=TrustSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    node: NodeSection = field(default_factory=NodeSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)

    def __post_init__(self) -> None:
        if self.pipeline.enabled:
            self._check_pipeline()
        group = self.averaging.group_size
        if self.trust.open and group > OPEN_MAX_GROUP_SIZE:
            raise RunSpecError(
                f"averaging.group_size = {group}: an open run's groups hold at most "
                f"{OPEN_MAX_GROUP_SIZE} members (the most that evidence against a part's owner "
                f"may list); use {OPEN_MAX_GROUP_SIZE} or fewer"
            )
        for key in ("codec", "result_codec"):
            codec = getattr(self.averaging, key)
            why = refusal(codec, "open_runs") if self.trust.open and codec else None
            if why is not None:
                # Its values cannot be screened, robustly aggregated or checked per coordinate.
                raise RunSpecError(
                    f"averaging.{key}: {why}" if key != "codec" else f"averaging.{why}"
                )

    def warnings(self) -> list[str]:
        """What a user must know about whom this run trusts, and how far (printed by the node
        at start, ``status`` and ``publish``)."""
        out = []
        group = self.averaging.group_size
        if self.trust.open and group < OPEN_JUDGED_GROUP_SIZE:
            out.append(
                f"run {self.run.id!r} is open with averaging.group_size = {group}: an owner's "
                f"part then has at most {group - 1} other members, too few for their "
                f"statistics to flag anyone (two colluders can be most of them), so only "
                f"zero, NaN and replayed updates are banned and noise is merely clipped; "
                f"use {OPEN_GROUP_SIZE} (the default of open runs) or more"
            )
        if self.pipeline.enabled and not self.trust.private:
            out.append(
                f"run {self.run.id!r} uses pipeline stages and is not a private run: stage "
                "replicas are trusted, and wrong activations or gradients from one go "
                "unnoticed. Let only machines you trust serve its stages (docs/pipeline.md)."
            )
        return out

    def _check_pipeline(self) -> None:
        pipeline, model = self.pipeline, self.model
        if model.kind != "gpt":
            raise RunSpecError('[pipeline] stages > 1 needs model.kind = "gpt" (for now)')
        if model.init:
            raise RunSpecError("[pipeline] stages > 1 starts from seeded weights (no model.init)")
        if pipeline.stages > model.n_layers:
            raise RunSpecError(
                f"pipeline.stages ({pipeline.stages}) must be at most model.n_layers "
                f"({model.n_layers}): every stage holds at least one layer"
            )
        if pipeline.boundaries and pipeline.boundaries[-1] >= model.n_layers:
            raise RunSpecError(
                f"pipeline.boundaries must be below model.n_layers ({model.n_layers}), got "
                f"{list(pipeline.boundaries)}"
            )
        if self.data.batch_size % pipeline.microbatches:
            raise RunSpecError(
                f"data.batch_size ({self.data.batch_size}) must be a multiple of "
                f"pipeline.microbatches ({pipeline.microbatches})"
            )
        if self.algorithm.name != "diloco" or self.trust.mode != "trusted":
            raise RunSpecError(
                "[pipeline] stages > 1 runs algorithm.name = 'diloco' in trusted runs (for now)"
            )

    def stage_spec(self, index: int) -> RunSpec:
        """The spec stage ``index``'s replicas share as one DiLoCo group: this one with its run
        id suffixed ``.stage<index>``, so the stage has its own DHT keys, rounds and state."""
        if not 0 <= index < self.pipeline.stages:
            raise RunSpecError(f"stage {index} is not one of 0..{self.pipeline.stages - 1}")
        run = dataclasses.replace(self.run, id=f"{self.run.id}.stage{index}")
        return dataclasses.replace(self, run=run)

    def document(self) -> bytes:
        """JSON of everything but ``network`` and ``node``, local paths included: what a
        checkpoint keeps (``from_dict`` reads it back; its hash is this spec's)."""
        return json.dumps(self._sections(), sort_keys=True, separators=(",", ":")).encode()

    def _sections(self) -> dict[str, Any]:
        return {
            f.name: dataclasses.asdict(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in OPERATIONAL
        }

    def canonical(self) -> bytes:
        """Canonical JSON of everything but ``network`` and ``node``: what the hash covers."""
        sections = self._sections()
        del sections["model"]["init"]  # where a peer keeps the file; init_sha256 pins what it is
        if self.model.kind == "gpt":  # runs from before model.kind keep their hash
            del sections["model"]["kind"], sections["model"]["config"]
        else:  # the GPT's own sizes do not apply
            for key in ("d_model", "n_layers", "n_heads"):
                del sections["model"][key]
        data = sections["data"]
        if data["tokenizer_sha256"]:  # pinned by its hash: where a peer keeps it is its own
            del data["tokenizer"]
        for key, default in (("tokenizer", ""), ("tokenizer_sha256", ""), ("text_field", "text")):
            if data.get(key) == default:  # runs from before these keys keep their hash
                data.pop(key)
        if not sections["averaging"]["codec_options"]:  # ... from before codec options too
            del sections["averaging"]["codec_options"]
        if not sections["averaging"]["result_codec"]:  # ... and from before result codecs
            del sections["averaging"]["result_codec"]
        if not sections["algorithm"]["overlap"]:  # runs from before overlap keep their hash
            del sections["algorithm"]["overlap"]
        if sections["algorithm"]["fragments"] == 1:  # ... and from before fragments
            del sections["algorithm"]["fragments"]
        if sections["algorithm"]["carry_epochs"] == CARRY_EPOCHS:  # ... and carry
            del sections["algorithm"]["carry_epochs"]
        if not sections["algorithm"]["round_seconds"]:  # ... and time windows
            del sections["algorithm"]["round_seconds"]
        if self.trust == TrustSection():  # runs from before [trust] keep their hash
            del sections["trust"]
        if not self.pipeline.enabled:  # ... and from before [pipeline]
            del sections["pipeline"]
        return json.dumps(sections, sort_keys=True, separators=(",", ":")).encode()

    @property
    def hash(self) -> bytes:
        """SHA-256 of :meth:`canonical`."""
        return hashlib.sha256(self.canonical()).digest()

    def differences(self, other_canonical: bytes, *, limit: int = 5) -> list[str]:
        """``section.key: here X, there Y`` for each field where another spec differs from this."""
        try:
            theirs = json.loads(other_canonical)
        except (ValueError, RecursionError):  # any peer may file a spec: "[[[[..." included
            return ["the other spec is not readable"]
        if not isinstance(theirs, dict):
            return ["the other spec is not readable"]
        mine = json.loads(self.canonical())
        found = []
        for section in sorted(set(mine) | set(theirs)):
            a, b = mine.get(section, {}), theirs.get(section, {})
            if not isinstance(a, dict) or not isinstance(b, dict):
                found.append(f"[{section}] differs")
                continue
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    found.append(f"{section}.{key}: here {a.get(key)!r}, there {b.get(key)!r}")
        return found[:limit]

    @property
    def short_hash(self) -> str:
        return self.hash.hex()[:12]

    @classmethod
    def from_toml(cls, text: str) -> RunSpec:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise RunSpecError(f"not valid TOML: {error}") from None
        except RecursionError:  # tomllib recurses per nested array: a published spec is a peer's
            raise RunSpecError("not valid TOML: nested too deeply") from None
        return cls.from_dict(raw)

    @classmethod
    def load(cls, path: Path) -> RunSpec:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise RunSpecError(f"cannot read run spec {path}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise RunSpecError(f"run spec {path} is not UTF-8 text (TOML must be)") from None
        try:
            spec = cls.from_toml(text)
        except RunSpecError as error:
            raise RunSpecError(f"{path}: {error}") from None
        if spec.model.init and not Path(spec.model.init).is_absolute():
            init = str(path.absolute().parent / spec.model.init)
            spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, init=init))
        return spec

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunSpec:
        """The spec of a parsed TOML table; every mistake in it is reported at once (unknown
        sections and keys with the nearest known name, bad values), as one RunSpecError."""
        sections = {f.name: f for f in dataclasses.fields(cls)}
        problems: list[str] = []
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            named = ", ".join(_with_hint(name, sections, "[{}]") for name in unknown)
            problems.append(f"unknown section(s) {named}; known: {', '.join(sections)}")
        if "run" not in raw:
            problems.append("the [run] section (with at least id = ...) is required")
        hints = typing.get_type_hints(cls)
        built = {}
        for name, value in raw.items():
            if name in sections:
                try:
                    built[name] = _build(name, hints[name], value)
                except RunSpecError as error:
                    problems.extend(error.problems)
        if problems:
            raise RunSpecError.of(problems)
        trust, averaging = raw.get("trust", {}), raw.get("averaging", {})
        if trust.get("mode") == "open" and "group_size" not in averaging:
            built["averaging"] = dataclasses.replace(
                built.get("averaging", AveragingSection()), group_size=OPEN_GROUP_SIZE
            )
        return cls(**built)


def _with_hint(name: str, known: Iterable[str], form: str = "{}") -> str:
    """``name``, with the known name it most likely misspells."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"{form.format(name)} (did you mean {form.format(close[0])}?)" if close else name


def _build(section: str, kind: type[Any], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise RunSpecError(f"[{section}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    problems: list[str] = []
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        named = ", ".join(_with_hint(f"{section}.{k}", [f"{section}.{f}" for f in fields])
                          for k in unknown)  # fmt: skip
        problems.append(f"unknown key(s) {named}; known: {', '.join(fields)}")
    hints = typing.get_type_hints(kind)
    values = {}
    for key, value in raw.items():
        if key in fields:
            try:
                values[key] = _check(f"{section}.{key}", hints[key], value)
            except RunSpecError as error:
                problems.extend(error.problems)
    if problems:
        raise RunSpecError.of(problems)
    try:
        return kind(**values)
    except TypeError as error:  # a required key is missing
        raise RunSpecError(f"[{section}]: {error}") from None


def _check(name: str, kind: Any, value: Any) -> Any:
    """``value`` as ``kind`` (int, float, str, tuple[str, ...], or a table of TOML scalars and
    lists of them), or a RunSpecError."""
    if typing.get_origin(kind) is dict:
        if not isinstance(value, dict):
            raise RunSpecError(f"{name} must be a table, got {value!r}")
        for key, item in value.items():
            items = item if isinstance(item, list) else [item]
            if not all(isinstance(i, bool | int | float | str) for i in items):
                raise RunSpecError(f"{name}.{key} must be a number, string, boolean or list")
        return dict(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise RunSpecError(f"{name} must be true or false, got {value!r}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        if not isinstance(value, list) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            what = "integers" if item is int else "strings"
            raise RunSpecError(f"{name} must be a list of {what}, got {value!r}")
        return tuple(value)
    if (
        isinstance(kind, type)
        and not isinstance(kind, types.GenericAlias)
        and (isinstance(value, bool) or not isinstance(value, kind))
    ):
        raise RunSpecError(f"{name} must be {kind.__name__}, got {value!r}")
    return value
