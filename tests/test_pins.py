"""tests/test_pins.py - every torch / torchtitan / triton pin in the repository agrees.

Four places install the training stack: requirements.txt (CI, tests, the local demo),
requirements-lumi-api.txt (LUMI's torch on CI's CPU, tests/test_lumi_api.py),
jobs/snellius_setup_venv.sh (the Snellius venv) and containers/lumi-titan.def (the LUMI
image); RUNBOOK.md's "Site environments" table states what each site runs. This test reads
every text file git tracks (or would: untracked files that are not ignored count too), in
every spelling a pin takes: `name==V`, `name == V`, `~=`, `>=`, `<`, ranges joined by commas,
conda's `pytorch=V`, wheel file names (`torch-2.9.1+rocm6.4-cp312-...whl`), the image's
org.pww.* labels, PyTorch's wheel index URLs (`download.pytorch.org/whl/cu126`), the image's
`From:` tag and its %test HIP assertion. It fails, naming the file, the line and the fix, when
  - a torch cannot import the pinned torchtitan (TORCHTITAN_TORCH_FLOOR), or a range admits
    one that cannot, or excludes a torch the project runs,
  - a CUDA/CPU torch differs from requirements.txt's, the version CI tests,
  - a ROCm torch is not the newest torch whose ROCm build LUMI-G's driver runs
    (LUMI_MAX_ROCM, TORCH_ROCM_BUILDS), or two ROCm pins differ, or
    requirements-lumi-api.txt's torch is not the image's,
  - a triton / triton-rocm is not the Triton its torch requires (TORCH_TRITON),
  - a torchtitan differs from requirements.txt's (ranges included), or a site lost its pin,
  - an index URL serves another build than the pin beside it (cu130 index, +cu126 pin), or
    the image's base ROCm or HIP assertion is not its torch's ROCm.
Then it checks that this interpreter runs exactly the versions of its requirements file
(requirements.txt, or $PWW_STACK_REQUIREMENTS: tests/test_lumi_api.py runs this class under
the LUMI venv) and imports torchtitan with them.

The tables are facts about other projects' releases; each row says where it comes from.
A newer torch or torchtitan needs its row here first, and the failure says so.
Run: .venv/bin/python tests/run.py test_pins
"""
import dataclasses
import importlib.metadata
import os
import re
import subprocess
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENTS, LUMI_API, SNELLIUS, LUMI, RUNBOOK = (
    "requirements.txt", "requirements-lumi-api.txt", "jobs/snellius_setup_venv.sh",
    "containers/lumi-titan.def", "RUNBOOK.md")

# The oldest torch each torchtitan release imports, and why (torchtitan's own sources).
TORCHTITAN_TORCH_FLOOR = {
    "0.2.2": ((2, 10), "torchtitan/models/attention.py imports torch.nn.attention.varlen, "
                       "first shipped in torch 2.10 (torchtitan issue #2108)"),
}
# The Triton each torch release requires (its .ci/docker/triton_version.txt; the ROCm
# wheels require triton-rocm / pytorch-triton-rocm of the same version).
TORCH_TRITON = {(2, 9): "3.5.1", (2, 10): "3.6.0", (2, 12): "3.7.0", (2, 13): "3.7.1"}
# The ROCm builds each torch release is published for on download.pytorch.org/whl/rocmX.Y
# (PyTorch's binary build matrix; 2.10: rocm7.0 and rocm7.1; 2.11, 2.12 and 2.13: rocm7.1
# and rocm7.2, the release matrix moving on to 7.2/7.14 only for 2.14).
TORCH_ROCM_BUILDS = {(2, 9): ((6, 3), (6, 4)), (2, 10): ((7, 0), (7, 1)), (2, 11): ((7, 1), (7, 2)),
                     (2, 12): ((7, 1), (7, 2)), (2, 13): ((7, 1), (7, 2))}
