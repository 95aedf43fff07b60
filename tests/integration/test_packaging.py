"""The distribution: the swarmgrad.* namespace mapping, layering rules, and a wheel that imports
from outside the repository."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["node", "protocol", "compression", "simulations"]


def imports_of(folder: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def test_compression_is_pure_torch() -> None:
    forbidden = ("grpc", "google.protobuf", "asyncio", "swarmgrad.node", "swarmgrad.protocol")
    bad = {n for n in imports_of("compression") if n.startswith(forbidden)}
    assert not bad, f"compression/ must not import {sorted(bad)}"


@pytest.mark.parametrize("folder", [*PACKAGES, "tests", "benchmarks", "scripts"])
def test_no_bare_top_level_imports(folder: str) -> None:
    bare = {n for n in imports_of(folder) if n.split(".")[0] in PACKAGES}
    assert not bare, f"import through the namespace (swarmgrad.X), not {sorted(bare)}"


def test_the_cli_starts_without_torch() -> None:
    # `swarmgrad --help`, `status`, `run-key` paid ~3 s for torch they never use; the commands
    # that train import it themselves.
    code = "import sys, swarmgrad.node.cli; print(sorted({'torch', 'hivemind'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_editable_install_maps_the_folders() -> None:
    import swarmgrad.compression
    import swarmgrad.protocol

    assert Path(swarmgrad.compression.__file__).parent == ROOT / "compression"
    assert Path(swarmgrad.protocol.__file__).parent == ROOT / "protocol"


@pytest.mark.slow
def test_built_wheel_imports_from_outside_the_repo(tmp_path: Path) -> None:
    dist, site, elsewhere = tmp_path / "dist", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Build from a copy: setuptools writes build/ and *.egg-info into the source tree.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in PACKAGES:
        shutil.copytree(
            ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = dist.glob("swarmgrad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "swarmgrad/protocol/v1/peer.proto" in names
    assert "swarmgrad/protocol/v1/peer_pb2_grpc.py" in names
    assert "swarmgrad/compression/py.typed" in names
    assert not any(n.startswith(("compression/", "node/", "protocol/")) for n in names)
    # Every module of every subpackage: a subpackage left out of pyproject.toml's list would
    # import from a checkout and fail from the wheel.
    modules = {
        f"swarmgrad/{path.relative_to(ROOT).as_posix()}"
        for folder in PACKAGES
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert modules - set(names) == set()
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    probe = (
        "import sys, swarmgrad.compression as c, swarmgrad.protocol.v1.peer_pb2 as p, torch;"
        "assert c.__file__.startswith(sys.argv[1]), c.__file__;"
        "data, meta = c.get_codec('int8').encode(torch.ones(10));"
        "print(c.decode(data, meta).sum().item(), p.DESCRIPTOR.package)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(site)],
        cwd=elsewhere,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["10.0", "swarmgrad.v1"]
