"""A private stand-in for a cloud cluster: Ray's cluster launcher, local provider, SSH on 127.0.0.1.

`LocalLauncher` runs the project's own cluster.yaml, changed only where AWS must become this
machine (the local provider's head is 127.0.0.1, reached over SSH on port 2222), inside
Linux namespaces it creates and removes:

* network: only ``lo`` (Ray binds nothing but 127.0.0.1, and nothing outside is reachable, so
  everything is installed before: apt packages, and a wheelhouse for the setup commands' pip);
* mount: a private ``/tmp`` (``/tmp/ray`` of other Ray instances on the machine is not seen) and a
  private ``/etc/passwd`` whose root home is a temporary directory (the real ``~/.ssh``,
  ``~/.bashrc`` and ``~/.ray`` are never read or written), a ``/proc`` of this PID namespace only.
  What the launcher needs from under the real ``/tmp`` is bound back in at the same path
  (`paths_to_keep`): the repository (a clone under ``/tmp`` is common) and the running Python's
  installation and import paths;
* PID: ``ray stop`` (which the launcher runs on the head) sees, and can kill, only this
  cluster's processes, and killing the namespace's first process ends every one of them.

The head's Python is a virtual environment on top of the current interpreter's packages (so
the setup commands' ``pip install`` of this repository lands there, never in the interpreter
running the tests). Every command goes through ``nsenter`` with a clean environment.
"""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Dict, List, Optional

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SSH_PORT = 2222
APT_PACKAGES = {"sshd": "openssh-server", "rsync": "rsync", "nc": "netcat-openbsd"}
MARKER = "rte-launcher-"  # prefix of the temporary directory: every path of this test names it


