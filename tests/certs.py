"""tests/certs.py - a throwaway CA and a server certificate for 127.0.0.1, made with openssl
(as central.sh makes them on the central VM). Used by the TLS tests."""
import os
import subprocess


def make_tls(directory, cn="127.0.0.1"):
    """-> (ca.pem, server.pem, server.key) in `directory`; the certificate names
    localhost and 127.0.0.1."""
    ca, ca_key = os.path.join(directory, "ca.pem"), os.path.join(directory, "ca.key")
    cert, key, csr = (os.path.join(directory, n) for n in ("server.pem", "server.key", "server.csr"))
    ext = os.path.join(directory, "server.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["openssl", "req", "-x509", *ec, "-days", "2", "-subj", "/CN=test CA", "-keyout", ca_key,
                 "-out", ca, "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                ["openssl", "req", *ec, "-subj", f"/CN={cn}", "-keyout", key, "-out", csr],
                ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                 "-days", "2", "-out", cert, "-extfile", ext]):
        subprocess.run(cmd, check=True, capture_output=True)
    return ca, cert, key
