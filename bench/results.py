"""bench/results.py - put one bench script's printed output into bench/RESULTS.md.

Runs on: any machine, standard library only. `make bench` pipes each bench's stdout
through it (tee'd, so it still prints):

    python bench/hetero.py --quick | tee out.txt
    python bench/results.py hetero --command "python bench/hetero.py --quick" < out.txt
    python bench/results.py --check hetero       # exit 1 unless RESULTS.md has hetero's markers

It rewrites only what lies between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`:
the command, today's date and the lines the bench printed (the last --tail of them).
Everything outside the markers (the hand-written tables of longer runs, what the
figures mean) is left as it was. Markers missing, twice, or in the wrong order: exit 1,
nothing written. Empty input: exit 1, nothing written (a bench that printed nothing
measured nothing).
"""
import argparse
import datetime
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def markers(name):
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def find_block(text, name, path):
    """(start, end) of the text between NAME's markers, or SystemExit naming what is wrong."""
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"bench/results.py: {path} needs exactly one {begin} and one {end} "
                         f"(found {text.count(begin)} and {text.count(end)}): add them where "
                         f"{name}'s figures belong; nothing was written")
    i, j = text.index(begin) + len(begin), text.index(end)
    if j < i:
        raise SystemExit(f"bench/results.py: {path}: {end} comes before {begin}; nothing was written")
    return i, j


def clean(output, tail):
    """The printed lines, without terminal colours or carriage-return progress, the last `tail`."""
    lines = []
    for line in output.split("\n"):
        line = ANSI.sub("", line).split("\r")[-1].rstrip()
        lines.append(line.replace("```", "'''"))
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    cut = max(0, len(lines) - tail)
    return lines[cut:], cut


def block(command, date, lines, cut):
    head = f"Last refreshed by `make bench` on {date}: `{command}`"
    if cut:
        head += f" (its last {len(lines)} lines; {cut} earlier ones left out)"
    return "\n" + head + ":\n\n```text\n" + "\n".join(lines) + "\n```\n"


def replace_block(path, name, body):
    """NAME's block in `path` becomes `body`, written atomically (bench/faults.py's tables too)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i, j = find_block(text, name, path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text[:i] + body + text[j:])
    os.replace(tmp, path)


def rewrite(path, name, command, output, date, tail=80):
    lines, cut = clean(output, tail)
    if not lines:
        raise SystemExit(f"bench/results.py: no output for {name} on stdin; {path} left as it was")
    replace_block(path, name, block(command, date, lines, cut))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="the bench's name: its markers are <!-- bench:NAME --> ... <!-- /bench:NAME -->")
    p.add_argument("--command", help="the command that printed stdin (required unless --check)")
    p.add_argument("--file", default=RESULTS, help="the markdown file (default bench/RESULTS.md)")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="the date to write (default today)")
    p.add_argument("--tail", type=int, default=80, help="keep the last N printed lines (default 80)")
    p.add_argument("--check", action="store_true", help="only check that the markers are there; read nothing")
    a = p.parse_args(argv)
    if not NAME.match(a.name):
        p.error(f"bad bench name {a.name!r}")
    if a.check:
        with open(a.file, encoding="utf-8") as f:
            find_block(f.read(), a.name, a.file)
        return 0
    if not a.command:
        p.error("--command is required (the command whose output is on stdin)")
    rewrite(a.file, a.name, a.command, sys.stdin.buffer.read().decode("utf-8", "replace"), a.date, a.tail)
    print(f"bench/results.py: {a.name}'s block in {os.path.relpath(a.file)} rewritten ({a.date})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
