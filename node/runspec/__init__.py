"""The run spec: what every node of one training run must agree on, read from TOML.

Its hash (SHA-256 of a canonical JSON rendering of every field but ``network`` and ``node``)
travels in every DHT key and RPC, so nodes with different specs never mix and say why when they
meet. Unknown sections and keys are errors, as are wrong types and out-of-range values; every
message names the offending ``section.key``.

Example (every section but ``[run]`` may be left out to take the defaults)::

    [run]
    id = "shakespeare-demo"

    [model]
    d_model = 128
    n_layers = 2
    # init = "warm.safetensors"   # optional: start from these weights, pinned by
    # init_sha256 = "9f86d0..."   # their SHA-256

    [algorithm]
    name = "diloco"
    inner_steps = 50

    [averaging]
    codec = "int8"
    group_size = 4

    [trust]     # who may take part, and how owners combine members' values
    mode = "open"

    [network]
    bootstrap = ["/ip4/203.0.113.5/tcp/31337/p2p/Qm..."]

    [node]      # defaults for each node; SWARMGRAD_* variables and options override them
    checkpoint_every_rounds = 5

One module per section (``run.py``, ``model.py``, ``data.py``, ``algorithm.py``, ``averaging.py``,
``pipeline.py``, ``trust.py``, and ``operational.py`` for the sections outside the hash); the
spec itself, its cross-section checks and its reading are ``spec.py``.
"""

from swarmgrad.node.runspec.algorithm import AlgorithmSection
from swarmgrad.node.runspec.averaging import AveragingSection
from swarmgrad.node.runspec.data import DataSection
from swarmgrad.node.runspec.errors import RunSpecError
from swarmgrad.node.runspec.model import HF_MODEL_TYPES, MODEL_KINDS, ModelSection
from swarmgrad.node.runspec.operational import (
    DEVICES,
    TRACKERS,
    NetworkSection,
    NodeSection,
    TrackingSection,
)
from swarmgrad.node.runspec.pipeline import PipelineSection
from swarmgrad.node.runspec.run import RunSection
from swarmgrad.node.runspec.spec import OPERATIONAL, RunSpec
from swarmgrad.node.runspec.trust import (
    AGGREGATORS,
    OPEN_GROUP_SIZE,
    OPEN_JUDGED_GROUP_SIZE,
    TRUST_MODES,
    TrustSection,
)

__all__ = [
    "AGGREGATORS",
    "DEVICES",
    "HF_MODEL_TYPES",
    "MODEL_KINDS",
    "OPEN_GROUP_SIZE",
    "OPEN_JUDGED_GROUP_SIZE",
    "OPERATIONAL",
    "TRACKERS",
    "TRUST_MODES",
    "AlgorithmSection",
    "AveragingSection",
    "DataSection",
    "ModelSection",
    "NetworkSection",
    "NodeSection",
    "PipelineSection",
    "RunSection",
    "RunSpec",
    "RunSpecError",
    "TrackingSection",
    "TrustSection",
]
