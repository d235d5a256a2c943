"""A real SLURM cluster on simulated nodes: slurmctld and one slurmd per network-namespace node.

Built on `SimCluster(nodes, hostnames=True)` (tests/simcluster.py): each node has its own address,
host name and UTS namespace, so slurmd registers under its node's name and srun starts tasks
there, as on a real cluster. Everything private lives in one directory: a munged with its own
socket (the machine's key, copied), slurm.conf, the controller's state, each slurmd's spool and
the logs; every daemon and job is ended and the namespaces removed on exit.

Needs root, iproute2 and Debian's `slurm-wlm` and `munge` packages; `unavailable_reason()` says
why not, for a skip. Commands (`srun`, `sbatch`, `squeue`, `scontrol`) run inside node 0 through
`run` / `start`, with SLURM_CONF pointing at this cluster's file.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Sequence

from simcluster import SimCluster
from simcluster import unavailable_reason as namespaces_unavailable

_DAEMONS = ("slurmctld", "slurmd", "srun", "sbatch", "munged", "munge")


def unavailable_reason() -> str | None:
    """Why a SLURM cluster cannot be made here, or None."""
    missing = [tool for tool in _DAEMONS if shutil.which(tool) is None
               and not os.path.exists(f"/usr/sbin/{tool}")]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)")
    if not os.path.exists("/etc/munge/munge.key"):
        return "no /etc/munge/munge.key (the munge package makes one)"
    return namespaces_unavailable()


_MOUNT_CGROUPS = ("mount -t tmpfs cgroups /sys/fs/cgroup && for c in $(awk -F: '$2 != \"\" "
                  "{print $2}' /proc/self/cgroup | tr , ' '); do case $c in name=*) continue;; "
                  "esac; mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup "
                  "/sys/fs/cgroup/$c; done")


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SimSlurm:
    """slurmctld on node 0 and a slurmd on every node of a fresh SimCluster, in `workdir`."""

    def __init__(self, nodes: int, workdir: str, cpus: int = 4, slurmd_timeout: int = 30,
                 requeue_delay: int = 120) -> None:
        self.cluster = SimCluster(nodes, hostnames=True)
        self.workdir = workdir
        self.cpus = cpus
        # How long slurmctld waits on a silent slurmd before it marks the node DOWN (and requeues
        # or ends its jobs), and how long a requeued job waits before it may start again: the job
        # credential's lifetime (AuthInfo's cred_expire; SLURM's defaults 300 s and 120 s).
        self.slurmd_timeout = slurmd_timeout
        self.requeue_delay = requeue_delay
        self.conf = os.path.join(workdir, "slurm.conf")
        self._daemons: list[subprocess.Popen] = []

    @property
    def names(self) -> list[str]:
        """The nodes' host names (also their SLURM node names)."""
        return self.cluster.names

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a user's shell on this cluster has: SLURM_CONF set."""
        return {**os.environ, "SLURM_CONF": self.conf, **extra}

    def __enter__(self) -> "SimSlurm":
        self.cluster.__enter__()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        w = self.workdir
        for sub in ("state", "log", *(f"spool-{n}" for n in self.names)):
            os.makedirs(os.path.join(w, sub), exist_ok=True)
        key = os.path.join(w, "munge.key")
        shutil.copyfile("/etc/munge/munge.key", key)
        os.chmod(key, 0o400)
        sock = os.path.join(w, "munge.sock")
        self._daemons.append(subprocess.Popen(
            [_exe("munged"), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
             f"--log-file={w}/log/munged.log", f"--pid-file={w}/munged.pid",
             f"--seed-file={w}/munge.seed"], stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True))
        nodes = "".join(
            f"NodeName={name} NodeAddr={self.cluster.address(i)} CPUs={self.cpus} "
            "RealMemory=1000 State=UNKNOWN\n" for i, name in enumerate(self.names))
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=sim
SlurmctldHost={self.names[0]}({self.cluster.address(0)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire={self.requeue_delay}
CredType=cred/munge
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool-%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout={self.slurmd_timeout}
InactiveLimit=0
KillWait=5
MinJobAge=300
{nodes}PartitionName=sim Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        with open(os.path.join(w, "cgroup.conf"), "w") as f:
            # slurmd initialises its cgroup plugin even with proctrack/linuxproc; `ip netns exec`
            # mounts a fresh /sys without cgroups, so each slurmd mounts the machine's cgroup v1
            # hierarchies again there (in the mount namespace ip gave it: the machine's own
            # mounts stay as they are).
            f.write("CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n")
        self._daemons.append(self.cluster.start(0, [_exe("slurmctld"), "-D", "-i", "-f", self.conf],
                                                env=self.env(), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.STDOUT))
        for i in range(len(self.names)):
            self._start_slurmd(i)
        self.wait_idle(60)

    def _start_slurmd(self, node: int) -> None:
        self._daemons.append(self.cluster.start(
            node, ["sh", "-c", _MOUNT_CGROUPS + ' && exec "$@"', "slurmd",
                   _exe("slurmd"), "-D", "-N", self.names[node], "-f", self.conf], env=self.env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

    def fail_node(self, node: int) -> list[int]:
        """Kill every process of `node` at once (its slurmd, slurmstepd, the job's ranks), as a
        node that loses power; returns the pids killed. Its address stays, refusing connections."""
        listed = subprocess.run(["ip", "netns", "pids", self.cluster.names[node]],
                                capture_output=True, text=True, check=True).stdout.split()
        # Frozen first, all of them: killed one by one, a rank would outlive its launcher by a
        # moment and run its parent-death SIGTERM handler, which a node losing power never does.
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in map(int, listed):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
        return [int(pid) for pid in listed]

    def restore_node(self, node: int, timeout: float = 60) -> None:
        """Start `node`'s slurmd again (a rebooted node) and wait until every node is idle."""
        self._start_slurmd(node)
        self.wait_idle(timeout)

    def run(self, argv: Sequence[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        """Run a command in node 0 (a login node) to completion."""
        proc = self.start(argv, **env)
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, "")

    def start(self, argv: Sequence[str], cwd: str | None = None, **env: str) -> subprocess.Popen:
        """Start a command in node 0, its output in .stdout (text, stderr merged)."""
        return self.cluster.start(0, list(argv), env=self.env(**env), cwd=cwd,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def node_states(self) -> dict[str, str]:
        """{node name: its state} as sinfo sees it."""
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float) -> None:
        """Wait until every node registered and is idle (or raise, with the daemons' logs)."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                states = self.node_states()
            except subprocess.TimeoutExpired:
                states = {}
            if len(states) == len(self.names) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        logs = ""
        for name in sorted(os.listdir(os.path.join(self.workdir, "log"))):
            with open(os.path.join(self.workdir, "log", name), errors="replace") as f:
                logs += f"--- {name}\n{f.read()[-2000:]}\n"
        raise RuntimeError(f"SLURM nodes not idle after {timeout} s: {states}\n{logs}")

    def close(self) -> None:
        """Cancel jobs, stop the daemons, remove the namespaces."""
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        # slurmstepd and the job steps leave slurmd's process group; all of them carry this
        # cluster's SLURM_CONF (the daemons' and the submitting shell's environment).
        marker = f"SLURM_CONF={self.conf}".encode() + b"\0"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read() + b"\0" and int(pid) != os.getpid():
                        os.kill(int(pid), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue
        self.cluster.close()

