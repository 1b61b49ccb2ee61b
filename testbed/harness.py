"""harness.py - the local process harness: start, watch and stop the central services and the
sites as processes on this machine, for demo.py, the tests and bench/.

Runs on: any machine with the checkout (imported; not started on its own). Processes and
services need the standard library only; the corpus, the initial model and the held-out
score import tokenize_corpus, torch and models inside the functions that use them.

    with harness.Launcher() as L:                              # every process stops at the end
        svc = harness.start_services(L, out_dir, manifest, init, block_size=16)
        site = harness.launch_site(L, "alpha", svc, manifest, log_dir=..., runs_dir=...)
        harness.wait_for(lambda: not site.alive(), 600)         # -> the value, or None at the deadline
        harness.expect(cond, "a round merged", needs=[site])    # tests: AssertionError with the logs

Processes. Every child starts in its own session, so Ctrl-C in the terminal reaches only
the parent, which then stops them in order; its stdout and stderr go to a log file. A
torchrun job is a tree, not one process group: torchrun starts each rank in a session of
its own (torch's elastic subprocess handler, start_new_session=True), so a signal to
torchrun's group misses the ranks, which then train on as orphans. Signals therefore go
to every process group of the tree, read from /proc (Linux) before the first signal.

Servers bind 127.0.0.1; a server's URL is the one it prints ("... listening on URL"),
read from its log (start_server) or, for a server a test starts with subprocess.Popen
itself, from its stdout pipe (listening_url).
Children get child_env(): no variable of an enclosing Slurm job or torchrun (a child would
take itself for one of its ranks), no PWW_* setting of the user's shell.
"""
import dataclasses
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import httpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout: testbed/ is one level down
DEFAULT_PORTS = {"darl": 29510, "fedmom": 29511, "blob": 29512}
SCRIPTS = {"darl": "darl_server.py", "fedmom": "fedmom_server.py", "blob": "blobstore.py"}
LISTENING = re.compile(r"listening on (https?://\S+)\s*$")
INHERITED_NOT = ("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "PWW_")


def child_env(**extra):
    """The environment of a child: this one's without INHERITED_NOT, one OpenMP thread per
    process (4 ranks on 2 cores oversubscribe anyway; more threads only add contention),
    unbuffered output, this checkout first on PYTHONPATH (a script under tests/ imports
    the top-level modules)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_NOT)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.update({k: str(v) for k, v in extra.items()})
    return env


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------

def ppids():
    """{pid: parent pid} of every live process (Linux /proc), zombies excluded."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(entry)] = int(fields[1])
    return out


def process_tree(pid):
    """pid and all its live descendants."""
    parents = ppids()
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in parents and p not in tree:
            tree.add(p)
            todo += [c for c, pp in parents.items() if pp == p]
    return tree


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Proc:
    """One started command (a server, or a torchrun job and its ranks) in a session of its
    own, run from the checkout; output appended to `log_path`."""

    def __init__(self, name, cmd, log_path, env=None):
        self.name, self.cmd, self.log_path = name, [str(c) for c in cmd], log_path
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        self.log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        with open(log_path, "ab") as out:
            self.popen = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=ROOT,
                                          env=env if env is not None else child_env(),
                                          start_new_session=True)
        self.pid = self.popen.pid
        self.family = {self.pid}       # every pid of the tree seen so far

    def poll(self):
        return self.popen.poll()

    @property
    def returncode(self):
        return self.popen.poll()

    def alive(self):
        return self.popen.poll() is None

    def wait(self, timeout=None):
        """The leader's exit code; subprocess.TimeoutExpired after `timeout` s."""
        return self.popen.wait(timeout=timeout)

    def signal_tree(self, sig):
        """`sig` to every process group of the tree (the leader's and each rank's)."""
        if self.popen.poll() is None:
            self.family |= process_tree(self.pid)
        groups, singles = set(), set()
        for pid in self.family:
            try:
                pg = os.getpgid(pid)
            except ProcessLookupError:
                continue
            (groups.add(pg) if pg in self.family else singles.add(pid))
        # one signal per process: a server whose SIGTERM handler is flushing its state
        # must not be hit twice
        for kill, targets in ((os.killpg, groups), (os.kill, singles)):
            for target in sorted(targets):
                try:
                    kill(target, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def gone(self):
        """True once no process of the tree is left (the leader reaped, no rank orphaned)."""
        self.popen.poll()
        return not any(_alive(p) for p in self.family)

    def stop(self, grace_s=20.0):
        """SIGTERM the tree, SIGKILL what is left after grace_s; returns the leader's exit code."""
        if not self.gone():
            self.signal_tree(signal.SIGTERM)
            if not wait_for(self.gone, grace_s, 0.1):
                self.signal_tree(signal.SIGKILL)
                wait_for(self.gone, 30.0, 0.1)
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        """SIGKILL the whole tree at once (a node lost); returns the leader's exit code."""
        self.signal_tree(signal.SIGKILL)
        wait_for(self.gone, 60.0, 0.05)
        return self.popen.wait(timeout=60)

    def tail(self, n=15):
        """The last n lines of the log (of its last 16 KiB)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 16384))
                return f.read().decode(errors="replace").splitlines()[-n:]
        except OSError:
            return []

    def output(self):
        """Everything this process wrote so far (the log from where it started)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class Launcher:
    """Starts processes and guarantees they all stop: `with Launcher() as L: ...`. Stopped
    newest first, so sites stop before the services (a site's last calls need them)."""

    def __init__(self):
        self.procs = []

    def start(self, name, cmd, log_path, env=None):
        p = Proc(name, cmd, log_path, env)
        self.procs.append(p)
        return p

    def stop_all(self, grace_s=20.0):
        for p in reversed(self.procs):
            p.stop(grace_s)

    def kill_all(self):
        for p in reversed(self.procs):
            p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()
        return False


def wait_for(cond, timeout_s, interval_s=0.2):
    """Poll cond() until truthy (returns its value) or timeout_s passes (returns None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


def expect(cond, what, needs=(), timeout_s=240.0, interval_s=0.2):
    """wait_for for tests: cond()'s value, or AssertionError naming `what` with the logs'
    tails: at the deadline (which only bounds a hang), or at once when a process of
    `needs` (Procs cond depends on) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        for p in needs:
            if not p.alive():
                raise AssertionError(f"waiting for {what}: {p.name} exited with {p.poll()}:\n"
                                     + "\n".join(p.tail(40)))
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s:.0f} s; logs: "
                                 + "; ".join(f"{p.name}:\n" + "\n".join(p.tail(15)) for p in needs))
        time.sleep(interval_s)


