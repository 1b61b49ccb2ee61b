"""durable.py on real files: atomic replacement, a failed write that leaves the old file and no
temporary, an append cut back after a failed write, torn lines skipped.

A failed write is a real one: a child process with RLIMIT_FSIZE below the new content's size
(the kernel answers EFBIG, as a full disk answers ENOSPC, part-way through the write)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import durable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def limited(code, limit_bytes, cwd):
    """Run `code` in a child whose files may not grow past limit_bytes; -> CompletedProcess."""
    prog = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {ROOT!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG from write() instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))
        import durable
    """) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", prog], cwd=cwd, capture_output=True, text=True, timeout=60)


class DurableTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="durable-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def test_write_replaces_whole_and_leaves_no_temporary(self):
        p = self.path("state.json")
        durable.write_json(p, {"round": 1})
        durable.write_json(p, {"round": 2}, indent=1, sort_keys=True)
        with open(p) as f:
            self.assertEqual(json.load(f), {"round": 2})
        durable.write_text(self.path("note.txt"), "hello\n")
        with open(self.path("note.txt")) as f:
            self.assertEqual(f.read(), "hello\n")
        self.assertEqual(sorted(os.listdir(self.dir)), ["note.txt", "state.json"])

    def test_an_exception_while_writing_keeps_the_old_file(self):
        p = self.path("theta.bin")
        durable.write_bytes(p, b"old")
        with self.assertRaises(RuntimeError):
            with durable.replacing(p) as tmp:
                with open(tmp, "wb") as f:
                    f.write(b"half of the new")
                raise RuntimeError("the writer died")
        with open(p, "rb") as f:
            self.assertEqual(f.read(), b"old")
        self.assertEqual(os.listdir(self.dir), ["theta.bin"])

    def test_a_write_the_filesystem_refuses_keeps_the_old_file(self):
        p = self.path("state.json")
        durable.write_json(p, {"round": 1})
        r = limited(f"""
            try:
                durable.write_json({p!r}, {{"round": 2, "pad": "x" * 100000}})
            except OSError as e:
                print("refused", e.errno)
        """, 4096, self.dir)
        self.assertIn("refused 27", r.stdout, r.stderr)           # EFBIG
        with open(p) as f:
            self.assertEqual(json.load(f), {"round": 1})
        self.assertEqual(os.listdir(self.dir), ["state.json"], "no temporary left behind")

    def test_a_failed_append_is_cut_back_and_the_next_line_is_whole(self):
        p = self.path("rounds.jsonl")
        durable.append_json_line(p, {"round": 1})
        before = os.path.getsize(p)
        r = limited(f"""
            try:
                durable.append_json_line({p!r}, {{"round": 2, "pad": "x" * 100000}})
            except OSError as e:
                print("refused", e.errno)
        """, 4096, self.dir)
        self.assertIn("refused 27", r.stdout, r.stderr)
        self.assertEqual(os.path.getsize(p), before, "the part that fit was cut back off")
        durable.append_json_line(p, {"round": 3})
        self.assertEqual(durable.read_jsonl(p), [{"round": 1}, {"round": 3}])

    def test_read_jsonl_skips_torn_lines_and_a_missing_file(self):
        p = self.path("metrics.jsonl")
        self.assertEqual(durable.read_jsonl(p), [])
        with open(p, "w") as f:
            f.write('{"step": 1}\n{"step": 2, "lo')          # killed mid-line ...
            f.write('{"step": 3}\n{"step": 4}\n{"ste')       # ... and its successor appended
        self.assertEqual(durable.read_jsonl(p), [{"step": 1}, {"step": 4}])

    def test_cut_torn_line_before_appending(self):
        p = self.path("rounds.jsonl")
        self.assertEqual(durable.cut_torn_line(p), 0)                   # no file
        durable.append_json_line(p, {"round": 1})
        self.assertEqual(durable.cut_torn_line(p), 0)                   # whole lines only
        with open(p, "a") as f:
            f.write('{"round": 2, "lo')                                 # killed mid-append
        self.assertEqual(durable.cut_torn_line(p), len('{"round": 2, "lo'))
        durable.append_json_line(p, {"round": 3})
        self.assertEqual(durable.read_jsonl(p), [{"round": 1}, {"round": 3}])

    def test_fsync_dir_and_unlink(self):
        durable.fsync_dir(self.dir)
        p = self.path("x")
        durable.write_text(p, "x")
        with self.assertRaises(NotADirectoryError):
            durable.fsync_dir(p)
        self.assertTrue(durable.unlink(p))
        self.assertFalse(durable.unlink(p))
        with self.assertRaises(IsADirectoryError):
            durable.unlink(self.dir)


    def test_rename_fsync_tree_and_temporary_names(self):
        d = self.path("export.tmp-77")
        os.makedirs(os.path.join(d, "sub"))
        durable.write_text(os.path.join(d, "a.json"), "{}", fsync=False)
        durable.fsync_tree(d)
        durable.rename(d, self.path("export"))
        self.assertEqual(sorted(os.listdir(self.path("export"))), ["a.json", "sub"])
        self.assertEqual(os.listdir(self.dir), ["export"])
        with durable.replacing(self.path("x.json")) as tmp:
            self.assertTrue(durable.is_tmp(os.path.basename(tmp)), tmp)
            open(tmp, "w").close()
        for name in ("x.json", ".a.tmp-1.json", "step_000000001.pt", "x.tmp-", "x.tmp-1a"):
            self.assertFalse(durable.is_tmp(name), name)
        self.assertTrue(durable.is_tmp(".a.json.tmp-123"))


if __name__ == "__main__":
    unittest.main()
