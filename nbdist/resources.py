"""What a rank uses: CPU, resident memory and (where NVIDIA's library is there) its GPU.

The rank's supervisor (``rank/supervisor.py``) runs a :class:`Sampler` beside the rank: every
``SAMPLE_S`` it measures the rank's process tree and sends one ``res`` event on the channel,
which the driver keeps in ``RankState.resources`` and views show in the rank's row and in
``%dist_status JOB``. The event is lazy (``rank.client._LAZY``): it waits for other events to travel
with, and a newer one replaces one still queued, so it costs the channel nothing a heartbeat
does not already cost.

The event (``protocol``'s words)::

    {"t": "res", "cpu": 187.5, "rss": 1234567890,
     "gpus": [{"id": "0", "util": 93, "mem": 31500000000, "total": 85000000000}]}

``cpu`` is the percent of one core used by the rank and its descendants over the last interval
(200 = two cores busy); ``rss`` is their resident memory in bytes (the rank's guardian, which
shares most pages with the rank, is left out so they are not counted twice). ``gpus`` comes only
where ``pynvml`` (the ``nvidia-ml-py`` distribution) imports and NVML starts, for the devices
the rank was given: utilisation (percent of time a kernel ran, over NVML's last sample period)
and memory used on the *device*, whichever process holds it. Without them the key is absent.

Standard library and psutil only at import: it runs in Spark's Python workers too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbdist.protocol import GpuSample, ResourcesEvent, size_text

#: How often a rank's resources are measured and sent. Views refresh at ~10 Hz, but CPU and
#: memory move slowly, and each sample walks the rank's process tree (``/proc``).
SAMPLE_S = 2.0


@dataclass(frozen=True)
class GpuUse:
    """One device's utilisation (percent) and memory (bytes used, bytes in all)."""

    id: str
    util: int | None
    mem: int | None
    total: int | None


