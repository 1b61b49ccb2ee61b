"""The one retry policy (httpc.py): a call's worst case is its one Deadline, whatever the
layers under it. Real servers on 127.0.0.1 that answer 503 forever (or refuse): each
call gives up once its deadline has passed, with one GaveUp naming the call, and the
server received exactly one request per attempt of the ONE loop (fedsite -> fedmom_client
-> blob_client, and darl_client, add none of their own); a refusal is never repeated."""
import collections
import os
import tempfile
import threading
import time
import types
import unittest

import darl_client
import fedmom_client
import fedsite
import httpc
import httpd

D = 1.5           # the deadline of every call below, s
SLACK_S = 15.0    # how far past D a call may end: a last attempt and a loaded machine, far below any
                  # second layer's deadline (the site's used to be 900 s on top of the clients' own)


class Server:
    """httpd on 127.0.0.1: answer(method, path) -> (status, reply) for every request, each
    counted by (method, route) in self.got."""

    def __init__(self, answer):
        self.got, self.lock = collections.Counter(), threading.Lock()

        def route(req):
            with self.lock:
                self.got[(req.method, req.path)] += 1
            status, reply = answer(req.method, req.path)
            if status >= 400:
                raise httpd.HTTPError(status, reply.get("error", "no"), **{k: v for k, v in reply.items()
                                                                          if k != "error"})
            return status, reply
        routes = {(m, "/*"): route for m in ("GET", "HEAD", "POST", "PUT")}
        self.server = httpd.make_server(routes)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = self.server.url

    def total(self):
        with self.lock:
            return sum(self.got.values())

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def unavailable(method, path):
    return 503, {"error": "restarting"}


