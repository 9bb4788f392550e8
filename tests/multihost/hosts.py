"""Simulated hosts: Linux network namespaces on one private bridge.

Each host is a network namespace with a veth whose far end sits on a bridge of this run, its
own address in ``SUBNET``.0/24, its own host name (``unshare --uts``), its own
``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``), written the Debian
way: the host's own name maps to ``127.0.1.1``, the other hosts' names to their addresses,
and its own temporary directory (``TMPDIR``: real hosts do not share ``/tmp``, and nbdist
keeps per-host things there, such as its executor zygotes' sockets). Other files are this
machine's, seen by every host (a shared file system, as a cluster's DBFS or NFS).
There is no default route and no address on the bridge, and forwarding stays off: the hosts
reach each other and nothing else, and nothing outside reaches them.

Every name made here (namespaces, links, ``/etc/netns`` entries) starts with ``PREFIX`` and
the run's id; ``STATE_DIR/<run>.pid`` holds the pid of the test process that owns the run.
:meth:`Network.clean_leftovers` tears down the runs whose owner is gone (a crashed or killed
test run), never one still running beside us.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

#: Every namespace, link and /etc/netns entry of these tests starts with this.
PREFIX = "nbmh"
#: The hosts' /24 (no address on it outside the namespaces).
SUBNET = "10.231.13"
#: Which test process owns which run (``<run>.pid``).
STATE_DIR = Path("/run/nbdist-multihost")


def missing() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "the multi-host tests need root (they create network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the multi-host tests need {tool!r} (iproute2, util-linux)"
    if shutil.which("java") is None:
        return "the multi-host tests need Java 17 (apt-get install openjdk-17-jre-headless)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass(frozen=True)
class Host:
    """One simulated machine."""

    name: str  # its host name
    ip: str
    ns: str  # its network namespace
    veth: str  # the end of its cable on the bridge (in the test's own namespace)


class Network:
    """Hosts joined by one bridge; :meth:`down` removes all of it, whatever state it is in."""

    def __init__(self, names: Iterable[str]) -> None:
        self.id = secrets.token_hex(2)
        base = f"{PREFIX}{self.id}"
        self.bridge = f"{base}br"
        self.hosts = {
            name: Host(name, f"{SUBNET}.{i}", f"{base}-{name}", f"{base}v{i}")
            for i, name in enumerate(names, start=2)
        }

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- building and tearing down ------------------------------------------------------------
    def up(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.id}.pid").write_text(str(os.getpid()))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts.values():
            peer = f"{host.veth}p"
            _ip("netns", "add", host.ns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.ns)
            _ip("-n", host.ns, "link", "set", peer, "name", "eth0")
            _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            self.tmpdir(name=host.name).mkdir(mode=0o700, exist_ok=True)
            etc = Path("/etc/netns") / host.ns
            etc.mkdir(parents=True, exist_ok=True)
            others = "".join(f"{h.ip} {h.name}\n" for h in self.hosts.values() if h is not host)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n{others}"
            )

    def down(self) -> None:
        """Kill every process in the hosts, then remove links, namespaces and files."""
        _teardown(self.id)

    @staticmethod
    def clean_leftovers() -> list[str]:
        """Tear down the runs whose test process is gone; returns their ids."""
        cleaned = []
        for pidfile in STATE_DIR.glob("*.pid") if STATE_DIR.is_dir() else ():
            try:
                owner = int(pidfile.read_text())
            except (OSError, ValueError):
                owner = -1
            if owner > 0 and psutil.pid_exists(owner):
                continue  # a run beside ours: not ours to touch
            _teardown(pidfile.stem)
            cleaned.append(pidfile.stem)
        return cleaned

    # -- running things on a host -------------------------------------------------------------
    def prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program on host ``name``, under its host name.

        On every host but ``driver``, the driver's temporary directory is hidden under an
        empty tmpfs (``ip netns exec`` gives each command a mount namespace of its own, whose
        mounts do not propagate back): what the notebook keeps there, such as a folder of its
        own modules, really is missing on the workers, as on a real cluster."""
        host = self.hosts[name]
        script = 'hostname "$0" && TMPDIR="$1" && export TMPDIR && '
        if name != "driver" and "driver" in self.hosts:
            script += 'mount -t tmpfs -o size=1m,mode=0700 nbdist-hidden "$2" && '
        return ["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c",
                script + 'shift 2 && exec "$@"', host.name, str(self.tmpdir(name)),
                str(self.tmpdir("driver") if "driver" in self.hosts else "")]

    def tmpdir(self, name: str) -> Path:
        """Host ``name``'s temporary directory (its ``TMPDIR``)."""
        return Path("/tmp") / f"{PREFIX}{self.id}-{name}.tmp"

    def run(self, name: str, argv: list[str], timeout: float = 60) -> str:
        """Run a short command on host ``name``; its stdout (fails on a non-zero exit)."""
        done = subprocess.run([*self.prefix(name), *argv], capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{argv} on {name} failed ({done.returncode}): {done.stderr}")
        return done.stdout

    def processes(self, name: str) -> list[psutil.Process]:
        """Every process whose network namespace is host ``name``'s."""
        return _in_namespace(self.hosts[name].ns)

    # -- the network --------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Unplug host ``name``: its packets go nowhere, its connections stay open."""
        _ip("link", "set", self.hosts[name].veth, "down")

    def plug(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].veth, "up")


def _ns_inode(ns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def _in_namespace(ns: str) -> list[psutil.Process]:
    inode = _ns_inode(ns)
    if inode is None:
        return []
    found = []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inode:
                found.append(proc)
        except OSError:
            pass  # gone, or a kernel thread
    return found


def _teardown(run: str) -> None:
    """Remove everything of run ``run``: processes first, then links, namespaces, files."""
    base = f"{PREFIX}{run}"
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
                  if line.startswith(f"{base}-")]
    # Processes by namespace: whatever Spark, the kernel or a rank started there, also those
    # that left the process group of what the tests started.
    for _ in range(3):
        procs = [p for ns in namespaces for p in _in_namespace(ns)]
        if not procs:
            break
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=10)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if link.startswith(base) and link != f"{base}br":
            _ip("link", "del", link, check=False)  # a veth: its peer in the namespace goes too
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", f"{base}br", check=False)
    for etc in Path("/etc/netns").glob(f"{base}-*"):
        shutil.rmtree(etc, ignore_errors=True)
    for tmp in Path("/tmp").glob(f"{base}-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    (STATE_DIR / f"{run}.pid").unlink(missing_ok=True)
