"""tests/helpers.py - small pieces several test modules share (no test cases here).

listening_url(proc): the URL a server subprocess prints in its "... listening on URL"
line, with a deadline: a server that hangs before listening, or exits, fails the
test with its output instead of blocking it. The rest of its output keeps being
read (and kept) so the pipe never fills.
"""
import re
import threading
import time

LISTENING = re.compile(r"listening on (http://\S+)")


class Output:
    """Every line a subprocess writes to its stdout pipe, read by a daemon thread."""

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
    """(url, Output) of a server started with stdout=PIPE, text=True."""
    out = Output(proc)
    return out.wait_for(LISTENING, timeout).group(1), out