# LUMI-G's GPU driver, amdgpu 6.3.60300 since the January 2026 system update, runs ROCm
# user space 6.1 to 7.0 (LUMI's update notes); 7.1 and newer do not run there.
LUMI_MAX_ROCM = (7, 0)
# The CUDA builds each torch release is published for (release compatibility matrix).
TORCH_CUDA_BUILDS = {(2, 13): ("cu126", "cu130", "cu132")}

SELF = "tests/test_pins.py"
SKIP_DIRS = {".git", ".venv", "runs", "data", "logs", "state", "__pycache__", "node_modules"}
NAMES = r"pytorch-triton-rocm|pytorch_triton_rocm|pytorch-triton|pytorch_triton|triton-rocm|triton_rocm|pytorch|torchtitan|triton|torch"
OP = r"(?:===|==|~=|>=|<=|!=|<|>|=)"
# a requirement: name, then one or more comma-joined specifiers (`torch >= 2.10, <2.14`)
SPEC_RE = re.compile(rf"(?<![\w./-])(?P<name>{NAMES})(?![\w-])\s*(?P<specs>{OP}\s*[0-9][\w.+*]*"
                     rf"(?:\s*,\s*{OP}\s*[0-9][\w.+*]*)*)")
ONE_SPEC_RE = re.compile(rf"({OP})\s*([0-9][\w.+*]*)")
WHEEL_RE = re.compile(rf"(?<![\w.-])(?P<name>{NAMES})-(?P<version>[0-9][\w.]*(?:(?:\+|%2B)[\w.]+)?)-(?:cp|py)\d")
LABEL_RE = re.compile(r"^\s*org\.pww\.(torch|torchtitan|triton-rocm|rocm)\s+(\S+)")
INDEX_RE = re.compile(r"download\.pytorch\.org/whl/(?:nightly/|test/)?(cu\d+|rocm\d+(?:\.\d+)+|cpu|xpu)(?![\w.])")
FROM_RE = re.compile(r"^From:\s*\S+:(\d+\.\d+(?:\.\d+)?)\S*\s*$")
HIP_RE = re.compile(r"version\.hip\.startswith\(\s*['\"](\d+\.\d+)")


@dataclasses.dataclass
class Pin:
    file: str
    line: int
    name: str          # torch | torchtitan | triton | triton-rocm | pytorch-triton-rocm | pytorch-triton
                       # | label:<name> | index | from | hip
    version: str       # the exact version; for a range, its specifiers ("~=2.9.0", ">=2.10,<2.14")
    exact: bool = True

    @property
    def where(self):
        return f"{self.file}:{self.line}"

    @property
    def text(self):
        return f"{self.name}=={self.version}" if self.exact else f"{self.name}{self.version}"


