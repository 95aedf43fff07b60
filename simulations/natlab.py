"""A NAT lab: network namespaces with a public segment and home LANs behind masquerading routers.

Layout (``token`` makes every name unique, so two labs can exist at once)::

    public segment 11.7.0.0/24: a bridge in namespace <token>-wan
      |-- public host  <token>-pN   11.7.0.(10 + N)
      `-- router       <token>-rN   11.7.0.(100 + N)  (masquerade; forward drops unsolicited)
            `-- home host <token>-hN   192.168.N.2, default route 192.168.N.1

The public range is not a reserved one on purpose: miniupnpd refuses to map ports when the
router's outside address is private (the namespaces have no link to anything outside, so no
packet can leave the machine). Linux masquerade keeps the local port and admits only packets from
an address + port the home host contacted first (a port-restricted cone NAT); ``symmetric=True``
uses ``fully-random`` ports instead, where hole punching fails. A router may run miniupnpd
(UPnP IGD + NAT-PMP) to let its home host map a port.

Needs root, ``ip`` and ``nft``. Everything is deleted on exit, also when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from swarmgrad.simulations.processes import Child
from swarmgrad.simulations.zygote import fork

PUBLIC_PREFIX = "11.7.0"


class LabError(RuntimeError):
    """The lab could not be built (missing tools, no root)."""


def missing_tools(upnp: bool = False) -> list[str]:
    """What this machine lacks to build a lab (empty when it can)."""
    need = ["ip", "nft"] + (["miniupnpd"] if upnp else [])
    missing = [tool for tool in need if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def _run(*argv: str, namespace: str | None = None, stdin: str | None = None) -> None:
    if namespace is not None:
        argv = ("ip", "netns", "exec", namespace, *argv)
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip()}")


@dataclass(slots=True)
class Host:
    """One machine of the lab: a namespace, its address, the processes started in it."""

    namespace: str
    address: str
    behind_nat: bool
    router: Router | None = None
    processes: list[Child] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host (its own session: the lab kills its whole group)."""
        process: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.namespace, *argv], start_new_session=True, **kwargs
        )
        self.processes.append(process)
        return process

    def fork(self, name: str, command: list[str], log_path: Path) -> Child:
        """``python -m module ...`` inside this host, forked by the warm zygote (``zygote.py``:
        the node's imports done once) in this namespace, output appended to ``log_path``."""
        process = fork(name, command, log_path, dict(os.environ), netns=self.namespace)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@dataclass(slots=True)
class Router:
    namespace: str
    public_address: str
    lan_address: str
    upnp: bool
    workdir: Path
    daemon: subprocess.Popen[bytes] | None = None