class Output:
    """Every line a subprocess (started with stdout=PIPE, text=True) writes, read by a daemon
    thread so the pipe never fills: for tests that start a server with subprocess.Popen
    themselves and read its output."""

    def __init__(self, proc):
        self.proc, self.lines, self.cond = proc, [], threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, name=f"stdout-{proc.pid}", daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        self.proc.stdout.close()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def text(self):
        with self.cond:
            return "".join(self.lines)

    def wait_for(self, pattern, timeout):
        """The first match of `pattern` in a line; AssertionError with the output if the
        process closes its output, or `timeout` seconds pass, first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    m = re.search(pattern, line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    why = f"exited with {self.proc.poll()}" if self.closed else f"not within {timeout:.0f} s"
                    raise AssertionError(f"no line matching {pattern!r} ({why}); output:\n"
                                         + "".join(self.lines[-40:]))
                self.cond.wait(min(left, 1.0))


def listening_url(proc, timeout=60.0):
    """(url, Output) of a server started with stdout=PIPE, text=True: the URL of its
    "... listening on URL" line, or AssertionError with its output when it exits or says
    nothing within `timeout` (a hang bound, not a wait)."""
    out = Output(proc)
    return out.wait_for(LISTENING, timeout).group(1), out


def free_port():
    """A port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# ---------------------------------------------------------------------------
# Central services
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Services:
    darl: str
    fedmom: str
    blob: str
    state_dir: str
    token_file: str
    procs: dict

    @property
    def token(self):
        return httpc.load_token(self.token_file)