@dataclass(frozen=True)
class Resources:
    """A rank's latest sample, as the driver keeps it (``RankState.resources``)."""

    cpu: float | None
    rss: int | None
    gpus: tuple[GpuUse, ...] = ()
    at: float = 0.0  # the driver's time.time() when it arrived
    peak: int | None = None  # the most resident memory so far (``Sampler.peak_rss``)

    @classmethod
    def from_event(cls, event: Mapping[str, Any], at: float) -> Resources:
        """Read a ``res`` event; fields of the wrong type are left out, never trusted."""
        cpu, rss = event.get("cpu"), event.get("rss")
        gpus = []
        for g in event.get("gpus") or ():
            if isinstance(g, dict):
                gpus.append(GpuUse(str(g.get("id", "")), _int(g.get("util")),
                                   _int(g.get("mem")), _int(g.get("total"))))
        return cls(float(cpu) if isinstance(cpu, (int, float)) else None, _int(rss),
                   tuple(gpus), at, _int(event.get("peak")))

    def text(self) -> str:
        """``CPU 187% · RSS 1.2 GB · GPU0 93% 31.5/85.0 GB`` (GPU parts only when sampled)."""
        parts = []
        if self.cpu is not None:
            parts.append(f"CPU {self.cpu:.0f}%")
        if self.rss is not None:
            parts.append(f"RSS {size_text(self.rss)}")
        for g in self.gpus:
            gpu = f"GPU{g.id}"
            if g.util is not None:
                gpu += f" {g.util}%"
            if g.mem is not None:
                gpu += f" {g.mem / 1e9:.1f}" + (f"/{g.total / 1e9:.1f} GB" if g.total else " GB")
            parts.append(gpu)
        return " · ".join(parts)


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class _Gpus:
    """NVML handles of the rank's devices, or nothing where NVML is not there.

    Devices are named as ``CUDA_VISIBLE_DEVICES`` names them: an index or a ``GPU-…`` UUID.
    An index is NVML's order, which is CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; the
    launchers hand out the indices that ``nvidia-smi`` (NVML) lists, so they agree.
    """

    def __init__(self, ids: Sequence[str]) -> None:
        self.nvml: Any = None
        self.handles: list[tuple[str, Any]] = []
        if not ids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # ImportError: not installed; NVMLError: no driver, no device
            return
        self.nvml = pynvml
        for gid in ids:
            try:
                handle = (pynvml.nvmlDeviceGetHandleByUUID(gid) if gid.startswith(("GPU-", "MIG-"))
                          else pynvml.nvmlDeviceGetHandleByIndex(int(gid)))
            except Exception:  # a name NVML does not know: that device goes unmeasured
                continue
            self.handles.append((gid, handle))

    def sample(self) -> list[GpuSample]:
        out = []
        for gid, handle in self.handles:
            g: GpuSample = {"id": gid}
            try:
                g["util"] = int(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:  # NVMLError_NotSupported on some devices (MIG slices)
                pass
            try:
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                g["mem"], g["total"] = int(mem.used), int(mem.total)
            except Exception:
                pass
            out.append(g)
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass


class Sampler:
    """Measures a rank's process tree every ``every`` seconds and hands each sample to ``send``.

    Parameters
    ----------
    pid : callable
        The rank's own pid (the root of what is measured), or None while it has none yet.
    gpus : sequence of str
        The rank's devices (``CUDA_VISIBLE_DEVICES``' names); empty: no GPU fields.
    send : callable
        Called with each sample as ``res`` event fields, on the sampler's thread.
    seen : callable, optional
        Called with the rank's pid at each sample (the supervisor notes its memory cgroup).
    """

    def __init__(self, pid: Callable[[], int | None], gpus: Sequence[str],
                 send: Callable[[ResourcesEvent], None], every: float = SAMPLE_S,
                 seen: Callable[[int], None] | None = None) -> None:
        self._pid = pid
        self._seen = seen
        #: The most resident memory the rank's tree held: the largest sum of a sample, or the
        #: rank's own high-water mark (``VmHWM``) where that is more; None before a sample.
        self.peak_rss: int | None = None
        self._gpu_ids = tuple(gpus)
        self._send = send
        self._every = every
        self._stop = threading.Event()
        # CPU seconds (user + system) per process, by (pid, create time) so that a reused pid
        # is a new process. A process that ended between two samples takes the CPU time of
        # its last interval with it: a small undercount, where psutil.cpu_percent per process
        # would cost one Process object kept per descendant.
        self._cpu: dict[tuple[int, float], float] = {}
        self._last = 0.0
        #: The rank's process and its descendants at the last sample (``rss_now``); replaced
        #: whole, never edited.
        self._root: Any = None
        self._children: tuple[Any, ...] = ()
        #: Resident memory of the descendants of the process the last sample measured, and
        #: that process's pid: until the rank's interpreter says which it is, the sampled
        #: process may be its guardian, whose descendants are the rank itself and its own.
        self._children_rss: tuple[int | None, int] = (None, 0)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbdist-resources")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _loop(self) -> None:
        try:
            import psutil  # noqa: F401  (a rank without psutil sends no samples)
        except ImportError:
            return
        gpus = _Gpus(self._gpu_ids)
        try:
            # Until the rank has a process, look every quarter second: its first sample (its
            # memory, and the start of its first CPU interval) then comes soon after it starts.
            while not self._stop.wait(self._every if self._last else min(self._every, 0.25)):
                event = self.sample(gpus)
                if event:
                    self._send(event)
        finally:
            gpus.close()

    def sample(self, gpus: _Gpus | None = None) -> ResourcesEvent:
        """One sample of the rank's tree (empty while the rank has no process)."""
        import psutil

        pid = self._pid()
        if pid is None:
            return {}
        now = time.monotonic()
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:  # the rank is gone
            return {}
        self._root, self._children = root, tuple(procs[1:])
        rss = 0
        root_rss = 0
        cpu: dict[tuple[int, float], float] = {}
        used = 0.0
        for p in procs:
            try:
                with p.oneshot():  # one read of /proc/PID/stat for both
                    times = p.cpu_times()
                    key = (p.pid, p.create_time())
                    rss += p.memory_info().rss
            except psutil.Error:  # ended while we looked
                continue
            if p is root:
                root_rss = rss
            total = times.user + times.system
            cpu[key] = total
            # A process new since the last sample counts from its start (its whole CPU time).
            used += total - self._cpu.get(key, 0.0)
        if self._seen is not None:
            self._seen(pid)
        self._children_rss = (pid, rss - root_rss)
        self.peak_rss = max(self.peak_rss or 0, rss, _high_water(pid))
        event: ResourcesEvent = {"t": "res", "rss": rss, "peak": self.peak_rss}
        if self._last:
            event["cpu"] = round(100.0 * max(0.0, used) / max(now - self._last, 1e-3), 1)
        self._cpu, self._last = cpu, now
        if gpus is not None and gpus.handles:
            event["gpus"] = gpus.sample()
        return event


    def rss_with(self, own: int) -> int | None:
        """The rank's memory from its ``own`` (which it read itself after a cell) and its
        children's at the last sample, where that sample measured the rank; else as
        :meth:`rss_now` measures it (a sample of its guardian, taken before the rank said
        which process it is, counted the rank among the children: the rank twice)."""
        root, children = self._children_rss
        if root is not None and root == self._pid():
            return own + children
        return self.rss_now()

    def rss_now(self) -> int | None:
        """Resident memory of the rank and of the descendants the last sample found, now
        (None while the rank has no process, or without psutil).

        A session cell's end carries it (``%dist_session``). Finding new descendants means
        reading every process's ``/proc/PID/stat`` (psutil's ``children``): about 4 ms with
        85 processes on the host, 16 times in a row in the kernel for a 16-rank session's
        cell, where this costs a few reads per process. A descendant the cell started is
        counted from the next sample on (``SAMPLE_S``), which updates the same figure.
        """
        pid = self._pid()
        if pid is None:
            return None
        try:
            import psutil
        except ImportError:  # a rank's host without psutil sends no memory
            return None
        root, children = self._root, self._children
        try:
            if root is None or root.pid != pid:
                root, children = psutil.Process(pid), ()
            rss = int(root.memory_info().rss)
        except psutil.Error:  # the rank is gone
            return None
        for p in children:
            try:
                if p.is_running():  # not a new process under a reused pid
                    rss += p.memory_info().rss
            except psutil.Error:  # ended since
                continue
        return rss


def _high_water(pid: int) -> int:
    """The process's peak resident memory (``VmHWM``, Linux), in bytes; 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
