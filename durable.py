"""durable.py - files that survive a crash: atomic replacement, durable renames, JSON lines.

Runs on: everywhere (imported by the central services, the site code, the tools and the
benches). Standard library only, so the central VM's Python needs nothing more for it.
No state of its own.

The rules every writer in this repository follows:
  - A file is replaced, never rewritten in place: the new content goes to a temporary
    name beside it, is fsync'd, renamed over the old name, and the directory is fsync'd
    (a rename lives in the directory; without that fsync a power cut can bring back the
    old name or no name at all). A reader sees the old file or the new one, whole.
  - A failed write (a full disk, an interrupt) leaves the old file and no temporary one,
    and raises: nothing is half-replaced, nothing is quietly kept.
  - An append-only log gets whole lines: a line is written, flushed and fsync'd; if the
    write fails the file is cut back to where it was, so no torn line sits before the
    next. A crash mid-line can still leave a torn LAST line: read_jsonl skips it, and a
    writer calls cut_torn_line when it starts, before its first append.

    durable.write_json(path, obj)                 # temp + fsync + rename + fsync of the dir
    durable.write_text(path, text)
    with durable.replacing(path) as tmp: ...       # any writer (a tensor file, a download)
    durable.rename(done, path)                    # a finished file/dir of yours into place
    durable.fsync_dir(path)                       # after a rename or a new file of your own
    durable.fsync_file(path); durable.fsync_tree(path)
    durable.append_json_line(path, obj)
    durable.cut_torn_line(path)                    # at start, before the first append
    rows = durable.read_jsonl(path)                # [] when there is no file
    durable.unlink(path)                           # no error when it is already gone
    durable.is_disk_full(err)                      # ENOSPC / EDQUOT: a full disk, not a bug
    fd = durable.lock_state_dir(path, who)         # one process per state directory
"""
import contextlib
import errno
import fcntl
import json
import os
import re

TMP_INFIX = ".tmp-"            # temporary names are <name>.tmp-<pid>: a sweep can recognise them
_TMP_RE = re.compile(r"\.tmp-\d+$")


def fsync_dir(path):
    """Make the names in directory `path` durable (a rename, a new file, an unlink).

    A filesystem that cannot fsync a directory at all (EINVAL: some network and FUSE
    filesystems) has nothing more to give; that is not an error. Every other failure is
    (EIO after a lost write: the rename may not be on disk)."""
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path):
    """fsync a file you wrote and closed (its data and size on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path):
    """fsync every entry directly in directory `path`, then the directory itself: a
    directory other writers filled (torch.distributed.checkpoint, an export), before it
    is renamed into place. Not recursive."""
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        (fsync_dir if os.path.isdir(entry) else fsync_file)(entry)
    fsync_dir(path)


def rename(src, dst, fsync=True):
    """Move a finished (and fsync'd) file or directory `src` over `dst`, durably: the
    rename, then the fsync of dst's directory. fsync=False: the rename alone."""
    os.replace(src, dst)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(dst)))


def tmp_name(path):
    """The temporary name beside `path` this process writes before the rename."""
    return f"{path}{TMP_INFIX}{os.getpid()}"


def is_tmp(name):
    """True for a name tmp_name() makes: a leftover of a writer that died before its rename."""
    return bool(_TMP_RE.search(name))


@contextlib.contextmanager
def replacing(path, fsync=True):
    """`with replacing(path) as tmp:` write the whole new content to `tmp` (and fsync it, or
    let write_* do it); on a clean exit tmp is renamed to `path` and the directory fsync'd;
    on an exception tmp is removed and `path` left as it was. fsync=False: the rename
    without the directory fsync (tests, benches on tmpfs)."""
    tmp = tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        unlink(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_bytes(path, data, fsync=True):
    with replacing(path, fsync) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())


def write_text(path, text, fsync=True):
    write_bytes(path, text.encode(), fsync)


def write_json(path, obj, fsync=True, **dump_kw):
    """obj as JSON (json.dumps keywords in dump_kw), one trailing newline, atomically."""
    write_text(path, json.dumps(obj, **dump_kw) + "\n", fsync)


def append_json_line(path, obj, fsync=True, **dump_kw):
    """One JSON line at the end of `path`; a failed write is cut back off (no torn line)."""
    line = json.dumps(obj, **dump_kw) + "\n"
    with open(path, "a") as f:
        end = f.tell()
        try:
            f.write(line)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        except BaseException:
            f.truncate(end)
            raise


def cut_torn_line(path):
    """Cut an unfinished last line (a crash mid-append) off a JSON-lines file before anything
    is appended to it, or the next line would be glued to the fragment and be lost with
    it. Returns the number of bytes cut: 0 when the file ends in a newline or is absent."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            keep = data.rfind(b"\n") + 1
            if keep == len(data):
                return 0
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    except FileNotFoundError:
        return 0
    return len(data) - keep


def read_jsonl(path):
    """Every line of a JSON-lines file that parses, in order; [] when there is no file. A
    line that does not parse is a torn write (a writer killed mid-line, its successor
    appending after it) and is skipped: readers judge what the lines say, and a lost
    line shows there (a round missing, a count short)."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return rows


def unlink(path):
    """Remove `path`; True if it was there. Any error but its absence is raised."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def is_disk_full(err):
    """A full disk (ENOSPC, EDQUOT): the servers answer 507 naming the disk, a client does not
    repeat a call whose own download found its disk full."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def lock_state_dir(path, who):
    """Hold an exclusive flock on <path>/lock for as long as the returned fd stays open (the
    kernel drops it when the process dies, so a kill -9 never leaves a stale lock). A second
    server on the same state directory would interleave its writes with the first one's;
    it stops here instead, before reading or touching anything. SystemExit names the holder."""
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SystemExit(f"{who}: {path} is in use by another {who} (pid {holder}, holding {lock}); stop that "
                         "process first, or give this one another --state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