def repo_files(root=ROOT):
    """Relative paths of what git tracks or would track (untracked, not ignored); every file
    outside the ignored directories where the tree is no git checkout."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
        return sorted(p for p in out.decode().split("\0") if p)
    except (OSError, subprocess.SubprocessError):
        found = []
        for base, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            found += [os.path.relpath(os.path.join(base, n), root) for n in names]
        return sorted(found)


def read_repo(root=ROOT):
    """{relative path: text} of every text file the scan reads (binary files, links and
    this test left out)."""
    files = {}
    for rel in repo_files(root):
        path = os.path.join(root, rel)
        if rel == SELF or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        if b"\0" not in raw[:8192]:
            files[rel] = raw.decode("utf-8", errors="replace")
    return files


def canonical(name):
    name = name.replace("_", "-")
    return "torch" if name == "pytorch" else name


def scan(files):
    pins = []
    for rel, text in sorted(files.items()):
        for no, line in enumerate(text.splitlines(), 1):
            for m in SPEC_RE.finditer(line):
                specs = [(op, v) for op, v in ONE_SPEC_RE.findall(m.group("specs"))]
                exact = len(specs) == 1 and specs[0][0] in ("==", "===", "=") and "*" not in specs[0][1]
                version = specs[0][1] if exact else ",".join(op + v for op, v in specs)
                pins.append(Pin(rel, no, canonical(m.group("name")), version, exact))
            pins += [Pin(rel, no, canonical(m.group("name")), m.group("version").replace("%2B", "+"))
                     for m in WHEEL_RE.finditer(line)]
            pins += [Pin(rel, no, "index", m.group(1)) for m in INDEX_RE.finditer(line)]
            if rel.endswith(".def"):
                m = LABEL_RE.match(line)
                if m:
                    pins.append(Pin(rel, no, "label:" + m.group(1), m.group(2)))
                m = FROM_RE.match(line)
                if m:
                    pins.append(Pin(rel, no, "from", m.group(1)))
                pins += [Pin(rel, no, "hip", v) for v in HIP_RE.findall(line)]
    return pins


def vtuple(version):
    return tuple(int(x) for x in re.findall(r"\d+", version.partition("+")[0])[:3])


def minor(version):
    return vtuple(version)[:2]


def local_tag(version):
    return version.partition("+")[2]


def rocm_of(version):
    m = re.fullmatch(r"rocm(\d+)\.(\d+)(?:\.\d+)?", local_tag(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def fmt(v):
    return ".".join(map(str, v))


def lumi_torch(floor):
    """(torch minor, ROCm) LUMI should run: the newest release at or above the floor with a
    ROCm build that LUMI-G's driver runs, and its newest such build; None when none exists."""
    usable = [(v, max(r for r in builds if r <= LUMI_MAX_ROCM)) for v, builds in TORCH_ROCM_BUILDS.items()
              if v >= floor and min(builds) <= LUMI_MAX_ROCM]
    return max(usable) if usable else None


def admits(specs, version):
    """Whether the comma-joined specifiers admit `version` (PEP 440's rules on release
    numbers, which is all torch's X.Y.Z needs; conda's `=X.Y` is a prefix, as `==X.Y.*`)."""
    v = vtuple(version)
    for op, want in ONE_SPEC_RE.findall(specs):
        w = vtuple(want)
        n = max(len(v), len(w))
        vp, wp = v + (0,) * (n - len(v)), w + (0,) * (n - len(w))
        prefix = v[:len(w)] == w
        ok = {"~=": v >= w and v[:len(w) - 1] == w[:len(w) - 1], "=": prefix,
              "==": prefix if "*" in want else vp == wp, "===": prefix if "*" in want else vp == wp,
              "!=": not prefix if "*" in want else vp != wp,
              ">=": vp >= wp, "<=": vp <= wp, ">": vp > wp, "<": vp < wp}[op]
        if not ok:
            return False
    return True


class Context:
    """The facts every rule reads: the pins, CI's versions, the floor, LUMI's torch.
    image_torch is the image's torch pin when it passes its own rules, else the one it
    should be: a wrong pin is reported once, at the pin, and the rules about what follows
    from it (the LUMI venv, the image's Triton, index, base ROCm, labels) check against
    the right version instead of repeating the wrong one as a fix."""

    def __init__(self, pins):
        self.pins = pins
        req = {p.name: p for p in pins if p.file == REQUIREMENTS and p.exact}
        self.tt = req["torchtitan"].version
        self.ci_torch = req["torch"].version.partition("+")[0]
        self.floor, self.why = TORCHTITAN_TORCH_FLOOR[self.tt]
        self.lumi = lumi_torch(self.floor)
        self.lumi_pin = f"{fmt(self.lumi[0])}.0+rocm{fmt(self.lumi[1])}" if self.lumi else None
        self.lumi_fix = f"torch=={self.lumi_pin}" if self.lumi else "none exists"
        self.image_torch = self.lumi_pin
        image = [p for p in pins if p.file == LUMI and p.name == "torch" and p.exact and rocm_of(p.version)]
        if image and not torch_pin_problems(image[0], self):
            self.image_torch = image[0].version
        self.valid = [p for p in pins if p.name == "torch" and p.exact and not torch_pin_problems(p, self)]

    def runs(self):
        """The torch versions the project runs (CI's, and the image's)."""
        return [self.ci_torch] + ([self.image_torch.partition("+")[0]] if self.image_torch else [])

    def torch_for(self, file, rocm):
        """The torch a file's Triton belongs to: its own valid pin, else the one it should pin."""
        own = [q.version for q in self.valid if q.file == file and bool(rocm_of(q.version)) == rocm]
        if own:
            return own[0]
        if rocm:
            return self.image_torch
        return self.image_torch.partition("+")[0] if file == LUMI_API and self.image_torch else self.ci_torch