class NatLab:
    """Build with ``with NatLab() as lab:``; add hosts with :meth:`public` and :meth:`home`."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token or "sg" + secrets.token_hex(3)
        self.wan = f"{self.token}-wan"
        self.hosts: list[Host] = []
        self.routers: list[Router] = []
        self._namespaces: list[str] = []
        self._ports: dict[str, str] = {}  # namespace -> its port on the bridge (in the wan)
        self._public_count = 0
        self._home_count = 0
        self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.token}-"))

    def __enter__(self) -> NatLab:
        missing = missing_tools()
        if missing:
            raise LabError(f"the NAT lab needs {', '.join(missing)}")
        try:
            self._namespace(self.wan)
            _run("ip", "link", "add", "br0", "type", "bridge", namespace=self.wan)
            _run("ip", "link", "set", "br0", "up", namespace=self.wan)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "link", "set", "lo", "up", namespace=name)

    def _plug_into_wan(self, namespace: str, address: str) -> None:
        index = len(self._namespaces)
        inside, outside = f"{self.token}w{index}", f"{self.token}b{index}"
        _run("ip", "link", "add", inside, "netns", namespace, "type", "veth", "peer", outside)
        _run("ip", "link", "set", outside, "netns", self.wan)
        _run("ip", "link", "set", outside, "master", "br0", namespace=self.wan)
        _run("ip", "link", "set", outside, "up", namespace=self.wan)
        self._ports[namespace] = outside
        _run("ip", "link", "set", inside, "name", "wan0", namespace=namespace)
        _run("ip", "addr", "add", f"{address}/24", "dev", "wan0", namespace=namespace)
        _run("ip", "link", "set", "wan0", "up", namespace=namespace)

    def port_of(self, host: Host) -> str:
        """The bridge port (in the ``wan`` namespace) that leads to a public ``host``."""
        return self._ports[host.namespace]

    @staticmethod
    def run_in(namespace: str, *argv: str, stdin: str | None = None) -> None:
        """Run ``argv`` in ``namespace``; LabError with its stderr if it fails."""
        _run(*argv, namespace=namespace, stdin=stdin)

    def public(self) -> Host:
        """A host on the public segment: reachable by everyone."""
        self._public_count += 1
        n = self._public_count
        host = Host(f"{self.token}-p{n}", f"{PUBLIC_PREFIX}.{10 + n}", behind_nat=False)
        self._namespace(host.namespace)
        self._plug_into_wan(host.namespace, host.address)
        self.hosts.append(host)
        return host

    def home(self, *, upnp: bool = False, symmetric: bool = False) -> Host:
        """A host on its own LAN behind its own router (masquerade, no port forwarding)."""
        self._home_count += 1
        n = self._home_count
        router = Router(
            namespace=f"{self.token}-r{n}",
            public_address=f"{PUBLIC_PREFIX}.{100 + n}",
            lan_address=f"192.168.{n}.1",
            upnp=upnp,
            workdir=self._workdir / f"r{n}",
        )
        host = Host(f"{self.token}-h{n}", f"192.168.{n}.2", behind_nat=True, router=router)
        self._namespace(router.namespace)
        self._plug_into_wan(router.namespace, router.public_address)
        self._namespace(host.namespace)
        lan_in, lan_out = f"{self.token}l{n}a", f"{self.token}l{n}b"
        _run("ip", "link", "add", lan_in, "netns", host.namespace, "type", "veth", "peer", lan_out)
        _run("ip", "link", "set", lan_out, "netns", router.namespace)
        _run("ip", "link", "set", lan_out, "name", "lan0", namespace=router.namespace)
        lan = f"{router.lan_address}/24"
        _run("ip", "addr", "add", lan, "dev", "lan0", namespace=router.namespace)
        _run("ip", "link", "set", "lan0", "up", namespace=router.namespace)
        _run("ip", "link", "set", lan_in, "name", "eth0", namespace=host.namespace)
        _run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0", namespace=host.namespace)
        _run("ip", "link", "set", "eth0", "up", namespace=host.namespace)
        _run("ip", "route", "add", "default", "via", router.lan_address, namespace=host.namespace)
        _run("sysctl", "-qw", "net.ipv4.ip_forward=1", namespace=router.namespace)
        _run("nft", "-f", "-", namespace=router.namespace, stdin=_router_rules(symmetric))
        self.routers.append(router)
        self.hosts.append(host)
        if upnp:
            self._start_miniupnpd(router)
        return host

    def _start_miniupnpd(self, router: Router) -> None:
        if shutil.which("miniupnpd") is None:
            raise LabError("a UPnP router needs miniupnpd (apt-get install miniupnpd-nftables)")
        router.workdir.mkdir(parents=True, exist_ok=True)
        config = router.workdir / "miniupnpd.conf"
        config.write_text(
            "ext_ifname=wan0\n"
            "listening_ip=lan0\n"
            "enable_natpmp=yes\n"
            "enable_upnp=yes\n"
            "secure_mode=yes\n"
            "system_uptime=yes\n"
            "notify_interval=60\n"
            "clean_ruleset_interval=600\n"
            f"uuid=4d696e69-5550-6e50-{secrets.token_hex(2)}-{secrets.token_hex(6)}\n"
            "allow 1024-65535 192.168.0.0/16 1024-65535\n"
            "deny 0-65535 0.0.0.0/0 0-65535\n"
        )
        argv = ["miniupnpd", "-d", "-f", str(config), "-P", str(router.workdir / "miniupnpd.pid")]
        with (router.workdir / "miniupnpd.log").open("wb") as log:
            router.daemon = subprocess.Popen(
                ["ip", "netns", "exec", router.namespace, *argv],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while b"HTTP listening on port" not in read_if_there(router.workdir / "miniupnpd.log"):
            if router.daemon.poll() is not None or time.monotonic() > deadline:
                said = read_if_there(router.workdir / "miniupnpd.log").decode(errors="replace")
                raise LabError(f"miniupnpd did not start in {router.namespace}: {said[-500:]}")
            time.sleep(0.05)

    def close(self) -> None:
        processes = [p for h in self.hosts for p in h.processes]
        processes += [r.daemon for r in self.routers if r.daemon is not None]
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._namespaces.clear()
        shutil.rmtree(self._workdir, ignore_errors=True)


def read_if_there(path: Path) -> bytes:
    """The file's bytes, or none if it is not there (yet)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def _router_rules(symmetric: bool) -> str:
    """A home router: masquerade out of wan0; forward only what the LAN started (and, for
    miniupnpd's mappings, what its DNAT rules let in); drop, not refuse, whatever else arrives
    on wan0 (a router that answers an early punching SYN with a reset breaks the punch, and home
    routers drop); miniupnpd's own chains exist up front (it edits chains, it does not create
    them)."""
    masquerade = "masquerade fully-random" if symmetric else "masquerade"
    # One inet table named "filter" holds everything: miniupnpd's nftables backend edits the
    # chains of that table (its defaults for both the filter and the nat table).
    return f"""
table inet filter {{
    chain input {{
        type filter hook input priority 0; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }}
    chain forward {{
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        ct status dnat accept
        iifname "lan0" oifname "wan0" accept
        jump miniupnpd
    }}
    chain miniupnpd {{
    }}
    chain prerouting {{
        type nat hook prerouting priority -100; policy accept;
        jump prerouting_miniupnpd
    }}
    chain postrouting {{
        type nat hook postrouting priority 100; policy accept;
        jump postrouting_miniupnpd
        oifname "wan0" {masquerade}
    }}
    chain prerouting_miniupnpd {{
    }}
    chain postrouting_miniupnpd {{
    }}
}}
"""
