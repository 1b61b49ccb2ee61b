"""The module map (ARCHITECTURE.md), read from the code: every `import` of a sibling, at the
top of a file or inside a function, is an edge. No circle anywhere; the site's torch-free half
and the clients import no server; diloco.py imports no sibling; the central VM's files import
only each other (central.sh's CENTRAL_FILES); nothing at the top level but demo.py imports
testbed/ (the harnesses of the tests, benches and demo); test modules share fixtures through
tests/fixtures.py and testbed/, never by importing each other. And the house stays small: at
most 40 top-level modules, 20 central files, a delta's path on the central VM through 5 files,
module docstrings of 40 lines, short docs (DocsTest). Nothing is run: the files are parsed."""
import ast
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = {"httpd", "darl_server", "fedmom_server", "blobstore"}


def imported(path):
    """Every module name `path` imports, anywhere in the file (the first dotted part)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def sibling_imports():
    """{module: {sibling modules it imports anywhere in the file}} of the top-level *.py."""
    mods = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    return {m: (imported(os.path.join(ROOT, m + ".py")) & mods) - {m} for m in sorted(mods)}


def central_files():
    """The modules central.sh copies to the central VM (its CENTRAL_FILES)."""
    with open(os.path.join(ROOT, "central.sh")) as f:
        return {n[:-3] for n in re.search(r'^CENTRAL_FILES="([^"]+)"', f.read(), re.M).group(1).split()}


def top_level_modules():
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def python_files():
    """Every top-level module and every testbed/ module, as paths relative to the checkout."""
    return [m + ".py" for m in top_level_modules()] + sorted(
        os.path.join("testbed", f) for f in os.listdir(os.path.join(ROOT, "testbed")) if f.endswith(".py"))


def reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def circle(graph):
    """One import circle as a list of modules, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


class ModuleMapTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = sibling_imports()

    def test_no_module_imports_one_that_imports_it_back(self):
        found = circle(self.graph)
        self.assertIsNone(found, f"import circle: {' -> '.join(found or [])}")

    def test_the_site_and_the_clients_import_no_server(self):
        for m in ("fedsite", "fedmom_client", "darl_client", "blob_client", "httpc", "darl_simulate"):
            with self.subTest(m):
                self.assertEqual(reach(self.graph, m) & SERVERS, set(), f"{m} imports a server")

    def test_diloco_imports_no_project_module(self):
        # DiLoCo inside one allocation stands alone: the federation's carrier, its error
        # feedback and the outer step's defaults are given to it, never imported
        self.assertEqual(self.graph["diloco"], set(), "diloco.py imports a module of the project")

    def test_no_test_module_imports_another(self):
        tests = os.path.join(ROOT, "tests")
        for fn in sorted(os.listdir(tests)):
            if fn.startswith("test_") and fn.endswith(".py"):
                with self.subTest(fn):
                    others = {m for m in imported(os.path.join(tests, fn)) if m.startswith("test_")}
                    self.assertEqual(others, set(), f"{fn} imports a test module: share it through fixtures.py")

    def test_only_the_demo_imports_the_testbed(self):
        for m in top_level_modules():
            with self.subTest(m):
                uses = "testbed" in imported(os.path.join(ROOT, m + ".py"))
                self.assertEqual(uses, m == "demo", f"{m}.py: testbed/ is for the tests, benches and the demo")

    def test_the_testbed_imports_no_test_module(self):
        for path in python_files():
            if path.startswith("testbed"):
                with self.subTest(path):
                    tests = {m for m in imported(os.path.join(ROOT, path)) if m.startswith("test_") or m == "fixtures"}
                    self.assertEqual(tests, set(), f"{path} imports from tests/")

    def test_the_central_files_import_only_each_other(self):
        central = central_files()
        for m in sorted(central):
            with self.subTest(m):
                self.assertEqual(reach(self.graph, m) - central, set(), f"{m} needs a file central.sh does not copy")


# The rooms that hold one concept each and read as one: they may pass 900 lines, never 2,000.
ROOMS = {
    "fedmom_round": "the aggregator's pure round core: who may send, the quorum, the records",
    "fedmom_state": "the aggregator's books: its round state, state.json, the spool, blobs, DARL custody",
    "outer_state": "the outer state: one round applied, its checkpoint and replay, its memory budget",
    "fedmom_merge": "the streaming merge and the worker processes it runs on",
    "darl_table": "DARL's pure table with its custody",
    "darl_server": "DARL's server with its write-ahead log",
    "httpd": "the HTTP server and its connection engine",
    "wire": "the wire formats and their fast kernels",
}
# A delta on the central VM passes through these, and the shared libraries below them.
DELTA_PATH = ("fedmom_server", "fedmom_state", "fedmom_round", "outer_state", "fedmom_merge")
LIBRARIES = {"httpd", "httpc", "durable", "tensorio", "wire", "testhooks", "blob_client", "darl_table",
             "status_page"}


