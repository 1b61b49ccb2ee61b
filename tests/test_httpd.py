"""The shared HTTP plumbing, through a real socket on 127.0.0.1."""
import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import unittest

import httpc
import httpd
from testbed.harness import listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def echo(req):
    return {"got": req.json()}


def boom(req):
    raise RuntimeError("kaput")


def teapot(req):
    raise httpd.HTTPError(418, "short and stout", hint="tip me over")


def tail(req):
    return 201, {"tail": req.tail}


ROUTES = {("GET", "/health"): lambda r: {"ok": True}, ("POST", "/echo"): echo,
          ("GET", "/boom"): boom, ("GET", "/teapot"): teapot, ("PUT", "/things/*"): tail}


class LiveServer:
    def __init__(self, token=None):
        self.server = httpd.make_server(ROUTES, token=token, max_body=1000)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = self.server.url

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class HTTPPlumbingTest(unittest.TestCase):
    def setUp(self):
        self.live = LiveServer(token="s3cret")
        self.addCleanup(self.live.close)

    def call(self, method, path, body=None, token="s3cret"):
        return httpc.call(self.live.url, method, path, body, token=token)

    def test_health_is_public_everything_else_needs_the_token(self):
        self.assertEqual(httpc.call(self.live.url, "GET", "/health"), {"ok": True})
        with self.assertRaises(httpc.CallError) as cm:
            self.call("POST", "/echo", {"a": 1}, token="wrong")
        self.assertEqual(cm.exception.status, 401)
        self.assertEqual(self.call("POST", "/echo", {"a": 1}), {"got": {"a": 1}})

    def test_errors_are_one_line_json_and_the_server_keeps_serving(self):
        for path, status in (("/nowhere", 404), ("/boom", 500), ("/teapot", 418)):
            with self.assertRaises(httpc.CallError) as cm:
                self.call("GET", path)
            self.assertEqual(cm.exception.status, status)
            self.assertIsInstance(cm.exception.reply["error"], str)
            self.assertNotIn("\n", cm.exception.reply["error"])
        self.assertEqual(cm.exception.reply["hint"], "tip me over")
        with self.assertRaises(httpc.CallError) as cm:
            self.call("GET", "/echo")
        self.assertEqual(cm.exception.status, 405)
        self.assertEqual(self.call("GET", "/health"), {"ok": True})

    def test_bad_bodies(self):
        with self.assertRaises(httpc.CallError) as cm:
            self.call("POST", "/echo", {"x": "y" * 2000})
        self.assertEqual(cm.exception.status, 413)
        conn = httpc.connect(self.live.url)
        conn.request("POST", "/echo", body=b"{not json", headers={"Authorization": "Bearer s3cret"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 400)
        self.assertIn("malformed JSON", json.loads(resp.read())["error"])
        conn.close()

    def test_absurdly_nested_json_is_a_400_not_a_500(self):
        server = httpd.make_server(ROUTES, token="s3cret", max_body=1 << 20)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        deep = {"x": None}
        body = "[" * 200000 + "]" * 200000              # json.loads raises RecursionError here
        conn = httpc.connect(server.url)
        conn.request("POST", "/echo", body=body.encode(), headers={"Authorization": "Bearer s3cret"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 400)
        self.assertIn("malformed JSON", json.loads(resp.read())["error"])
        conn.close()
        self.assertEqual(httpc.call(server.url, "POST", "/echo", deep, token="s3cret"), {"got": deep})

    def test_keep_alive_and_wildcard_routes(self):
        # http.client opens a new connection by itself when the server closed the last one:
        # count the connections the server accepted, not the client's.
        accepted = []
        handler = self.live.server.RequestHandlerClass           # this server's own class
        setup = handler.setup

        def counting(h):
            setup(h)
            accepted.append(h.client_address)
        handler.setup = counting
        conn = httpc.connect(self.live.url)
        for i in range(20):
            reply = httpc.call(self.live.url, "PUT", f"/things/t{i}", {}, token="s3cret", conn=conn)
            self.assertEqual(reply, {"tail": f"t{i}"})
        with self.assertRaises(httpc.CallError):                   # an error reply keeps it open too
            httpc.call(self.live.url, "GET", "/teapot", token="s3cret", conn=conn)
        self.assertEqual(httpc.call(self.live.url, "GET", "/health", conn=conn), {"ok": True})
        conn.close()
        self.assertEqual(len(accepted), 1, accepted)

    def test_nodelay_is_set_on_server_sockets(self):
        seen = []
        orig = httpd.Handler.setup

        def spy(handler):
            orig(handler)
            seen.append(handler.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        httpd.Handler.setup = spy
        try:
            self.call("GET", "/health")
        finally:
            httpd.Handler.setup = orig
        self.assertEqual(seen, [1])


class TokenTest(unittest.TestCase):
    """load_token and the --token-file default every server and status command shares."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        saved = {k: os.environ.pop(k) for k in ("PWW_TOKEN", "PWW_TOKEN_FILE") if k in os.environ}
        self.addCleanup(os.environ.update, saved)
        for k in ("PWW_TOKEN", "PWW_TOKEN_FILE"):
            self.addCleanup(os.environ.pop, k, None)

    def file(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_a_file_gives_its_first_line(self):
        self.assertEqual(httpc.load_token(self.file("t", "  s3cret \nsecond line\n")), "s3cret")

    def test_an_empty_or_unreadable_file_stops_naming_it(self):
        for path, why in ((self.file("empty", ""), "is empty"), (self.file("blank", "\n  \n"), "is empty"),
                          (os.path.join(self.dir, "absent"), "cannot read token file"),
                          (self.dir, "cannot read token file")):          # a directory: unreadable as a file
            with self.subTest(path=path), self.assertRaises(SystemExit) as cm:
                httpc.load_token(path)
            self.assertIn(path, str(cm.exception))
            self.assertIn(why, str(cm.exception))
            self.assertNotIn("\n", str(cm.exception))

    def test_token_file_then_environment_file_then_environment_token(self):
        flag, env_file = self.file("flag", "from-flag\n"), self.file("env", "from-env-file\n")
        os.environ.update(PWW_TOKEN="from-env", PWW_TOKEN_FILE=env_file)

        def token(*argv):             # what a server gets: its parser reads $PWW_TOKEN_FILE when built
            parser = argparse.ArgumentParser()
            httpd.add_server_args(parser, 1)
            return httpc.load_token(parser.parse_args(list(argv)).token_file)
        self.assertEqual(token("--token-file", flag), "from-flag")
        self.assertEqual(token(), "from-env-file")
        del os.environ["PWW_TOKEN_FILE"]
        self.assertEqual(token(), "from-env")
        del os.environ["PWW_TOKEN"]
        self.assertIsNone(token())
        os.environ["PWW_TOKEN"] = ""
        self.assertIsNone(token(), "an empty $PWW_TOKEN is no token, not the empty string")

    def test_a_server_process_takes_the_flag_over_the_environment(self):
        flag = self.file("flag", "from-flag\n")
        env = {**os.environ, "PWW_TOKEN": "from-env", "PWW_TOKEN_FILE": self.file("env", "from-env-file\n")}
        proc = subprocess.Popen([sys.executable, "darl_server.py", "--num-samples", "10", "--state-dir", self.dir,
                                 "--port", "0", "--token-file", flag], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.addCleanup(lambda: proc.poll() is None and (proc.kill(), proc.wait(30)))
        url, _ = listening_url(proc, timeout=120)
        self.assertIn("num_blocks", httpc.call(url, "GET", "/status", token="from-flag"))
        for wrong in ("from-env-file", "from-env", None):
            with self.assertRaises(httpc.CallError) as cm:
                httpc.call(url, "GET", "/status", token=wrong)
            self.assertEqual(cm.exception.status, 401, wrong)


class BindPolicyTest(unittest.TestCase):
    def test_refuses_public_bind_without_token_or_tls(self):
        for kw, names in (({}, ("--token-file", "--tls-cert")), ({"token": "t"}, ("--tls-cert",)),
                          ({"tls": object()}, ("--token-file",))):
            with self.assertRaises(SystemExit) as cm:
                httpd.make_server(ROUTES, host="0.0.0.0", **kw)
            for name in names:
                self.assertIn(name, str(cm.exception))
            self.assertIn("--insecure", str(cm.exception))

    def test_public_bind_allowed_with_insecure(self):
        s = httpd.make_server(ROUTES, host="0.0.0.0", insecure=True)
        s.server_close()

    def test_loopback_detection(self):
        self.assertTrue(httpd.is_loopback("127.0.0.1"))
        self.assertTrue(httpd.is_loopback("::1"))
        self.assertTrue(httpd.is_loopback("localhost"))
        self.assertFalse(httpd.is_loopback("0.0.0.0"))
        self.assertFalse(httpd.is_loopback("10.0.0.1"))


if __name__ == "__main__":
    unittest.main()