def problems(files):
    """Every disagreement, as 'file:line: what; fix: how' (empty list: all pins agree)."""
    pins, out = scan(files), []
    req = {p.name: p for p in pins if p.file == REQUIREMENTS and p.exact}
    for name in ("torch", "torchtitan", "triton"):
        if name not in req:
            out.append(f"{REQUIREMENTS}: no {name}== pin; fix: pin the version CI installs ({name}==X.Y.Z)")
    if out:
        return out
    if req["torchtitan"].version not in TORCHTITAN_TORCH_FLOOR:
        return [f"{req['torchtitan'].where}: torchtitan {req['torchtitan'].version} has no row in {SELF}'s "
                f"TORCHTITAN_TORCH_FLOOR; fix: add the oldest torch it imports (read its imports of torch.*)"]
    ctx = Context(pins)
    for p in pins:
        if p.name == "torchtitan":
            out += torchtitan_problems(p, ctx)
        elif p.name == "torch":
            out += torch_pin_problems(p, ctx) if p.exact else torch_range_problems(p, ctx)
        elif p.name in ("triton", "triton-rocm", "pytorch-triton-rocm", "pytorch-triton"):
            out += triton_pin_problems(p, ctx)
        elif p.name.startswith("label:"):
            out += label_problems(p, pins, ctx)
        elif p.name == "index":
            out += index_problems(p, pins, ctx)
        elif p.name in ("from", "hip"):
            out += image_rocm_problems(p, ctx)
    rocm_pins = [p for p in pins if p.name == "torch" and p.exact and rocm_of(p.version)]
    if len({p.version for p in rocm_pins}) > 1:
        out.append(f"ROCm torch pins differ: {', '.join(f'{p.where} {p.version}' for p in rocm_pins)}; "
                   f"fix: the same torch=={ctx.image_torch} everywhere ({LUMI} is the one installed)")
    out += missing_pins(pins)
    return out


def torchtitan_problems(p, ctx):
    if not p.exact:
        return [f"{p.where}: {p.text} admits torchtitan versions CI never tests; fix: torchtitan=={ctx.tt}"]
    if p.version != ctx.tt:
        return [f"{p.where}: torchtitan=={p.version} but CI tests {ctx.tt}; fix: torchtitan=={ctx.tt}"]
    return []