class SizeTest(unittest.TestCase):
    """A newcomer walks the house in an hour: at most 40 top-level modules and 20 central files;
    a file of 900 lines at most unless it is one of ROOMS (one concept, at most 2,000); no class
    over 400 lines; train.py (the script a site runs) at most 700; a module's docstring at most
    40 lines (how to run it, what it owns, where the protocol is taught)."""

    def test_at_most_40_top_level_modules_and_20_central_files(self):
        self.assertLessEqual(len(top_level_modules()), 40, top_level_modules())
        self.assertLessEqual(len(central_files()), 20, sorted(central_files()))

    def test_a_delta_on_the_central_vm_crosses_5_files(self):
        graph = sibling_imports()
        path = {"fedmom_server"} | reach(graph, "fedmom_server")
        self.assertEqual(path - LIBRARIES, set(DELTA_PATH), "the aggregator's own files")

    def test_file_class_and_docstring_sizes(self):
        for fn in python_files():
            with open(os.path.join(ROOT, fn)) as f:
                src = f.read()
            with self.subTest(fn):
                name = os.path.basename(fn)[:-3]
                lines = src.count("\n")
                limit = 700 if fn == "train.py" else 2000 if name in ROOMS else 900
                self.assertLessEqual(lines, limit, f"{fn}: {lines} lines")
                tree = ast.parse(src)
                first = tree.body[0] if tree.body else None
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                    n = first.end_lineno - first.lineno + 1          # lines on the screen, continuations too
                    self.assertLessEqual(n, 40, f"{fn}: a docstring of {n} lines")
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        n = node.end_lineno - node.lineno + 1
                        self.assertLessEqual(n, 400, f"{fn}: class {node.name} is {n} lines")


def cells(row):
    """A markdown table row's cells: split on the `|` that are neither escaped (`\\|`) nor inside
    a code span."""
    out, cell, code, i = [], "", False, 0
    row = row.strip()
    while i < len(row):
        ch = row[i]
        if ch == "\\" and i + 1 < len(row):
            cell += row[i:i + 2]
            i += 2
            continue
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cell)
            cell = ""
        else:
            cell += ch
        i += 1
    out.append(cell)
    return [c for c in out[1:-1]] if row.startswith("|") and row.endswith("|") else out


class DocsTest(unittest.TestCase):
    """The docs a newcomer reads first stay short: the README's first 40 lines give the two
    commands and the table of the docs; FEDERATION_GUIDE.md at most 800 lines; no table cell in
    any doc over 420 characters (a few lines on a screen)."""

    def read(self, name):
        with open(os.path.join(ROOT, name)) as f:
            return f.read()

    def test_the_readme_first_screen(self):
        first = "\n".join(self.read("README.md").splitlines()[:40])
        for needed in ("make demo", "make test", "| RUNBOOK.md |", "| FEDERATION_GUIDE.md |", "| ARCHITECTURE.md |",
                       "| TESTING.md |", "| bench/RESULTS.md |"):
            self.assertIn(needed, first, "README.md's first 40 lines")

    def test_the_guide_is_at_most_800_lines(self):
        n = self.read("FEDERATION_GUIDE.md").count("\n")
        self.assertLessEqual(n, 800, f"FEDERATION_GUIDE.md: {n} lines; measured figures go to bench/RESULTS.md")

    def test_no_table_cell_over_420_characters(self):
        for name in ("README.md", "RUNBOOK.md", "FEDERATION_GUIDE.md", "ARCHITECTURE.md", "TESTING.md",
                     os.path.join("bench", "RESULTS.md")):
            for i, line in enumerate(self.read(name).splitlines(), 1):
                if line.startswith("|"):
                    longest = max(len(c.strip()) for c in cells(line))
                    with self.subTest(f"{name}:{i}"):
                        self.assertLessEqual(longest, 420, f"{name}:{i}: a table cell of {longest} characters")


if __name__ == "__main__":
    unittest.main()
