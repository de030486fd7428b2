"""Process groups: one JAX process per host, joined through JAX's distributed runtime (`jax.distributed`).

Where the group comes from (`find_group`); explicit flags win field by field over the environment:
- explicit: `--coordinator HOST:PORT --num-processes N --process-id I` (or the same in the variables
  COMPOSER_JAX_COORDINATOR, COMPOSER_JAX_NUM_PROCESSES, COMPOSER_JAX_PROCESS_ID);
- SLURM (`srun`, one task per node): SLURM_NTASKS, SLURM_PROCID, the first host of
  SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST); the port is derived from SLURM_JOB_ID so two jobs
  sharing a node do not collide, unless `--coordinator-port` says otherwise;
- Kubernetes indexed Job / JobSet: JOB_COMPLETION_INDEX (set by Kubernetes) is the process id; the
  process count is COMPOSER_JAX_NUM_PROCESSES; the coordinator is COMPOSER_JAX_COORDINATOR or, in a
  JobSet, pod 0 of the replicated job by its DNS name `{JOBSET_NAME}-{REPLICATED_JOB_NAME}-0-0.{JOBSET_NAME}`
  (both names exposed to the container from the pod's `jobset.sigs.k8s.io/*` labels).
A group of one process is no group: nothing is initialised.

A dead peer. JAX's own heartbeat ends a surviving process with a fatal abort and a long C++ log. A
`PeerWatchdog` thread beats through the coordination service's key-value store instead and, when a peer
stops beating for `peer_timeout_s` (or says it failed), prints one line naming the peer and exits with
EXIT_PEER_LOST: a process blocked in a collective never returns to Python, so only an exit ends it.
JAX's heartbeat timeout is set a margin later, as a backstop. A collective whose peer is gone may also
fail at once (gloo: connection reset); `await_peers` then pings the peers (the watchdogs answer
through the store) and lets the watchdog name the one that does not answer. A process that finishes
marks itself done (peers stop watching it); one that fails marks itself failed with its one-line
reason. A group that does not form within `init_timeout_s` ends the same way (one line, before JAX's
own abort). Process 0's death takes the coordination service with it: JAX then aborts the others at
once, with its own message (its client's callback for that is not usable from Python: jaxlib 0.10.2
cannot convert the status it passes).

On CPU, cross-process collectives need an implementation: gloo is switched on unless the user chose
(JAX_CPU_COLLECTIVES_IMPLEMENTATION).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import time
from collections.abc import Mapping

import jax
import numpy as np

EXIT_PEER_LOST = 75           # EX_TEMPFAIL: the job may be retried (it resumes from its last checkpoint)
DEFAULT_PORT = 12355          # explicit / Kubernetes coordinators given without a port
BACKSTOP_MARGIN_S = 30        # JAX's own heartbeat timeout = peer timeout + this
_KEY = "composer_jax/watchdog"


class DistributedError(RuntimeError):
    """A process group that cannot be formed or has lost a member (one line, naming the flag or peer)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    coordinator: str              # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    source: str                   # where it came from: "flags", "SLURM" or "Kubernetes"

    def __post_init__(self):
        if self.num_processes < 1:
            raise DistributedError(f"--num-processes must be >= 1, got {self.num_processes} (from {self.source})")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id} "
                                   f"(from {self.source})")
        if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):\d+", self.coordinator):  # host or [IPv6], port
            raise DistributedError(f"--coordinator must be HOST:PORT, got {self.coordinator!r} (from {self.source})")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[007-009,012]-ib,cpu1' -> 'gpu007-ib'."""
    head = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", nodelist.strip())[0]
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", head)


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name} must be an integer, got {value!r}") from None


def _with_port(address: str, port: int) -> str:
    return address if re.search(r":\d+$", address) else f"{address}:{port}"


def launched_tasks(environ: Mapping[str, str] = os.environ) -> tuple[int, str] | None:
    """(how many tasks the launcher started for this step, the variable that says so) when more than one:
    COMPOSER_JAX_NUM_PROCESSES, else an srun step's SLURM_NTASKS (a batch script outside srun also sees
    SLURM_NTASKS, of the whole job: only a job step's count counts); None for one task."""
    count, source = environ.get("COMPOSER_JAX_NUM_PROCESSES"), "COMPOSER_JAX_NUM_PROCESSES"
    if not count and "SLURM_STEP_ID" in environ:
        count, source = environ.get("SLURM_NTASKS"), "SLURM_NTASKS (an srun step)"
    if count and count.strip().isdigit() and int(count) > 1:
        return int(count), source
    return None


