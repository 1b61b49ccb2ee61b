"""The shared HTTP plumbing, through a real socket on 127.0.0.1."""
import http.client
import json
import socket
import threading
import unittest

import httpd


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
        return httpd.call(self.live.url, method, path, body, token=token)

    def test_health_is_public_everything_else_needs_the_token(self):
        self.assertEqual(httpd.call(self.live.url, "GET", "/health"), {"ok": True})
        with self.assertRaises(httpd.CallError) as cm:
            self.call("POST", "/echo", {"a": 1}, token="wrong")
        self.assertEqual(cm.exception.status, 401)
        self.assertEqual(self.call("POST", "/echo", {"a": 1}), {"got": {"a": 1}})

    def test_errors_are_one_line_json_and_the_server_keeps_serving(self):
        for path, status in (("/nowhere", 404), ("/boom", 500), ("/teapot", 418)):
            with self.assertRaises(httpd.CallError) as cm:
                self.call("GET", path)
            self.assertEqual(cm.exception.status, status)
            self.assertIsInstance(cm.exception.reply["error"], str)
            self.assertNotIn("\n", cm.exception.reply["error"])
        self.assertEqual(cm.exception.reply["hint"], "tip me over")
        with self.assertRaises(httpd.CallError) as cm:
            self.call("GET", "/echo")
        self.assertEqual(cm.exception.status, 405)
        self.assertEqual(self.call("GET", "/health"), {"ok": True})

    def test_bad_bodies(self):
        with self.assertRaises(httpd.CallError) as cm:
            self.call("POST", "/echo", {"x": "y" * 2000})
        self.assertEqual(cm.exception.status, 413)
        conn = httpd.connect(self.live.url)
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
        conn = httpd.connect(server.url)
        conn.request("POST", "/echo", body=body.encode(), headers={"Authorization": "Bearer s3cret"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 400)
        self.assertIn("malformed JSON", json.loads(resp.read())["error"])
        conn.close()
        self.assertEqual(httpd.call(server.url, "POST", "/echo", deep, token="s3cret"), {"got": deep})

    def test_keep_alive_and_wildcard_routes(self):
        conn = httpd.connect(self.live.url)
        for i in range(20):
            reply = httpd.call(self.live.url, "PUT", f"/things/t{i}", {}, token="s3cret", conn=conn)
            self.assertEqual(reply, {"tail": f"t{i}"})
        conn.close()

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


class BindPolicyTest(unittest.TestCase):
    def test_refuses_public_bind_without_token(self):
        with self.assertRaises(SystemExit) as cm:
            httpd.make_server(ROUTES, host="0.0.0.0")
        self.assertIn("--token-file", str(cm.exception))

    def test_public_bind_allowed_with_token_or_insecure(self):
        for kw in ({"token": "t"}, {"insecure": True}):
            s = httpd.make_server(ROUTES, host="0.0.0.0", **kw)
            s.server_close()

    def test_loopback_detection(self):
        self.assertTrue(httpd.is_loopback("127.0.0.1"))
        self.assertTrue(httpd.is_loopback("::1"))
        self.assertTrue(httpd.is_loopback("localhost"))
        self.assertFalse(httpd.is_loopback("0.0.0.0"))
        self.assertFalse(httpd.is_loopback("10.0.0.1"))


if __name__ == "__main__":
    unittest.main()
