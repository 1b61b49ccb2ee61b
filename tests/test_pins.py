"""tests/test_pins.py - every torch / torchtitan / triton pin in the repository agrees.

Three places install the training stack: requirements.txt (CI, tests, the local demo),
jobs/snellius_setup_venv.sh (the Snellius venv) and containers/lumi-titan.def (the LUMI
image); RUNBOOK.md's "Site environments" table states what each site runs. This test reads
every pin in every text file of the repository (`name==version`, `torch >= X.Y` minimums,
the image's org.pww.* labels) and fails, naming the file, the line and the fix, when
  - a torch cannot import the pinned torchtitan (TORCHTITAN_TORCH_FLOOR),
  - a CUDA/CPU torch differs from requirements.txt's, the version CI tests,
  - a ROCm torch is not the newest torch whose ROCm build LUMI-G's driver runs
    (LUMI_MAX_ROCM, TORCH_OLDEST_ROCM), or two ROCm pins differ,
  - a triton / triton-rocm is not the Triton its torch requires (TORCH_TRITON),
  - a torchtitan differs from requirements.txt's, or a site lost its pin.
Then it checks that this interpreter runs exactly requirements.txt's versions and imports
torchtitan with them: CI's import is the Snellius venv's import.

The tables are facts about other projects' releases; each row says where it comes from.
A newer torch or torchtitan needs its row here first, and the failure says so.
Run: .venv/bin/python tests/run.py test_pins
"""
import dataclasses
import importlib.metadata
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENTS, SNELLIUS, LUMI, RUNBOOK = ("requirements.txt", "jobs/snellius_setup_venv.sh",
                                          "containers/lumi-titan.def", "RUNBOOK.md")

# The oldest torch each torchtitan release imports, and why (torchtitan's own sources).
TORCHTITAN_TORCH_FLOOR = {
    "0.2.2": ((2, 10), "torchtitan/models/attention.py imports torch.nn.attention.varlen, "
                       "first shipped in torch 2.10 (torchtitan issue #2108)"),
}
# The Triton each torch release requires (its .ci/docker/triton_version.txt; the ROCm
# wheels require triton-rocm / pytorch-triton-rocm of the same version).
TORCH_TRITON = {(2, 9): "3.5.1", (2, 10): "3.6.0", (2, 12): "3.7.0", (2, 13): "3.7.1"}
# The oldest ROCm each torch release is published for (PyTorch's release compatibility
# matrix and wheel index: 2.9 -> rocm6.3/6.4, 2.10 -> rocm7.0/7.1, 2.11-2.13 -> rocm7.2).
TORCH_OLDEST_ROCM = {(2, 9): (6, 3), (2, 10): (7, 0), (2, 11): (7, 2), (2, 12): (7, 2), (2, 13): (7, 2)}
# LUMI-G's GPU driver, amdgpu 6.3.60300 since the January 2026 system update, runs ROCm
# user space 6.1 to 7.0 (LUMI's update notes); 7.1 and newer do not run there.
LUMI_MAX_ROCM = (7, 0)
# The CUDA builds each torch release is published for (release compatibility matrix).
TORCH_CUDA_BUILDS = {(2, 13): ("cu126", "cu130", "cu132")}

SUFFIXES = (".txt", ".sh", ".def", ".md", ".py", ".yaml", ".yml", ".toml", ".cfg")
SKIP_DIRS = {".git", ".venv", "runs", "data", "logs", "__pycache__", "node_modules", "bench-out"}
SELF = "tests/test_pins.py"
PIN_RE = re.compile(r"(?<![\w.-])(torch|torchtitan|triton|triton-rocm|pytorch-triton-rocm)==([0-9][\w.+]*)")
FLOOR_RE = re.compile(r"(?<![\w.-])torch\s*>=\s*([0-9]+\.[0-9]+)")
LABEL_RE = re.compile(r"^\s*org\.pww\.(torch|torchtitan|triton-rocm)\s+(\S+)")


@dataclasses.dataclass
class Pin:
    file: str
    line: int
    name: str          # torch | torchtitan | triton | triton-rocm | pytorch-triton-rocm | torch>= | label:<name>
    version: str

    @property
    def where(self):
        return f"{self.file}:{self.line}"


def read_repo(root=ROOT):
    """{relative path: text} of every text file the scan reads."""
    files = {}
    for base, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for n in names:
            path = os.path.join(base, n)
            rel = os.path.relpath(path, root)
            if (n.endswith(SUFFIXES) or n == "Makefile") and rel != SELF and not os.path.islink(path):
                with open(path, errors="replace") as f:
                    files[rel] = f.read()
    return files