def torch_pin_problems(p, ctx):
    v, rocm = p.version, rocm_of(p.version)
    if minor(v) < ctx.floor:
        fix = ctx.lumi_fix if rocm or p.file == LUMI_API else f"torch=={ctx.ci_torch} (requirements.txt)"
        return [f"{p.where}: torch=={v} cannot import torchtitan {ctx.tt} ({ctx.why}); fix: {fix}"]
    if p.file == LUMI_API:
        want = (ctx.image_torch or ctx.lumi_fix.partition("==")[2]).partition("+")[0]
        if v != want:
            return [f"{p.where}: torch=={v}, but the LUMI image ({LUMI}) runs torch {ctx.image_torch}: this "
                    f"venv is how CI runs LUMI's torch; fix: torch=={want}"]
        return []
    if rocm:
        builds = TORCH_ROCM_BUILDS.get(minor(v))
        if rocm > LUMI_MAX_ROCM:
            return [f"{p.where}: torch=={v} needs ROCm {fmt(rocm)} user space, and LUMI-G's driver "
                    f"(amdgpu 6.3.60300) runs ROCm up to {fmt(LUMI_MAX_ROCM)}; fix: {ctx.lumi_fix}"]
        if builds is None or rocm not in builds:
            return [f"{p.where}: torch=={v}: PyTorch publishes no such ROCm build"
                    + (f" (torch {fmt(minor(v))} is built for ROCm {', '.join(map(fmt, builds))})" if builds else "")
                    + f"; fix: {ctx.lumi_fix}"]
        if ctx.lumi is None or (minor(v), rocm) != ctx.lumi:
            return [f"{p.where}: torch=={v} is not the newest torch LUMI-G runs; fix: {ctx.lumi_fix}"]
        return []
    if v.partition("+")[0] != ctx.ci_torch:
        return [f"{p.where}: torch=={v} but CI tests torch {ctx.ci_torch} (requirements.txt); "
                f"fix: torch=={ctx.ci_torch}{'+' + local_tag(v) if local_tag(v) else ''}"]
    tag, builds = local_tag(v), TORCH_CUDA_BUILDS.get(minor(v))
    if tag.startswith("cu") and builds is not None and tag not in builds:
        return [f"{p.where}: torch=={v}: PyTorch publishes {fmt(minor(v))} for {', '.join(builds)} only; "
                f"fix: one of those (cu126 runs on every driver from R525 on)"]
    return []


def torch_range_problems(p, ctx):
    """A range (`torch >= 2.10`, `torch~=2.9.0`, `torch<2.10`) must admit no torch below the
    floor and every torch the project runs."""
    lows = [vtuple(w) for op, w in ONE_SPEC_RE.findall(p.version) if op in (">=", ">", "~=")]
    lows += [vtuple(w) for op, w in ONE_SPEC_RE.findall(p.version) if op in ("==", "===", "=") and "*" in w]
    if not lows or max(lows)[:2] < ctx.floor:
        what = f"admits torch {fmt(max(lows)[:2])}" if lows else f"has no lower bound: it admits torch below {fmt(ctx.floor)}"
        return [f"{p.where}: {p.text} {what}, which cannot import torchtitan {ctx.tt} "
                f"({ctx.why}); fix: torch >= {fmt(ctx.floor)}"]
    left_out = [v for v in ctx.runs() if not admits(p.version, v)]
    if left_out:
        return [f"{p.where}: {p.text} excludes torch {', '.join(left_out)}, which the project runs "
                f"({REQUIREMENTS}, {LUMI}); fix: torch >= {fmt(ctx.floor)}"]
    return []


def triton_pin_problems(p, ctx):
    if not p.exact:
        return [f"{p.where}: {p.text}: a torch build requires one exact Triton; fix: pin it with == "
                f"(the table TORCH_TRITON in {SELF})"]
    rocm_triton = p.name not in ("triton", "pytorch-triton")
    if rocm_triton and not any(q.file == p.file and q.name == "torch" and q.exact and rocm_of(q.version)
                               for q in ctx.pins):
        return [f"{p.where}: {p.name}=={p.version} without a ROCm torch beside it; fix: pin the "
                f"ROCm torch it belongs to in the same file"]
    torch_v = ctx.torch_for(p.file, rocm_triton)
    if torch_v is None:
        return []                        # no ROCm torch runs on LUMI at all: said at the pin
    want = TORCH_TRITON.get(minor(torch_v))
    if want is None:
        return [f"{p.where}: no Triton known for torch {torch_v}; fix: add its version (torch's "
                f".ci/docker/triton_version.txt) to {SELF}'s TORCH_TRITON"]
    if p.name == "pytorch-triton":
        return [f"{p.where}: pytorch-triton is the nightlies' Triton; torch {torch_v} requires triton; "
                f"fix: triton=={want}"]
    if p.name == "pytorch-triton-rocm" and minor(torch_v) >= (2, 10):
        return [f"{p.where}: torch {torch_v}'s ROCm wheels require triton-rocm, not {p.name}; "
                f"fix: triton-rocm=={want}"]
    if p.version != want:
        return [f"{p.where}: {p.name}=={p.version} but torch {torch_v} requires {want}; fix: {p.name}=={want}"]
    return []