def make_token(path):
    """A fresh random bearer token in `path` (mode 600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def wait_listening(proc, timeout_s=60.0):
    """The URL a server printed ("... listening on URL") once it is serving; RuntimeError
    with its output if it exits or says nothing within timeout_s."""
    def url():
        for line in proc.output().splitlines():
            m = LISTENING.search(line)
            if m:
                return m.group(1)
        return None
    found = wait_for(lambda: url() or (proc.poll() is not None and "exited"), timeout_s, 0.05)
    if found in (None, "exited"):
        raise RuntimeError(f"{proc.name} did not start (exit {proc.poll()}); see {proc.log_path}:\n  "
                           + "\n  ".join(proc.tail()))
    return found


def start_server(launcher, kind, args, log_path, port=None, ca_file=None, env=None):
    """One central server (kind darl | fedmom | blob) on 127.0.0.1 -> (Proc, url). port None:
    the kind's default port when free, else one the kernel picks; 0: the kernel's pick;
    N: exactly N (a restart on the same URL). ca_file: the CA of a server given --tls-cert
    (its URL is https://). env: the child's environment (default child_env())."""
    if port is None:
        ports = ([DEFAULT_PORTS[kind]] if port_is_free(DEFAULT_PORTS[kind]) else []) + [0]
    else:
        ports = [port]
    for i, p in enumerate(ports):
        proc = launcher.start(kind, [sys.executable, SCRIPTS[kind], *args, "--port", p], log_path, env)
        try:
            url = wait_listening(proc)
            httpc.wait_healthy(url, 30, ca_file)
            return proc, url
        except (RuntimeError, TimeoutError):
            proc.stop(5)
            if i == len(ports) - 1:
                raise                # (a default port taken in between: the next try takes any)
    raise AssertionError("unreachable")


def start_services(launcher, out_dir, manifest, init, *, block_size, seed=0, darl_args=(), fedmom_args=(),
                   default_ports=True):
    """DARL, the blob store and FedMom (in that order: FedMom is given the other two's URLs),
    with state under out_dir/central/, logs under out_dir/logs/, a new token in out_dir/token."""
    state, logs = os.path.join(out_dir, "central"), os.path.join(out_dir, "logs")
    os.makedirs(state, exist_ok=True)
    token = make_token(os.path.join(out_dir, "token"))
    agg_token = make_token(os.path.join(out_dir, "aggregator.token"))   # DARL's custody endpoints: FedMom alone
    common = ["--token-file", token]
    port = None if default_ports else 0
    procs = {}
    procs["darl"], darl = start_server(launcher, "darl", ["--manifest", manifest, "--block-size", block_size,
                                                          "--seed", seed, "--state-dir", state, *common,
                                                          "--aggregator-token-file", agg_token, *darl_args],
                                       os.path.join(logs, "darl.log"), port)
    procs["blob"], blob = start_server(launcher, "blob", ["--root", os.path.join(state, "blobs"), *common],
                                       os.path.join(logs, "blob.log"), port)
    procs["fedmom"], fedmom = start_server(launcher, "fedmom", ["--state-dir", os.path.join(state, "fedmom"),
                                                                "--init", init, "--darl", darl, "--blob-url", blob,
                                                                "--darl-token-file", agg_token, *common,
                                                                *fedmom_args],
                                           os.path.join(logs, "fedmom.log"), port)
    return Services(darl, fedmom, blob, state, token, procs)


def get_json(url, path, token, timeout=10.0):
    """GET url+path -> dict, or None when the server does not answer."""
    try:
        return httpc.call(url, "GET", path, token=token, timeout=timeout)
    except (OSError, httpc.CallError, ValueError):
        return None
    except Exception:            # http.client.HTTPException and friends: treat as "no answer"
        return None


def fetch_page(url, path, token=None):
    """Save the status page's keepsake copy (GET /?saved=1: stamped, no auto-refresh) to `path`."""
    req = urllib.request.Request(url.rstrip("/") + "/?saved=1", headers=httpc.auth_headers(token))
    with urllib.request.urlopen(req, timeout=30) as r, open(path, "wb") as f:
        f.write(r.read())
    return path


# ---------------------------------------------------------------------------
# Sites
# ---------------------------------------------------------------------------

def torchrun(nproc, *args):
    """A torchrun command line of nproc ranks on this machine (torch.distributed.run of this
    Python: no PATH lookup)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *map(str, args)]


def site_command(name, services, manifest, *, nproc, parallel, runs_dir, train_args=(), resume=False,
                 throttle_ms=0, transport="auto", replica=None):
    """The torchrun command line of one federated site (a pure function: tested)."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node", nproc,
           "train.py", "--device", "cpu", "--data", manifest, "--parallel", parallel,
           "--federation", services.fedmom, "--darl-url", services.darl, "--blob-url", services.blob,
           "--token-file", services.token_file, "--site", name, "--transport", transport,
           "--runs-dir", runs_dir, "--run-name", name if replica is None else f"{name}-{replica}",
           *train_args]
    if replica is not None:
        cmd += ["--replica", replica]
    if throttle_ms:
        cmd += ["--throttle-ms", throttle_ms]
    if resume:
        cmd += ["--resume", "auto"]
    return [str(c) for c in cmd]


