"""The module map (ARCHITECTURE.md section 2), read from the code: every `import` of a
sibling, at the top of a file or inside a function, is an edge. No circle anywhere; the
site's torch-free half and the clients import no server; diloco.py imports no sibling; the
central VM's files import only each other (central.sh's CENTRAL_FILES); test modules share
fixtures through tests/fixtures.py and harness.py, never by importing each other. Nothing
is run: the files are parsed."""
import ast
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = {"httpd", "httpd_loop", "darl_server", "fedmom_server", "blobstore"}


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

    def test_the_central_files_import_only_each_other(self):
        with open(os.path.join(ROOT, "central.sh")) as f:
            central = {n[:-3] for n in re.search(r'^CENTRAL_FILES="([^"]+)"', f.read(), re.M).group(1).split()}
        for m in sorted(central):
            with self.subTest(m):
                self.assertEqual(reach(self.graph, m) - central, set(), f"{m} needs a file central.sh does not copy")


class SizeTest(unittest.TestCase):
    """A newcomer reads a file in one sitting: no top-level module over 900 lines, no class over
    400, train.py (the script a site runs) at most 700."""

    def test_no_file_over_900_lines_no_class_over_400_and_train_py_at_most_700(self):
        for fn in sorted(f for f in os.listdir(ROOT) if f.endswith(".py")):
            with open(os.path.join(ROOT, fn)) as f:
                src = f.read()
            with self.subTest(fn):
                lines = src.count("\n")
                self.assertLessEqual(lines, 700 if fn == "train.py" else 900, f"{fn}: {lines} lines")
                for node in ast.walk(ast.parse(src)):
                    if isinstance(node, ast.ClassDef):
                        n = node.end_lineno - node.lineno + 1
                        self.assertLessEqual(n, 400, f"{fn}: class {node.name} is {n} lines")


if __name__ == "__main__":
    unittest.main()