def label_problems(p, pins, ctx):
    name = p.name.removeprefix("label:")
    if name == "torchtitan":
        return [] if p.version == ctx.tt else [f"{p.where}: label org.pww.torchtitan {p.version}; fix: {ctx.tt}"]
    if name == "rocm":
        base = [q.version for q in pins if q.file == p.file and q.name == "from"]
        if base and p.version != base[0]:
            return [f"{p.where}: label org.pww.rocm {p.version} but the image is built From: ROCm {base[0]}; "
                    f"fix: label {base[0]}"]
        return []
    if name == "torch":
        installed = [ctx.image_torch] if ctx.image_torch else []
    else:
        installed = [q.version for q in pins if q.file == p.file and q.name == name and q.exact]
    if installed and p.version not in installed:
        return [f"{p.where}: label org.pww.{name} {p.version} but the image installs {name}=={installed[0]}; "
                f"fix: label {installed[0]}"]
    return []


def index_problems(p, pins, ctx):
    """PyTorch's wheel index serves one build per URL: it must be the build the torch pin in
    the same file names (+cu126 from whl/cu126; an untagged or +cpu pin from whl/cpu). A
    pin that breaks its own rules is reported there, not measured against."""
    tagged = [q for q in ctx.valid if q.file == p.file]
    if not tagged:
        return []
    ok = [q for q in tagged if local_tag(q.version) == p.version
          or (p.version == "cpu" and local_tag(q.version) == "")]
    if ok:
        return []
    return [f"{p.where}: installs from PyTorch's {p.version} index, but the torch pinned here is "
            f"{', '.join(q.version for q in tagged)}; fix: the index and the pin's +tag name the same "
            f"build (whl/{local_tag(tagged[0].version) or 'cpu'} for torch=={tagged[0].version})"]


def image_rocm_problems(p, ctx):
    """The image's base ROCm (From: tag) and its %test assertion name the ROCm of its torch."""
    if not ctx.image_torch or p.file != LUMI:
        return []
    rocm = rocm_of(ctx.image_torch)
    got = vtuple(p.version)[:2]
    what = "its base image (From:)" if p.name == "from" else "its %test asserts torch.version.hip"
    if got != rocm:
        return [f"{p.where}: {what} is ROCm {p.version}, its torch {ctx.image_torch} is built for ROCm "
                f"{fmt(rocm)}; fix: ROCm {fmt(rocm)} there (the plugin is built against the base's ROCm)"]
    return []


def missing_pins(pins):
    """Each installer pins torch, its Triton and torchtitan; the runbook states both sites'."""
    out = []
    want = {SNELLIUS: (("torch",), ("triton",), ("torchtitan",)),
            LUMI: (("torch",), ("triton-rocm", "pytorch-triton-rocm"), ("torchtitan",), ("from",)),
            LUMI_API: (("torch",), ("triton",), ("torchtitan",))}
    for f, groups in want.items():
        for names in groups:
            if not any(p.file == f and p.name in names and p.exact for p in pins):
                what = "From: rocm/...:<version> line" if names[0] == "from" else f"{names[0]}== pin"
                out.append(f"{f}: no {what}; fix: pin it (see {REQUIREMENTS} and {SELF})")
    book = [p for p in pins if p.file == RUNBOOK and p.name == "torch" and p.exact]
    if not any(rocm_of(p.version) for p in book) or not any(not rocm_of(p.version) for p in book):
        out.append(f"{RUNBOOK}: its site table must state both sites' torch (torch==... for LUMI's ROCm "
                   f"build and for Snellius's CUDA build); fix: the table in section 1")
    return out