def launch_site(launcher, name, services, manifest, *, log_dir, nproc=2, parallel="fsdp", runs_dir,
                train_args=(), resume=False, throttle_ms=0, transport="auto", replica=None, log_name=None, env=None):
    cmd = site_command(name, services, manifest, nproc=nproc, parallel=parallel, runs_dir=runs_dir,
                       train_args=train_args, resume=resume, throttle_ms=throttle_ms, transport=transport,
                       replica=replica)
    return launcher.start(name, cmd, os.path.join(log_dir, f"{log_name or name}.log"), env)


# ---------------------------------------------------------------------------
# Corpus, initial model, held-out loss
# ---------------------------------------------------------------------------

def tokenize(out_dir, corpus_bytes, seq_len, heldout_windows):
    """The stdlib corpus, capped at corpus_bytes, as windows of seq_len+1 bytes -> manifest dict."""
    import tokenize_corpus
    cfg = tokenize_corpus.TokenizeConfig(inputs=[], out=out_dir, seq_len=seq_len,
                                         heldout_windows=heldout_windows, max_bytes=int(corpus_bytes),
                                         progress=False)
    m = tokenize_corpus.tokenize(cfg)
    m["path"] = os.path.join(out_dir, "manifest.json")
    return m


def export_init(launcher, path, manifest, model, seed, log_path):
    """`train.py --export-init`: the initial global model (fp32 tensor file) FedMom starts from."""
    p = launcher.start("export-init", [sys.executable, "train.py", "--export-init", path, "--model", model,
                                       "--data", manifest, "--seed", seed], log_path)     # always on the CPU
    rc = p.wait()
    if rc != 0 or not os.path.exists(path):
        raise RuntimeError(f"train.py --export-init failed (exit {rc}); see {log_path}:\n  "
                           + "\n  ".join(p.tail()))
    return path


def load_weights(path):
    """{name: fp32 torch tensor} from a tensorio file (FedMom's theta, --export-init) or a
    consolidated train.py checkpoint (.pt: its "model" entry; under DiLoCo that is theta)."""
    import torch
    import tensorio
    if path.endswith(".pt"):
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return {k.removeprefix("module."): v.float() for k, v in blob["model"].items()}
    return {k: v.float() for k, v in tensorio.load_torch(path).items()}


def heldout_loss(weights_path, manifest, model="qwen3-tiny", windows=None, batch=16):
    """Mean next-token loss (nats) of a model file's weights on the held-out windows.

    Built unsharded on the CPU; parameters are matched by name (the names of
    named_parameters(), which list a tied weight once, as --export-init and FedMom do).
    The same function scores the demo and every arm of bench/convergence.py.
    """
    import torch
    import torch.nn.functional as F
    import data
    import models
    w = data.TokenWindows(manifest)
    net = models.materialize(models.build_model(model, w.vocab_size, w.seq_len), torch.device("cpu"))
    weights = load_weights(weights_path)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name not in weights:
                raise KeyError(f"{weights_path} has no tensor {name!r}: not a {model} model file")
            p.copy_(weights[name].view(p.shape))
    net.eval()
    idx = list(w.heldout_indices(windows))
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(idx), batch):
            t = torch.from_numpy(w.batch(idx[i:i + batch]))
            logits = net(t[:, :-1])
            total += F.cross_entropy(logits.flatten(0, 1).float(), t[:, 1:].flatten(), reduction="sum").item()
            count += t[:, 1:].numel()
    return total / count