class RetryTest(unittest.TestCase):
    def serve(self, answer=unavailable):
        s = Server(answer)
        self.addCleanup(s.close)
        return s

    def gives_up(self, fn, what):
        """fn(deadline) must raise GaveUp once D passed -> (the GaveUp, its deadline)."""
        d = httpc.Deadline(D, what=what, log=httpc.quiet)
        t0 = time.monotonic()
        with self.assertRaises(httpc.GaveUp) as cm:
            fn(d)
        took = time.monotonic() - t0
        self.assertGreaterEqual(took, D)
        self.assertLess(took, D + SLACK_S, "the call went on past its one deadline")
        e = cm.exception
        self.assertEqual(e.attempts, d.attempts)
        self.assertGreater(e.attempts, 1, "repeated under the deadline")
        self.assertIn(f"{what}: gave up after {D:g} s without progress and {e.attempts} attempt(s)", str(e))
        self.assertIn("HTTP 503", str(e))
        return e

    def test_a_call_answered_503_forever_gives_up_by_its_deadline(self):
        s = self.serve()
        e = self.gives_up(lambda d: httpc.retry("GET /status", lambda: httpc.call(s.url, "GET", "/status"), d),
                          "GET /status")
        self.assertEqual(s.total(), e.attempts)
        self.assertIsInstance(e, TimeoutError)
        self.assertEqual((e.last.status, e.seconds), (503, D))

    def test_a_lease_call_is_one_loop(self):
        s = self.serve()
        client = darl_client.LeaseClient(s.url)
        self.addCleanup(client.close)
        e = self.gives_up(lambda d: client.status(deadline=d), "DARL status")
        self.assertEqual(s.got, {("GET", "/status"): e.attempts})

    def test_a_delta_through_the_blob_store_is_one_loop_under_one_deadline(self):
        """send_delta's attempt is whole: its check, then the upload (HEAD, PUT from the offset
        held), then the naming of the blob. The blob store answers 503 forever: as many checks
        as HEADs, one of each per attempt, and one followed POST /delta_blob for the whole send
        (beside its first upload); nothing under send_delta repeats on its own."""
        def answer(method, path):
            return (200, {"ok": True, "round": 0}) if path == "/delta_check" else unavailable(method, path)
        s = self.serve(answer)
        c = fedmom_client.FedMomClient(s.url, "lumi", "inc", blob_url=s.url)
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"\0" * 4096)
            f.flush()
            e = self.gives_up(lambda d: c.send_delta(f.name, 0, 10, [], {}, transport="blob", deadline=d),
                              "send delta")
        heads = [n for (m, p), n in s.got.items() if m == "HEAD"]
        self.assertEqual(s.got[("POST", "/delta_check")], e.attempts)
        self.assertEqual(heads, [e.attempts], "one blob name for every attempt, one HEAD per attempt")
        self.assertEqual(s.got[("POST", "/delta_blob")], 1)
        self.assertEqual(s.total(), 2 * e.attempts + 1)

    def test_the_site_adds_no_layer_of_its_own(self):
        """FedSite makes the one Deadline (retry_s) and hands it down: theta's download gives up
        after retry_s, one GET /theta per attempt, and the site says so at most every 10 s."""
        s = self.serve()
        cfg = types.SimpleNamespace(cluster="lumi", token_file=None, darl_url=s.url, ca_file=None,
                                    federation=s.url, blob_url=None, transport="inline")
        said = []
        site = fedsite.FedSite(cfg, None, 0, said.append, retry_s=D)
        self.addCleanup(site.darl.close)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            gen = site.fetch_theta(os.path.join(tmp, "theta.safetensors"))
            with self.assertRaises(httpc.GaveUp) as cm:
                for _ in gen:
                    pass
            self.assertEqual(os.listdir(tmp), [])
        self.assertLess(time.monotonic() - t0, D + SLACK_S)
        e = cm.exception
        self.assertEqual(s.got, {("GET", "/theta"): e.attempts})
        self.assertIn("download theta_global: gave up after", str(e))
        self.assertEqual(len(said), 1, said)
        self.assertIn("download theta_global: HTTP 503: restarting; retrying", said[0])

    def test_a_refusal_is_never_repeated(self):
        s = self.serve(lambda method, path: (409, {"error": "stale delta", "code": "stale_round", "round": 3}))
        d = httpc.Deadline(60, log=httpc.quiet)
        c = fedmom_client.FedMomClient(s.url, "lumi", "inc")
        with tempfile.NamedTemporaryFile() as f:
            with self.assertRaises(fedmom_client.StaleRound):
                c.send_delta(f.name, 2, 10, [], {}, transport="inline", deadline=d)
        self.assertEqual((s.total(), d.attempts), (1, 1))

    def test_a_4xx_the_server_marks_retry_is_repeated(self):
        """The blob store's busy id (409, "retry": true) is the one kind of 4xx repeated."""
        left = [2]

        def answer(method, path):
            if left[0]:
                left[0] -= 1
                return 409, {"error": "being uploaded by another request", "retry": True}
            return 200, {"ok": True}
        s = self.serve(answer)
        d = httpc.Deadline(60, log=httpc.quiet)
        self.assertEqual(httpc.retry("GET /x", lambda: httpc.call(s.url, "GET", "/x"), d), {"ok": True})
        self.assertEqual((s.total(), d.attempts), (3, 3))

    def test_a_lease_client_reopens_a_connection_the_server_closed(self):
        """A reply that closes the keep-alive connection leaves the client's connection without
        a socket; the next call (with its deadline's timeout) opens a new one."""
        def close_after(req):
            req.handler.close_connection = True
            return {"ok": True}
        server = httpd.make_server({("GET", "/status"): close_after})
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        client = darl_client.LeaseClient(server.url)
        self.addCleanup(client.close)
        for d in (None, httpc.Deadline(60, log=httpc.quiet), None):
            self.assertEqual(client.status(deadline=d), {"ok": True})

    def test_without_a_deadline_a_call_is_one_attempt(self):
        s = self.serve()
        client = darl_client.LeaseClient(s.url)
        self.addCleanup(client.close)
        with self.assertRaises(httpc.CallError) as cm:
            client.status()
        self.assertEqual((cm.exception.status, s.total()), (503, 1))


if __name__ == "__main__":
    unittest.main()