class RepositoryPinsTest(unittest.TestCase):
    def test_every_pin_agrees(self):
        found = problems(read_repo())
        self.assertEqual(found, [], "\n" + "\n".join(found))

    def test_the_scan_sees_each_installer(self):
        files = read_repo()
        for rel in (".ci/run", "Makefile", LUMI_API, "containers/lumi-env.sh"):
            self.assertIn(rel, files, "every tracked text file is read, whatever its name")
        got = {(p.file, p.name, p.version) for p in scan(files)}
        for pin in ((SNELLIUS, "torch", "2.13.0+cu126"), (SNELLIUS, "index", "cu126"),
                    (LUMI, "torch", "2.10.0+rocm7.0"), (LUMI, "triton-rocm", "3.6.0"), (LUMI, "index", "rocm7.0"),
                    (LUMI, "label:torch", "2.10.0+rocm7.0"), (LUMI, "from", "7.0.2"), (LUMI, "hip", "7.0"),
                    (LUMI_API, "torch", "2.10.0"), (LUMI_API, "triton", "3.6.0"), (RUNBOOK, "torch", "2.13.0+cu126")):
            self.assertIn(pin, got)


class PinRulesTest(unittest.TestCase):
    """Each rule on the repository's own files with one line changed."""

    def setUp(self):
        self.files = read_repo()

    def changed(self, rel, old, new):
        self.assertIn(old, self.files[rel], f"{rel} no longer holds {old!r}")
        files = dict(self.files)
        files[rel] = files[rel].replace(old, new)
        return problems(files)

    def added(self, rel, text):
        return problems(dict(self.files, **{rel: self.files.get(rel, "") + text}))

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
        self.assertNamed(found, REQUIREMENTS, "torch>=2.9", "torch >= 2.10")

    def test_every_spelling_of_a_pin_is_read(self):
        old = "torch==2.13.0+cu126"
        for new, words in (("torch == 2.9.1", ("2.9.1", "cannot import")),
                           ("torch~=2.9.0", ("torch~=2.9.0", "admits torch 2.9")),
                           ("torch<2.10", ("torch<2.10", "no lower bound")),
                           ("torch>=2.10,<2.13", ("excludes torch 2.13.0",)),
                           ("pytorch=2.9.1", ("torch==2.9.1", "cannot import"))):
            self.assertNamed(self.changed(SNELLIUS, old, new), SNELLIUS, *words)
        found = self.added(".ci/run", "pip install torch-2.9.1+rocm6.4-cp312-cp312-linux_x86_64.whl\n")
        self.assertNamed(found, ".ci/run", "2.9.1+rocm6.4", "cannot import")
        found = self.added("Dockerfile", "RUN pip install torchtitan>=0.1 pytorch-triton==3.7.1\n")
        self.assertNamed(found, "Dockerfile", "torchtitan>=0.1", "torchtitan==0.2.2")
        self.assertNamed(found, "Dockerfile", "pytorch-triton", "triton==3.7.1")
        found = self.added("jobs/x.sbatch", "wget https://download.pytorch.org/whl/cu126/torch-2.13.0%2Bcu126-cp312-cp312-manylinux_2_28_x86_64.whl\n")
        self.assertEqual(found, [], "a matching wheel URL is a correct pin")

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
        found = self.changed(LUMI, "torch==2.10.0+rocm7.0", "torch==2.11.0+rocm7.1")
        self.assertNamed(found, LUMI, "ROCm 7.1", "up to 7.0")
        found = self.changed(LUMI, "torch==2.10.0+rocm7.0", "torch==2.13.0+rocm7.0")
        self.assertNamed(found, LUMI, "no such ROCm build", "ROCm 7.1, 7.2")
        self.assertEqual(lumi_torch((2, 10)), ((2, 10), (7, 0)))
        self.assertEqual(lumi_torch((2, 11)), None, "no ROCm 7.0 build of a newer torch")

    def test_ci_runs_the_image_torch_through_the_lumi_api_venv(self):
        found = self.changed(LUMI_API, "torch==2.10.0", "torch==2.13.0")
        self.assertNamed(found, LUMI_API, "runs torch 2.10.0+rocm7.0", "torch==2.10.0")
        found = self.changed(LUMI_API, "triton==3.6.0", "triton==3.7.1")
        self.assertNamed(found, LUMI_API, "torch 2.10.0 requires 3.6.0")
        found = self.changed(LUMI_API, "torchtitan==0.2.2", "torchtitan")
        self.assertTrue(any(f.startswith(LUMI_API + ": no torchtitan== pin") for f in found), found)

    def test_the_index_the_base_image_and_the_hip_assertion_match_the_pin(self):
        found = self.changed(SNELLIUS, "download.pytorch.org/whl/cu126", "download.pytorch.org/whl/cu130")
        self.assertNamed(found, SNELLIUS, "cu130 index", "2.13.0+cu126")
        found = self.changed(LUMI, "download.pytorch.org/whl/rocm7.0", "download.pytorch.org/whl/rocm6.4")
        self.assertNamed(found, LUMI, "rocm6.4 index", "whl/rocm7.0")
        found = self.changed(LUMI, "From: rocm/dev-ubuntu-24.04:7.0.2", "From: rocm/dev-ubuntu-24.04:7.1.1")
        self.assertNamed(found, LUMI, "base image", "ROCm 7.1.1", "ROCm 7.0")
        self.assertNamed(found, LUMI, "org.pww.rocm 7.0.2", "7.1.1")
        found = self.changed(LUMI, "startswith('7.0')", "startswith('6.4')")
        self.assertNamed(found, LUMI, "asserts torch.version.hip", "ROCm 6.4")

    def test_triton_must_be_the_one_its_torch_requires(self):
        found = self.changed(SNELLIUS, "triton==3.7.1", "triton==3.9.0")
        self.assertNamed(found, SNELLIUS, "torch 2.13.0+cu126 requires 3.7.1")
        found = self.changed(LUMI, "triton-rocm==3.6.0", "pytorch-triton-rocm==3.6.0")
        self.assertNamed(found, LUMI, "require triton-rocm")
        found = self.changed(REQUIREMENTS, "triton==3.7.1", "triton==3.9.0")
        self.assertNamed(found, REQUIREMENTS, "triton==3.7.1")
        found = self.changed(SNELLIUS, "triton==3.7.1", "triton>=3.7")
        self.assertNamed(found, SNELLIUS, "triton>=3.7", "one exact Triton")

    def test_labels_and_missing_pins(self):
        found = self.changed(LUMI, "org.pww.torch 2.10.0+rocm7.0", "org.pww.torch 2.9.1+rocm6.4")
        self.assertNamed(found, LUMI, "label")
        found = self.changed(SNELLIUS, "triton==3.7.1", "triton")
        self.assertTrue(any(f.startswith(SNELLIUS + ": no triton== pin") for f in found), found)


class InstalledStackTest(unittest.TestCase):
    """This interpreter runs its requirements file's versions: requirements.txt (CI's, after
    `make setup`), or $PWW_STACK_REQUIREMENTS (the LUMI venv's, under tests/test_lumi_api.py)."""

    def test_installed_versions_are_the_pins_and_torchtitan_imports(self):
        rel = os.environ.get("PWW_STACK_REQUIREMENTS", REQUIREMENTS)
        with open(os.path.join(ROOT, rel)) as f:
            pins = {p.name: p.version for p in scan({rel: f.read()}) if p.exact}
        for name in ("torch", "torchtitan", "triton"):
            got = importlib.metadata.version(name).partition("+")[0]
            self.assertEqual(got, pins[name], f"{name} {got} installed, {rel} pins {pins[name]}: run "
                                              f"`make setup` or `make lumi-api` (a new pin reinstalls)")
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