def find_group(environ: Mapping[str, str] = os.environ, *, coordinator: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               coordinator_port: int | None = None) -> ProcessGroup | None:
    """The process group described by the flags and the environment (see the module docstring), or None
    for a single process."""
    coordinator = coordinator or environ.get("COMPOSER_JAX_COORDINATOR")
    if num_processes is None and "COMPOSER_JAX_NUM_PROCESSES" in environ:
        num_processes = _int(environ["COMPOSER_JAX_NUM_PROCESSES"], "COMPOSER_JAX_NUM_PROCESSES")
    if process_id is None and "COMPOSER_JAX_PROCESS_ID" in environ:
        process_id = _int(environ["COMPOSER_JAX_PROCESS_ID"], "COMPOSER_JAX_PROCESS_ID")
    port = coordinator_port or DEFAULT_PORT
    source, explicit = "flags", (coordinator, process_id)
    if "SLURM_JOB_ID" in environ and "SLURM_NTASKS" in environ:
        source = "SLURM"
        if num_processes is None:
            num_processes = _int(environ["SLURM_NTASKS"], "SLURM_NTASKS")
        if process_id is None:
            process_id = _int(environ.get("SLURM_PROCID", "0"), "SLURM_PROCID")
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if coordinator is None and nodes:
            job_port = 61440 + _int(environ["SLURM_JOB_ID"], "SLURM_JOB_ID") % 4096  # 61440..65535
            coordinator = f"{first_slurm_host(nodes)}:{coordinator_port or job_port}"
    elif "JOB_COMPLETION_INDEX" in environ:
        source = "Kubernetes"
        if process_id is None:
            process_id = _int(environ["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")
        if coordinator is None and environ.get("JOBSET_NAME") and environ.get("REPLICATED_JOB_NAME"):
            jobset = environ["JOBSET_NAME"]
            coordinator = f"{jobset}-{environ['REPLICATED_JOB_NAME']}-0-0.{jobset}"
    if num_processes is None or num_processes == 1:
        if source == "Kubernetes" and num_processes is None:
            raise DistributedError("a Kubernetes indexed job (JOB_COMPLETION_INDEX is set) needs the process count: "
                                   "set COMPOSER_JAX_NUM_PROCESSES or --num-processes")
        if explicit[0] is not None or (explicit[1] or 0) > 0:
            raise DistributedError(f"--coordinator / --process-id given without --num-processes > 1 (from {source})")
        return None
    if process_id is None:
        raise DistributedError(f"{num_processes} processes but no process id: pass --process-id (from {source})")
    if coordinator is None:
        raise DistributedError(f"{num_processes} processes but no coordinator: pass --coordinator HOST:PORT "
                               f"(from {source})")
    return ProcessGroup(_with_port(coordinator, port), num_processes, process_id, source)


def _client():
    """JAX's coordination-service client (its key-value store), through orbax's public accessor."""
    from orbax.checkpoint import multihost

    return multihost.get_jax_distributed_client()


def _exit_with(label: str, message: str) -> None:
    """End this process now with one line (from any thread; a main thread blocked in a collective or in
    JAX's start-up never returns to Python)."""
    print(f"{label}: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


class PeerWatchdog:
    """Beats every `interval_s` through the coordination service; exits this process with one line on
    stderr when a peer has not beaten for `timeout_s`, or has marked itself failed (module docstring)."""

    def __init__(self, group: ProcessGroup, timeout_s: float, label: str = "composer-jax"):
        self.group, self.timeout_s, self.label = group, timeout_s, label
        self.interval_s = max(0.2, min(5.0, timeout_s / 6))
        self._stop = threading.Event()
        self._done: set[str] = set()            # peers that have finished
        self._thread = threading.Thread(target=self._run, name="composer-jax-peer-watchdog", daemon=True)

    def start(self) -> PeerWatchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        me, n = self.group.process_id, self.group.num_processes
        client, beat = _client(), 0
        now = time.monotonic()
        last_seen = {p: (None, now) for p in range(n) if p != me}   # peer -> (its last beat, when it changed)
        coordinator_ok = now
        while not self._stop.wait(0 if beat == 0 else self.interval_s):
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(f"{_KEY}/beat/{me}", str(beat), allow_overwrite=True)
                beats = {k.rsplit("/", 1)[-1]: v for k, v in client.key_value_dir_get(f"{_KEY}/beat/")}
                done = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(f"{_KEY}/done/")}
                failed = client.key_value_dir_get(f"{_KEY}/failed/")
                for key, nonce in client.key_value_dir_get(f"{_KEY}/ping/"):   # answer `await_peers` of others
                    client.key_value_set(f"{_KEY}/pong/{key.rsplit('/', 1)[-1]}/{nonce}/{me}", "1",
                                         allow_overwrite=True)
            except Exception as e:  # noqa: BLE001 - the coordination service (process 0) is unreachable
                if self._stop.is_set():
                    return
                if now - coordinator_ok > self.timeout_s:
                    _exit_with(self.label, f"process {me} of {n} lost the coordinator (process 0 at "
                                           f"{self.group.coordinator}) for {now - coordinator_ok:.0f} s (peer timeout "
                                           f"{self.timeout_s:g} s): "
                                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
                continue
            coordinator_ok, self._done = now, done
            if failed:
                key, reason = failed[0]
                _exit_with(self.label, f"process {key.rsplit('/', 1)[-1]} of {n} failed: {reason}")
            for peer, (value, since) in last_seen.items():
                current = beats.get(str(peer))
                if current != value or str(peer) in done:
                    last_seen[peer] = (current, now)
                elif now - since > self.timeout_s:
                    what = "never joined the watch" if value is None else "stopped responding"
                    _exit_with(self.label, f"process {peer} of {n} {what} (no heartbeat for {now - since:.0f} s, "
                                           f"peer timeout {self.timeout_s:g} s): it died or hangs; stopping process "
                                           f"{me} too")

    def await_peers(self) -> None:
        """Return once every peer has answered a ping sent now (or has finished); a peer that has died
        never answers, and the watchdog ends this process first, with its line naming the peer. For a
        failed collective: the peer at fault is named, if one is gone, rather than the collective's error."""
        me, client, nonce = self.group.process_id, _client(), str(time.time_ns())
        peers = {str(p) for p in range(self.group.num_processes) if p != me}
        try:
            client.key_value_set(f"{_KEY}/ping/{me}", nonce, allow_overwrite=True)
            while self._thread.is_alive():
                answered = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(f"{_KEY}/pong/{me}/{nonce}/")}
                if peers <= answered | self._done:
                    return
                time.sleep(self.interval_s / 4)
        except Exception:  # noqa: BLE001 - the coordinator is gone: the watchdog (or JAX) ends this process
            time.sleep(2 * self.timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def finish(self) -> None:
        """This process is done: peers stop watching it."""
        self.stop()
        try:
            _client().key_value_set(f"{_KEY}/done/{self.group.process_id}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator has gone already: nobody is left to tell
            pass

    def fail(self, reason: str) -> None:
        """This process failed with the one-line `reason`: peers exit with it instead of waiting."""
        self.stop()
        try:
            _client().key_value_set(f"{_KEY}/failed/{self.group.process_id}", reason, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator has gone already: the peers find out by timeout
            pass


def initialize(group: ProcessGroup, *, peer_timeout_s: float = 120.0, init_timeout_s: int = 300,
               label: str = "composer-jax") -> PeerWatchdog:
    """Join `group` (blocks until all processes have joined, at most `init_timeout_s`) and start the
    peer watchdog. Call before JAX starts its backend (the first `jax.devices()` or computation)."""
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX aborts (C++ stack trace) when the group does not form in time: say it in one line first.
    late = threading.Timer(init_timeout_s, _exit_with, (label, (
        f"process {group.process_id} of {group.num_processes} waited {init_timeout_s:g} s (--init-timeout) for the "
        f"group at {group.coordinator} (from {group.source}) to form: not every process started, or process 0 is "
        "unreachable from this host")))
    late.daemon = True
    late.start()
    try:
        jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                                   process_id=group.process_id, cluster_detection_method="deactivate",
                                   initialization_timeout=int(init_timeout_s + BACKSTOP_MARGIN_S),
                                   heartbeat_timeout_seconds=int(peer_timeout_s + BACKSTOP_MARGIN_S))
    except Exception as e:  # noqa: BLE001 - XLA reports a failed join as a multi-line runtime error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"process {group.process_id} of {group.num_processes} could not join the group at "
                               f"{group.coordinator} (from {group.source}): {first}") from None
    finally:
        late.cancel()
    _orbax_barriers_through_the_coordinator()
    return PeerWatchdog(group, peer_timeout_s, label).start()


def _orbax_barriers_through_the_coordinator() -> None:
    """orbax's multi-process barriers (an async save's commit runs them in a background thread) are, by
    default, JAX collectives: next to the training step's own collectives they interleave in a different
    order on each process, and the group deadlocks or gloo aborts on mismatched sizes. Through the
    coordination service (orbax's `experimental_orbax_use_distributed_barrier`) they are not collectives."""
    from absl import flags

    import orbax.checkpoint  # noqa: F401 - defines the flag

    if not flags.FLAGS.is_parsed():     # absl refuses to read an unparsed flag; composer-jax parses none
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def process_major_devices() -> list:
    """All devices, process by process (each process's in its own order): reshaped row-major into a
    mesh, the leading axes then span processes (hosts) and the trailing ones stay within a host."""
    devices = jax.devices()
    return [devices[i] for i in sorted(range(len(devices)), key=lambda i: (devices[i].process_index, i))]


def any_process(flag: bool) -> bool:
    """Whether `flag` holds in any process of the group. A collective: every process calls it at the same
    point of the program."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def to_host(tree):
    """Every leaf of `tree` whole, as numpy, on every process (in a group: a collective, as `any_process`;
    `jax.device_get` cannot fetch an array sharded over other processes' devices)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def agree(text: str) -> str:
    """Process 0's `text` (ASCII, as long on every process), on every process of the group (a collective)."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    data = multihost_utils.broadcast_one_to_all(np.frombuffer(text.encode("ascii"), np.uint8))
    return bytes(np.asarray(data, np.uint8)).decode("ascii")