def cannot_run() -> Optional[str]:
    """Why the launcher test cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root (network/mount/PID namespaces, sshd with root login)"
    for tool in ("unshare", "nsenter", "ip", "apt-get"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"needs {tool}"
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


def install_packages() -> None:
    """openssh-server, rsync, netcat-openbsd through apt (the launcher needs ssh, rsync and nc)."""
    missing = [pkg for tool, pkg in APT_PACKAGES.items() if not _which(tool)]
    if not missing:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600, check=True)
        subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)


def _which(tool: str) -> Optional[str]:
    return shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/usr/bin/{tool}") if os.path.exists(p)), None)


def paths_to_keep(hidden: str = "/tmp") -> List[str]:
    """The directories under ``hidden`` that the launcher must still see once a private ``hidden``
    covers it: the repository (``ray up`` runs in it and rsyncs it to the head) and the running
    Python (its prefixes and every ``sys.path`` directory: a virtual environment or an editable
    install may live in a clone under /tmp). Real paths, outermost only, sorted.
    """
    candidates = [REPO, sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)]
    candidates += [p for p in sys.path if p and os.path.isdir(p)]
    hidden = os.path.realpath(hidden)
    found = set()
    for path in candidates:
        for form in {os.path.abspath(path), os.path.realpath(path)}:  # a symlink under /tmp, or a target there
            if form.startswith(hidden + os.sep):
                found.add(form)
    return sorted(p for p in found if not any(p.startswith(q + os.sep) for q in found))


def derived_config(base: Dict, *, key: str, num_cpus: int) -> Dict:
    """cluster.yaml with AWS replaced by the local provider; everything else as shipped."""
    cfg = copy.deepcopy(base)
    cfg["cluster_name"] = "rte-launcher"
    cfg["max_workers"] = 0  # the local provider allows at most len(worker_ips) workers
    cfg["provider"] = {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    # The auth schema has no ssh_port: reach sshd on 127.0.0.1:2222 through a proxy command.
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": key, "ssh_proxy_command": f"nc %h {SSH_PORT}"}
    for key_name in ("available_node_types", "head_node_type", "upscaling_speed", "idle_timeout_minutes"):
        cfg.pop(key_name, None)  # the local provider generates its one node type itself
    cfg["worker_start_ray_commands"] = []
    # The local provider does not pass a node type's resources to `ray start`: give the head's CPUs.
    cfg["head_start_ray_commands"] = [
        c + f" --num-cpus={num_cpus}" if "ray start --head" in c else c for c in cfg["head_start_ray_commands"]
    ]
    return cfg


class LocalLauncher:
    """The namespaces, sshd, the head's HOME and Python; `run` executes a command inside."""

    def __init__(self, num_cpus: int = 4, keep: Optional[List[str]] = None) -> None:
        self.keep = paths_to_keep() if keep is None else keep  # bound back in over the private /tmp
        self.base = tempfile.mkdtemp(prefix=MARKER, dir="/var/tmp")  # not under /tmp: that is replaced inside
        self.home = os.path.join(self.base, "home")
        self.venv = os.path.join(self.base, "venv")
        self.wheelhouse = os.path.join(self.base, "wheelhouse")
        self.config_path = os.path.join(self.base, "cluster.yaml")
        self.num_cpus = num_cpus
        self.holder: Optional[subprocess.Popen] = None
        self.ns_pid: Optional[int] = None
        self.log: List[str] = []

    # ------------------------------------------------------------------ set-up (outside the namespaces)
    def prepare(self) -> None:
        self.prepare_namespace()
        self._venv()
        # The setup commands build this repository's wheel: pip's isolated build needs setuptools.
        self._check(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", self.wheelhouse, "setuptools>=68"],
            timeout=300,
        )
        with open(os.path.join(REPO, "cluster.yaml")) as fh:
            base = yaml.safe_load(fh)
        key = os.path.join(self.base, "ssh", "id_ed25519")
        with open(self.config_path, "w") as fh:
            yaml.safe_dump(derived_config(base, key=key, num_cpus=self.num_cpus), fh, sort_keys=False)

    def prepare_namespace(self) -> None:
        """What `start` needs: the private /tmp, the SSH keys and sshd's config, the private passwd."""
        for sub in ("home/.ssh", "tmp", "wheelhouse", "ssh"):
            os.makedirs(os.path.join(self.base, sub), mode=0o700, exist_ok=True)
        os.chmod(os.path.join(self.base, "tmp"), 0o1777)
        self._keys()
        self._passwd()
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory

    def _keys(self) -> None:
        ssh = os.path.join(self.base, "ssh")
        for name in ("id_ed25519", "host_ed25519"):
            self._check(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", MARKER, "-f", os.path.join(ssh, name)])
        shutil.copy(os.path.join(ssh, "id_ed25519.pub"), os.path.join(self.home, ".ssh", "authorized_keys"))
        os.chmod(os.path.join(self.home, ".ssh", "authorized_keys"), 0o600)
        with open(os.path.join(ssh, "sshd_config"), "w") as fh:
            fh.write(
                textwrap.dedent(f"""\
                Port {SSH_PORT}
                ListenAddress 127.0.0.1
                HostKey {ssh}/host_ed25519
                PidFile {ssh}/sshd.pid
                PermitRootLogin prohibit-password
                PubkeyAuthentication yes
                AuthorizedKeysFile .ssh/authorized_keys
                PasswordAuthentication no
                KbdInteractiveAuthentication no
                UsePAM no
                X11Forwarding no
                AllowTcpForwarding yes
                PrintMotd no
                Subsystem sftp internal-sftp
                """)
            )

    def _check(self, cmd: List[str], timeout: float = 60) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )

    def _passwd(self) -> None:
        """A copy of /etc/passwd whose root home is the temporary one (bind-mounted inside only)."""
        with open("/etc/passwd") as fh:
            lines = fh.read().splitlines()
        out = []
        for line in lines:
            fields = line.split(":")
            if fields[0] == "root":
                fields[5] = self.home
            out.append(":".join(fields))
        with open(os.path.join(self.base, "passwd"), "w") as fh:
            fh.write("\n".join(out) + "\n")
        os.chmod(os.path.join(self.base, "passwd"), 0o644)

    def _venv(self) -> None:
        """The head's Python: a venv that sees this interpreter's packages, with its own `ray` command."""
        import site
        import sysconfig

        self._check([sys.executable, "-m", "venv", "--without-pip", self.venv], timeout=120)
        purelib = subprocess.run(
            [
                os.path.join(self.venv, "bin", "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        parents = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
        with open(os.path.join(purelib, "_rte_parent_env.pth"), "w") as fh:  # after the venv's own packages
            fh.write("".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(parents)))
        python = os.path.join(self.venv, "bin", "python")
        scripts = {  # Ray starts its workers with the Python that runs `ray start`: the venv's
            "ray": "from ray.scripts.scripts import main\nsys.exit(main())\n",
            "pip": "import runpy\nrunpy.run_module('pip', run_name='__main__')\n",
        }
        for name, body in scripts.items():
            path = os.path.join(self.venv, "bin", name)
            with open(path, "w") as fh:
                fh.write(f"#!{python}\nimport sys\nsys.argv[0] = {name!r}\n{body}")
            os.chmod(path, 0o755)
        with open(os.path.join(self.home, ".bashrc"), "w") as fh:  # what the launcher's remote shells source
            fh.write(self._env_lines())

    def _env_lines(self) -> str:
        return textwrap.dedent(f"""\
            export PATH={self.venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
            export VIRTUAL_ENV={self.venv}
            export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 PYTHONUNBUFFERED=1
            # Ray Train's controller polls every 2 s by default and a report within one poll of the last waits
            # for the next (tests/conftest.py sets the same for the session's Ray): here every epoch's report.
            export RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.25
            export PIP_NO_INDEX=1 PIP_FIND_LINKS={self.wheelhouse} PIP_DISABLE_PIP_VERSION_CHECK=1
            unset PYTHONPATH RAY_ADDRESS
            """)

    def env(self) -> Dict[str, str]:
        """The client side's environment (the same HOME and Python as the head: one machine)."""
        env = {"HOME": self.home, "USER": "root", "LANG": "C.UTF-8", "TERM": "dumb"}
        for line in self._env_lines().splitlines():
            if line.startswith("export "):
                for item in line[len("export ") :].split():
                    k, _, v = item.partition("=")
                    env[k] = v
        return env

    # -------------------------------------------------------------------------- the namespaces
    def start(self) -> None:
        holder = os.path.join(self.base, "holder.py")
        with open(holder, "w") as fh:
            fh.write(HOLDER.format(base=self.base, sshd=_which("sshd"), keep=self.keep))
        self.holder = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
                sys.executable,
                holder,
            ],
            stdout=open(os.path.join(self.base, "holder.log"), "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(self.base, "ready")):
            if self.holder.poll() is not None or time.time() > deadline:
                raise RuntimeError("the namespace did not come up:\n" + self._read("holder.log"))
            time.sleep(0.2)
        with open(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children") as fh:
            self.ns_pid = int(fh.read().split()[0])  # the namespace's PID 1, as this namespace sees it

    def run(self, command: str, *, timeout: float = 600, cwd: str = REPO) -> subprocess.CompletedProcess:
        """``command`` (bash) inside the namespaces, as the cluster's client; output is kept in `log`."""
        started = time.time()
        proc = subprocess.run(
            # Entering a mount namespace moves the cwd to its root: change to ``cwd`` inside.
            [
                "nsenter",
                "-t",
                str(self.ns_pid),
                "--net",
                "--mount",
                "--pid",
                "--",
                "/bin/bash",
                "-c",
                f"cd {shlex.quote(cwd)} && {command}",
            ],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        self.log.append(
            f"$ {command}  # rc={proc.returncode}, {time.time() - started:.1f}s\n{proc.stdout}{proc.stderr}"
        )
        return proc

    def processes(self) -> List[str]:
        """``pid cmdline`` of every process in the PID namespace but its first (the holder) and sshd."""
        out = self.run(
            "for p in /proc/[0-9]*; do [ $(basename $p) = 1 ] || [ $(basename $p) = $$ ] && continue; "
            "s=$(cut -d' ' -f3 $p/stat 2>/dev/null); [ \"$s\" = Z ] && continue; "
            "c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); [ -n \"$c\" ] && echo \"$(basename $p) $c\"; done",
            timeout=60,
        ).stdout
        return [line for line in out.splitlines() if line and "sshd" not in line and "/proc/[0-9]" not in line]

    def _read(self, name: str) -> str:
        try:
            with open(os.path.join(self.base, name)) as fh:
                return fh.read()[-5000:]
        except OSError:
            return ""

    # ------------------------------------------------------------------------------- clean-up
    def close(self) -> List[int]:
        """Kill the namespace (the kernel ends every process in it), remove the files; returns leftovers."""
        if self.holder is not None:
            if self.ns_pid is not None:
                try:
                    os.kill(self.ns_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait(timeout=10)
        leftovers = _processes_naming(self.base)
        shutil.rmtree(self.base, ignore_errors=True)
        return leftovers


def _processes_naming(text: str) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


# The namespace's first process: loopback up, private /tmp (with the paths in `keep` bound back in at
# their own places: bound onto the private /tmp's subdirectories first, then the whole tree, those
# binds included, goes over /tmp with --rbind) and /etc/passwd, sshd, then reap orphans. The binds
# are made in this mount namespace only (private propagation): the machine's /tmp is not touched.
HOLDER = """\
import os, subprocess, time
base = {base!r}
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
for path in {keep!r}:
    inside = base + "/tmp/" + os.path.relpath(path, "/tmp")
    os.makedirs(inside, exist_ok=True)
    subprocess.run(["mount", "--bind", path, inside], check=True)
subprocess.run(["mount", "--rbind", base + "/tmp", "/tmp"], check=True)
subprocess.run(["mount", "--bind", base + "/passwd", "/etc/passwd"], check=True)
subprocess.run([{sshd!r}, "-f", base + "/ssh/sshd_config", "-E", base + "/ssh/sshd.log"], check=True)
open(base + "/ready", "w").close()
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        time.sleep(0.5)
"""
