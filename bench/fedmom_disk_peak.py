"""bench/fedmom_disk_peak.py - how much of the state dir does one FedMom merge need at its peak?

Runs on: the central VM (or any CPU box): stdlib + numpy + tensorio + wire + fedmom_state.
    python bench/fedmom_disk_peak.py [--dir /tmp] [--params-m 16.8] [--sites 2] [--wire int4]
Runs an aggregator state in process with --down-wire int4 (FedMomState, no HTTP), sends
each site's delta in --wire format for 3 rounds and samples the state dir's bytes every
2 ms during the third merge (momentum and residual exist by then). Prints the peak and the
steady state in models (M = theta's file), and the tick's wall time. Needs ~8 M of disk.
RUNBOOK.md section 1 ("The disk the central VM keeps") quotes it.
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import fedmom_state as fs  # noqa: E402
import tensorio  # noqa: E402
import wire  # noqa: E402


def dir_bytes(root):
    total = 0
    for base, _, files in os.walk(root):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(base, f))
            except OSError:                  # replaced or unlinked while we looked
                pass
    return total


def write_delta(path, shapes, fmt, rng):
    arrays = {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    if fmt == "f32":
        with tensorio.TensorWriter(path, [(k, "F32", s) for k, s in shapes.items()], fsync=False) as w:
            for k, a in arrays.items():
                w.write(k, a)
        return
    with wire.WireWriter(path, list(shapes.items()), wire.Codec(fmt), fsync=False) as w:
        for k, a in arrays.items():
            w.write(k, a)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the state dir goes (default $TMPDIR)")
    p.add_argument("--params-m", type=float, default=16.8, help="model size, millions of parameters (default 16.8)")
    p.add_argument("--sites", type=int, default=2, help="deltas per round (default 2)")
    p.add_argument("--wire", choices=wire.FORMATS, default="int4", help="the sites' delta format (default int4)")
    a = p.parse_args(argv)
    rows = max(1, int(a.params_m * 1e6 / 2048))
    shapes = {"embed": (rows // 2, 2048), "w1": (rows // 4, 2048), "w2": (rows - rows // 2 - rows // 4, 2048),
              "b": (2048,)}
    d = tempfile.mkdtemp(prefix="fedmom-disk-peak-", dir=a.dir)
    try:
        rng = np.random.default_rng(0)
        init = os.path.join(d, "init.safetensors")
        with tensorio.TensorWriter(init, [(k, "F32", s) for k, s in shapes.items()], fsync=False) as w:
            for k, s in shapes.items():
                w.write(k, rng.standard_normal(s).astype(np.float32))
        cfg = fs.ServerConfig(os.path.join(d, "st"), init=init, down_wire="int4", fsync=False).validate()
        st = fs.FedMomState(cfg, clock=lambda: 1000.0)
        sites = [f"s{i}" for i in range(a.sites)]
        for c in sites:
            st.join(c, c + "-inc")
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], dir_bytes(st.dir))
                time.sleep(0.002)
        delta_bytes = 0
        for rnd in range(3):
            for c in sites:
                path = os.path.join(d, f"{c}.delta")
                write_delta(path, shapes, a.wire, rng)
                delta_bytes = os.path.getsize(path)
                m = st.check_delta_meta({"cluster": c, "incarnation": c + "-inc", "tokens": 10, "base_round": st.round})
                part = st.spool.part()
                shutil.copyfile(path, part)
                st.accept_delta(m, part)
            if rnd == 2:
                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
            t0 = time.monotonic()
            st.tick()
            wall = time.monotonic() - t0
        stop.set()
        sampler.join()
        model = os.path.getsize(os.path.join(st.dir, st.theta_file))
        print(f"{sum(int(np.prod(s)) for s in shapes.values()):,} parameters, {a.sites} {a.wire} deltas of "
              f"{delta_bytes / model:.2f} M each, --down-wire int4: merge peak {peak[0] / model:.2f} M, "
              f"after the merge {dir_bytes(st.dir) / model:.2f} M, tick {wall:.2f} s (M = {model / 1e6:.1f} MB)")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