def scan(files):
    pins = []
    for rel, text in sorted(files.items()):
        for no, line in enumerate(text.splitlines(), 1):
            pins += [Pin(rel, no, m.group(1), m.group(2)) for m in PIN_RE.finditer(line)]
            pins += [Pin(rel, no, "torch>=", m.group(1)) for m in FLOOR_RE.finditer(line)]
            m = LABEL_RE.match(line) if rel.endswith(".def") else None
            if m:
                pins.append(Pin(rel, no, "label:" + m.group(1), m.group(2)))
    return pins


def minor(version):
    parts = re.match(r"(\d+)\.(\d+)", version)
    return (int(parts.group(1)), int(parts.group(2)))


def local_tag(version):
    return version.partition("+")[2]


def rocm_of(version):
    m = re.fullmatch(r"rocm(\d+)\.(\d+)(?:\.\d+)?", local_tag(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def fmt(v):
    return ".".join(map(str, v))


def lumi_torch(floor):
    """The torch minor LUMI should run: CI's rules first, then the newest release whose
    oldest ROCm build the driver runs."""
    usable = [v for v, r in TORCH_OLDEST_ROCM.items() if v >= floor and r <= LUMI_MAX_ROCM]
    return max(usable) if usable else None


def problems(files):
    """Every disagreement, as 'file:line: what; fix: how' (empty list: all pins agree)."""
    pins, out = scan(files), []
    req = {p.name: p for p in pins if p.file == REQUIREMENTS and "==" not in p.name and not p.name.startswith(("label", "torch>="))}
    for name in ("torch", "torchtitan", "triton"):
        if name not in req:
            out.append(f"{REQUIREMENTS}: no {name}== pin; fix: pin the version CI installs ({name}==X.Y.Z)")
    if out:
        return out
    tt, ci_torch = req["torchtitan"].version, req["torch"].version.partition("+")[0]
    if tt not in TORCHTITAN_TORCH_FLOOR:
        return [f"{req['torchtitan'].where}: torchtitan {tt} has no row in {SELF}'s TORCHTITAN_TORCH_FLOOR; "
                f"fix: add the oldest torch it imports (read its imports of torch.*)"]
    floor, why = TORCHTITAN_TORCH_FLOOR[tt]
    lumi = lumi_torch(floor)
    rocm_pins = [p for p in pins if p.name == "torch" and rocm_of(p.version)]
    for p in pins:
        if p.name == "torchtitan" and p.version != tt:
            out.append(f"{p.where}: torchtitan=={p.version} but CI tests {tt}; fix: torchtitan=={tt}")
        elif p.name == "torch>=" and minor(p.version) < floor:
            out.append(f"{p.where}: says torch >= {p.version}, but torchtitan {tt} needs torch >= {fmt(floor)} "
                       f"({why}); fix: torch >= {fmt(floor)}")
        elif p.name == "torch":
            out += torch_pin_problems(p, floor, why, tt, ci_torch, lumi)
        elif p.name in ("triton", "triton-rocm", "pytorch-triton-rocm"):
            out += triton_pin_problems(p, pins, ci_torch)
        elif p.name.startswith("label:"):
            out += label_problems(p, pins, tt)
    if len({p.version for p in rocm_pins}) > 1:
        out.append(f"ROCm torch pins differ: {', '.join(f'{p.where} {p.version}' for p in rocm_pins)}; "
                   f"fix: the same torch=={rocm_pins[0].version} everywhere ({LUMI} is the one installed)")
    out += missing_pins(pins)
    return out


def torch_pin_problems(p, floor, why, tt, ci_torch, lumi):
    v, rocm = p.version, rocm_of(p.version)
    lumi_pin = f"torch=={fmt(lumi)}.0+rocm{fmt(TORCH_OLDEST_ROCM[lumi])}" if lumi else "none exists"
    if minor(v) < floor:
        fix = lumi_pin if rocm else f"torch=={ci_torch} (requirements.txt)"
        return [f"{p.where}: torch=={v} cannot import torchtitan {tt} ({why}); fix: {fix}"]
    if rocm:
        if rocm > LUMI_MAX_ROCM:
            return [f"{p.where}: torch=={v} needs ROCm {fmt(rocm)} user space, and LUMI-G's driver "
                    f"(amdgpu 6.3.60300) runs ROCm up to {fmt(LUMI_MAX_ROCM)}; fix: {lumi_pin}"]
        oldest = TORCH_OLDEST_ROCM.get(minor(v))
        if oldest is None or rocm < oldest:
            return [f"{p.where}: torch=={v}: PyTorch publishes no such ROCm build; fix: {lumi_pin}"]
        if minor(v) != lumi:
            return [f"{p.where}: torch=={v} is not the newest torch LUMI-G runs; fix: {lumi_pin}"]
        return []
    if v.partition("+")[0] != ci_torch:
        return [f"{p.where}: torch=={v} but CI tests torch {ci_torch} (requirements.txt); "
                f"fix: torch=={ci_torch}{'+' + local_tag(v) if local_tag(v) else ''}"]
    tag, builds = local_tag(v), TORCH_CUDA_BUILDS.get(minor(v))
    if tag.startswith("cu") and builds is not None and tag not in builds:
        return [f"{p.where}: torch=={v}: PyTorch publishes {minor(v)} for {', '.join(builds)} only; "
                f"fix: one of those (cu126 runs on every driver from R525 on)"]
    return []


def triton_pin_problems(p, pins, ci_torch):
    same_file = [q for q in pins if q.file == p.file and q.name == "torch"]
    if p.name == "triton":
        torch_v = next((q.version for q in same_file if not rocm_of(q.version)), ci_torch)
    else:
        torch_v = next((q.version for q in same_file if rocm_of(q.version)), None)
        if torch_v is None:
            return [f"{p.where}: {p.name}=={p.version} without a ROCm torch beside it; fix: pin the "
                    f"ROCm torch it belongs to in the same file"]
    want = TORCH_TRITON.get(minor(torch_v))
    if want is None:
        return [f"{p.where}: no Triton known for torch {torch_v}; fix: add its version (torch's "
                f".ci/docker/triton_version.txt) to {SELF}'s TORCH_TRITON"]
    if p.name != "triton" and minor(torch_v) >= (2, 10) and p.name != "triton-rocm":
        return [f"{p.where}: torch {torch_v}'s ROCm wheels require triton-rocm, not {p.name}; "
                f"fix: triton-rocm=={want}"]
    if p.version != want:
        return [f"{p.where}: {p.name}=={p.version} but torch {torch_v} requires {want}; "
                f"fix: {p.name}=={want}"]
    return []


def label_problems(p, pins, tt):
    name = p.name.removeprefix("label:")
    if name == "torchtitan":
        return [] if p.version == tt else [f"{p.where}: label org.pww.torchtitan {p.version}; fix: {tt}"]
    installed = [q.version for q in pins if q.file == p.file and q.name == name]
    if installed and p.version not in installed:
        return [f"{p.where}: label org.pww.{name} {p.version} but the image installs {name}=={installed[0]}; "
                f"fix: label {installed[0]}"]
    return []


def missing_pins(pins):
    """Each installer pins torch, its Triton and torchtitan; the runbook states both sites'."""
    out = []
    want = {SNELLIUS: (("torch",), ("triton",), ("torchtitan",)),
            LUMI: (("torch",), ("triton-rocm", "pytorch-triton-rocm"), ("torchtitan",))}
    for f, groups in want.items():
        for names in groups:
            if not any(p.file == f and p.name in names for p in pins):
                out.append(f"{f}: no {names[0]}== pin; fix: pin it (see {REQUIREMENTS} and {SELF})")
    book = [p for p in pins if p.file == RUNBOOK and p.name == "torch"]
    if not any(rocm_of(p.version) for p in book) or not any(not rocm_of(p.version) for p in book):
        out.append(f"{RUNBOOK}: its site table must state both sites' torch (torch==... for LUMI's ROCm "
                   f"build and for Snellius's CUDA build); fix: the table in section 1")
    return out


class RepositoryPinsTest(unittest.TestCase):
    def test_every_pin_agrees(self):
        found = problems(read_repo())
        self.assertEqual(found, [], "\n" + "\n".join(found))

    def test_the_scan_sees_each_installer(self):
        pins = scan(read_repo())
        got = {(p.file, p.name, p.version) for p in pins}
        self.assertIn((SNELLIUS, "torch", "2.13.0+cu126"), got)
        self.assertIn((LUMI, "torch", "2.10.0+rocm7.0"), got)
        self.assertIn((LUMI, "triton-rocm", "3.6.0"), got)
        self.assertIn((LUMI, "label:torch", "2.10.0+rocm7.0"), got)
        self.assertTrue(any(p.file == RUNBOOK and p.name == "torch" for p in pins))


class PinRulesTest(unittest.TestCase):
    """Each rule on the repository's own files with one line changed."""

    def setUp(self):
        self.files = read_repo()

    def changed(self, rel, old, new):
        self.assertIn(old, self.files[rel], f"{rel} no longer holds {old!r}")
        files = dict(self.files)
        files[rel] = files[rel].replace(old, new)
        return problems(files)

    def assertNamed(self, found, rel, *words):
        hits = [f for f in found if f.startswith(rel + ":") and "fix:" in f and all(w in f for w in words)]
        self.assertTrue(hits, f"no problem naming {rel} with {words}:\n" + "\n".join(found))

    def test_a_torch_pin_back_at_2_9_1_fails_naming_the_file_and_the_fix(self):
        found = self.changed(SNELLIUS, "torch==2.13.0+cu126", "torch==2.9.1")
        self.assertNamed(found, SNELLIUS, "2.9.1", "cannot import torchtitan 0.2.2", "torch==2.13.0")
        found = self.changed(LUMI, "torch==2.10.0+rocm7.0", "torch==2.9.1+rocm6.4")
        self.assertNamed(found, LUMI, "2.9.1+rocm6.4", "torch==2.10.0+rocm7.0")
        found = self.changed(REQUIREMENTS, "torch==2.13.0", "torch==2.9.1")
        self.assertNamed(found, SNELLIUS, "CI tests torch 2.9.1")      # the sites now disagree with CI
        found = self.changed(REQUIREMENTS, "torch >= 2.10", "torch >= 2.9")
        self.assertNamed(found, REQUIREMENTS, "torch >= 2.9", "torch >= 2.10")

    def test_the_sites_must_agree_with_ci_and_with_each_other(self):
        found = self.changed(SNELLIUS, "torch==2.13.0+cu126", "torch==2.12.0+cu126")
        self.assertNamed(found, SNELLIUS, "CI tests torch 2.13.0")
        found = self.changed(SNELLIUS, "torchtitan==0.2.2", "torchtitan==0.2.1")
        self.assertNamed(found, SNELLIUS, "torchtitan==0.2.2")
        found = self.changed(RUNBOOK, "torch==2.10.0+rocm7.0", "torch==2.10.0+rocm7.1")
        self.assertTrue(any("ROCm torch pins differ" in f for f in found), found)

    def test_lumi_runs_the_newest_torch_its_driver_supports(self):
        found = self.changed(LUMI, "torch==2.10.0+rocm7.0", "torch==2.13.0+rocm7.2")
        self.assertNamed(found, LUMI, "ROCm 7.2", "up to 7.0", "torch==2.10.0+rocm7.0")
        self.assertEqual(lumi_torch((2, 10)), (2, 10))
        self.assertEqual(lumi_torch((2, 11)), None, "no ROCm 7.0 build of a newer torch")

    def test_triton_must_be_the_one_its_torch_requires(self):
        found = self.changed(SNELLIUS, "triton==3.7.1", "triton==3.9.0")
        self.assertNamed(found, SNELLIUS, "torch 2.13.0+cu126 requires 3.7.1")
        found = self.changed(LUMI, "triton-rocm==3.6.0", "pytorch-triton-rocm==3.6.0")
        self.assertNamed(found, LUMI, "require triton-rocm")
        found = self.changed(REQUIREMENTS, "triton==3.7.1", "triton==3.9.0")
        self.assertNamed(found, REQUIREMENTS, "triton==3.7.1")

    def test_labels_and_missing_pins(self):
        found = self.changed(LUMI, "org.pww.torch 2.10.0+rocm7.0", "org.pww.torch 2.9.1+rocm6.4")
        self.assertNamed(found, LUMI, "label")
        found = self.changed(SNELLIUS, "triton==3.7.1", "triton")
        self.assertTrue(any(f.startswith(SNELLIUS + ": no triton== pin") for f in found), found)


class InstalledStackTest(unittest.TestCase):
    """This interpreter (CI's, after `make setup`) runs requirements.txt's versions."""

    def test_installed_versions_are_the_pins_and_torchtitan_imports(self):
        pins = {p.name: p.version for p in scan({REQUIREMENTS: read_repo()[REQUIREMENTS]})}
        for name in ("torch", "torchtitan", "triton"):
            got = importlib.metadata.version(name).partition("+")[0]
            self.assertEqual(got, pins[name], f"{name} {got} installed, requirements.txt pins "
                                              f"{pins[name]}: run `make setup` (a new pin reinstalls)")
        import torch
        import torchtitan.models.qwen3          # noqa: F401  the import every Qwen3 job does
        import torch.nn.attention.varlen        # noqa: F401  the module the floor is about
        floor, _ = TORCHTITAN_TORCH_FLOOR[pins["torchtitan"]]
        self.assertGreaterEqual(minor(torch.__version__), floor)

    def test_the_floor_names_what_torchtitan_really_imports(self):
        import torchtitan
        src = os.path.join(os.path.dirname(torchtitan.__file__), "models", "attention.py")
        with open(src) as f:
            self.assertIn("from torch.nn.attention.varlen import", f.read(),
                          "torchtitan no longer imports varlen: re-derive TORCHTITAN_TORCH_FLOOR")


if __name__ == "__main__":
    unittest.main()
