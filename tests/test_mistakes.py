"""The ordinary mistakes a new user makes: each ends in ONE line on stderr that names what
is wrong and the fix, with a non-zero exit, and no traceback. Real processes, real files,
a real DARL and aggregator on 127.0.0.1."""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

import block_space
import darl_server
import fedmom_server
import fedmom_state
import httpd
import tensorio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, env=None, timeout=300):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


class OneLine(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="mistake-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def one_line(self, args, *words, env=None):
        """Run; assert a non-zero exit and one stderr line holding every word (regexes). The line."""
        p = run(args, env)
        err = p.stderr.strip()
        self.assertNotEqual(p.returncode, 0, f"{args}: exit 0\n{p.stdout}{p.stderr}")
        self.assertNotIn("Traceback", p.stderr, args)
        self.assertEqual(len(err.splitlines()), 1, f"{args}: not one line:\n{p.stderr}")
        for w in words:
            self.assertRegex(err, w, args)
        return err

    def path(self, *parts):
        return os.path.join(self.dir, *parts)


# train.py's mistakes run in ONE process (importing torch costs ~10 s a process on a loaded
# machine): the same main() as `python train.py ARGS`, stderr captured per call. The
# shipped-config case also runs as a real `python train.py`, for the exit status.
DRIVER = """
import contextlib, io, json, sys, traceback
import train
out = []
for argv in json.loads(sys.argv[1]):
    if argv[0] == "--without":              # this case and the ones after it: that module absent
        sys.modules[argv[1]] = None
        argv = argv[2:]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc(file=err)
            code = "exception"
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


class TrainTest(OneLine):
    """train.py: each of these used to end in a traceback."""

    @classmethod
    def setUpClass(cls):
        import json
        cls.tmp = tempfile.mkdtemp(prefix="mistake-train-")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)
        p = lambda *parts: os.path.join(cls.tmp, *parts)
        cls.missing = p("corpus", "manifest.json")
        src, cls.tok = p("src"), p("tok")
        os.makedirs(src)
        with open(os.path.join(src, "a.txt"), "w") as f:
            f.write("hello world, " * 2000)
        r = run([sys.executable, "tokenize_corpus.py", src, "--out", cls.tok, "--seq-len", "16",
                 "--heldout-windows", "4", "--no-progress"])
        assert r.returncode == 0, r.stderr
        shutil.copytree(cls.tok, p("tok-ok"))
        cls.shard = next(f for f in os.listdir(cls.tok) if f != "manifest.json")
        os.unlink(os.path.join(cls.tok, cls.shard))
        cls.yaml1, cls.yaml2 = p("bad1.yaml"), p("bad2.yaml")
        with open(cls.yaml1, "w") as f:
            f.write("model: qwen3-tiny\nlr: 3e-3\nsteps 200\nbatch_size: 8\n")
        with open(cls.yaml2, "w") as f:
            f.write("model: qwen3-tiny\nlr: [3e-3\n")
        import torch
        if not torch.cuda.is_available():
            cls.device = "cuda"                  # the mistake: a GPU flag where there is none
        else:                                    # a GPU machine: the other vendor's flag is the mistake
            cls.device = "cuda" if torch.version.hip else "rocm"
        cls.cases = {
            "missing": ["--config", "configs/qwen3_tiny.yaml", "--device", "cpu", "--data", cls.missing],
            "export": ["--export-init", p("init.safetensors"), "--model", "qwen3-tiny", "--data", cls.missing],
            "shards": ["--model", "qwen3-tiny", "--device", "cpu", "--data", os.path.join(cls.tok, "manifest.json")],
            "yaml1": ["--config", cls.yaml1], "yaml2": ["--config", cls.yaml2],
            "noconfig": ["--config", p("none.yaml")],
            "device": ["--device", cls.device, "--model", "qwen3-tiny", "--data", "x.json"],
            "unread": ["--model", "qwen3-tiny", "--device", "cpu", "--data", "x/manifest.json", "--federation",
                       "http://127.0.0.1:9", "--darl-url", "http://127.0.0.1:9", "--ckpt-every", "5"],
            "tensorboard": ["--without", "torch.utils.tensorboard", "--model", "qwen3-tiny", "--device", "cpu",
                            "--data", p("tok-ok", "manifest.json"), "--eval-windows", "4", "--runs-dir", p("runs"), "--steps", "1",
                            "--tensorboard", p("tb")]}    # last: the module stays absent
        r = run([sys.executable, "-c", DRIVER, json.dumps(list(cls.cases.values()))])
        assert r.returncode == 0, r.stderr
        cls.results = dict(zip(cls.cases, json.loads(r.stdout.strip().splitlines()[-1])))

    def check(self, case, *words):
        code, err = self.results[case]
        self.assertNotIn(code, (0, "exception"), f"{self.cases[case]}: exit {code}\n{err}")
        self.assertEqual(len(err.strip().splitlines()), 1, f"{self.cases[case]}: not one line:\n{err}")
        for w in words:
            self.assertRegex(err, w, self.cases[case])

    def test_a_corpus_manifest_that_does_not_exist_names_the_command_that_makes_it(self):
        self.check("missing", re.escape(f"--data {self.missing}: no such corpus manifest"),
                   re.escape(f"python tokenize_corpus.py --out {os.path.dirname(self.missing)}"))
        self.check("export", "no such corpus manifest", "tokenize_corpus.py --out")
        self.assertFalse(os.path.exists(self.cases["export"][1]))

    def test_the_shipped_tiny_config_without_its_corpus(self):
        with open(os.path.join(ROOT, "configs", "qwen3_tiny.yaml")) as f:
            data = re.search(r"^data: (\S+)", f.read(), re.M).group(1)
        if os.path.exists(os.path.join(ROOT, data)):      # made by hand here: use a copy of the config without it
            cfg = self.path("tiny.yaml")
            with open(os.path.join(ROOT, "configs", "qwen3_tiny.yaml")) as f, open(cfg, "w") as g:
                g.write(f.read().replace(data, self.path(data)))
            data = self.path(data)
        else:
            cfg = "configs/qwen3_tiny.yaml"
        err = self.one_line([sys.executable, "train.py", "--config", cfg, "--device", "cpu"], re.escape(data),
                            re.escape(f"tokenize_corpus.py --out {os.path.dirname(data)}"))
        self.assertTrue(err.startswith("train.py: error: "), err)

    def test_a_manifest_whose_shards_are_missing(self):
        self.check("shards", "1 of 1 shard files are missing", re.escape(self.shard), "copy the whole corpus directory")

    def test_a_yaml_syntax_error_names_the_line(self):
        self.check("yaml1", re.escape(f"--config {self.yaml1}: not valid YAML at line 3 "), "fix that line")
        self.check("yaml2", re.escape(f"--config {self.yaml2}: not valid YAML at line 2 "))
        self.check("noconfig", "--config .*none.yaml: no such file")

    def test_tensorboard_without_its_package_names_the_package(self):
        self.check("tensorboard", re.escape(f"--tensorboard {self.cases['tensorboard'][-1]}"),
                   "needs the tensorboard package", "pip install tensorboard")

    def test_a_flag_the_run_would_not_read_names_it_and_the_fix(self):
        self.check("unread", re.escape("train.py: error: --ckpt-every 5 with --federation: a site checkpoints "
                                       "at the end of every phase"), "drop it")

    def test_a_gpu_device_this_process_cannot_use(self):
        if self.device == "cuda":
            self.check("device", "--device cuda: no GPU is visible", "use --device cpu")
        else:
            self.check("device", f"--device {self.device}: this torch is a")


class CentralTest(OneLine):
    """The central services and tokenize_corpus.py (no torch)."""

    def init_file(self):
        path = self.path("init.safetensors")
        with tensorio.TensorWriter(path, [("w", "F32", (4, 4))], fsync=False) as w:
            w.write("w", np.ones((4, 4), np.float32))
        return path

    def servers(self):
        init = self.init_file()
        return {"darl_server.py": (["--num-samples", "10", "--state-dir"], "--state-dir"),
                "fedmom_server.py": (["--init", init, "--state-dir"], "--state-dir"),
                "blobstore.py": (["--root"], "--root")}

    def test_a_port_in_use_names_the_port_and_the_flag(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            for script, (args, _) in self.servers().items():
                with self.subTest(script):
                    self.one_line([sys.executable, script, *args, self.path(script + ".d"), "--port", str(port)],
                                  re.escape(f"127.0.0.1:{port}: the address is in use"), "--port")

    def test_a_state_dir_that_is_a_file_or_cannot_be_written(self):
        afile = self.path("afile")
        open(afile, "w").close()
        if os.geteuid() == 0:                   # root writes through any mode bits: a read-only file system
            ro = "/sys/pww-state"
        else:
            ro = self.path("ro")
            os.makedirs(ro, mode=0o555)
            ro = os.path.join(ro, "state")
        for script, (args, flag) in self.servers().items():
            with self.subTest(script):
                self.one_line([sys.executable, script, *args, afile, "--port", "0"],
                              re.escape(f"{flag} {afile} is a file, not a directory"))
                self.one_line([sys.executable, script, *args, os.path.join(afile, "x"), "--port", "0"],
                              re.escape(f"{flag} {afile}/x: cannot write there"))
                self.one_line([sys.executable, script, *args, ro, "--port", "0"],
                              re.escape(f"{flag} {ro}: cannot write there"), "a directory this user can write")

    def test_fedmom_init_of_a_garbage_file_leaves_no_state_dir(self):
        junk = self.path("junk.safetensors")
        with open(junk, "w") as f:
            f.write("this is not a tensor file at all\n")
        sd = self.path("state")
        self.one_line([sys.executable, "fedmom_server.py", "--state-dir", sd, "--init", junk, "--port", "0"],
                      re.escape(f"--init {junk}"), "not a tensor file", "train.py --export-init")
        self.assertFalse(os.path.exists(sd))

    def test_tokenize_an_empty_directory_or_a_missing_path(self):
        empty = self.path("empty")
        os.makedirs(empty)
        out = self.path("out")
        self.one_line([sys.executable, "tokenize_corpus.py", empty, "--out", out],
                      re.escape(f"no input files in {empty}"), r"\.txt", r"\.jsonl")
        self.one_line([sys.executable, "tokenize_corpus.py", self.path("nowhere"), "--out", out],
                      re.escape(f"input {self.path('nowhere')} does not exist"))
        self.assertFalse(os.path.exists(out))

    def serve(self, routes):
        server = httpd.make_server(routes)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return server.url

    def test_each_status_command_pointed_at_the_other_server(self):
        darl = self.serve(darl_server.make_routes(darl_server.Coordinator(block_space.BlockSpace(10, 1, 0))))
        cfg = fedmom_state.ServerConfig(self.path("fm"), self.init_file()).validate()
        fedmom = self.serve(fedmom_server.make_routes(fedmom_state.FedMomState(cfg)))
        self.one_line([sys.executable, "fedmom_server.py", "status", "--url", darl],
                      re.escape(f"status: {darl} answers /status like DARL"), "point --url at the aggregator",
                      "29511")
        self.one_line([sys.executable, "darl_server.py", "status", "--url", fedmom],
                      re.escape(f"status: {fedmom} is not the DARL coordinator"), "29510")

    def test_darl_status_help_shows_its_default_url(self):
        p = run([sys.executable, "darl_server.py", "status", "--help"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("(default http://127.0.0.1:29510)", " ".join(p.stdout.split()))
        self.assertIn("usage: darl_server.py status", p.stdout)

    def test_central_sh_help_lists_every_variable_start_reads_and_creates_nothing(self):
        with open(os.path.join(ROOT, "central.sh")) as f:
            script = f.read()
        # the environment central.sh reads: ${VAR:-...} / ${VAR:+...} of a name the script never sets itself
        read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):[-+]", script))
        assigned = set(re.findall(r"^\s*(?:local\s+)?([A-Z][A-Z0-9_]*)=(?!\$\{\1:-)", script, re.M))
        wanted = read - assigned
        self.assertTrue({"MANIFEST", "INIT", "NUM_SAMPLES", "SEED", "PWW_START_TIMEOUT_S"} <= wanted, wanted)
        state = self.path("central")
        for arg in ("--help", "-h"):
            p = run(["./central.sh", arg], env={"PWW_CENTRAL_STATE": state})
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("./central.sh start", p.stdout)
            for var in sorted(wanted):
                self.assertIn(var, p.stdout, f"central.sh --help does not mention {var}")
        self.assertFalse(os.path.exists(state), "central.sh --help created the state dir")


if __name__ == "__main__":
    unittest.main()
