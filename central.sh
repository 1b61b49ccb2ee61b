#!/usr/bin/env bash
# central.sh - start, stop and watch the three central daemons on the central VM.
#
#   ./central.sh start  [--state-dir DIR]   # start DARL :29510, FedMom :29511, blob store :29512,
#                                           # and the front: all three on one HTTPS port (443)
#   ./central.sh status [--state-dir DIR]   # pid, /health and each server's own status report
#   ./central.sh url    [--state-dir DIR]   # the lines to give the sites (their central.env),
#                                           # and the two files they copy (token, CA)
#   ./central.sh stop   [--state-dir DIR]   # SIGTERM (then SIGKILL after 30 s) each daemon
#   ./central.sh audit  [--state-dir DIR] [--partial] [--blocks]   # audit.py: every block in one merged delta?
#   ./central.sh site add lumi [--clusters lumi,lumi-b] | rotate lumi [--grace-s S] | revoke lumi
#                | read NAME | shared off|on | list    # per-site credentials (httpd.py site --help);
#                                           # a change reaches all three daemons within 1 s, no restart
#
# status exits 1 when a daemon is down or a server's status says something is wrong
# (a violation counter above 0, quarantined blocks); audit exits 1 unless PASS.
#
# Runs on: the central VM (no GPU, bare Python 3 + numpy; .venv/bin/python when present,
# else python3; override with PYTHON). Nothing else is installed: copy this script and
#   httpd.py httpc.py testhooks.py durable.py tensorio.py wire.py blobstore.py blob_client.py
#   block_space.py darl_table.py darl_server.py fedmom_round.py fedmom_merge.py outer_state.py
#   fedmom_state.py fedmom_server.py audit.py status_page.py   (18 files)
# into one directory (start refuses, naming them, if any is missing).
# State (default runs/central, or --state-dir / PWW_CENTRAL_STATE):
#   token          the shared bearer token, made on first start (mode 600): copy it to
#                  each site and point PWW_TOKEN_FILE at the copy
#   credentials.json  the per-site credentials (hashes only; `site` changes it, every daemon
#                  re-reads it); sites/<site>.token the credential to copy to that site (mode 600)
#   aggregator.token  the aggregator's and operator's own credential for DARL's custody
#                  endpoints (fence, custody, commit, abort, abort-custody), made with the
#                  token (mode 600), and FedMom's at the blob store; it never leaves this VM,
#                  so a site cannot fence FedMom or abort its custody
#   tls/           ca.pem + ca.key (a CA made on first start with openssl) and server.pem +
#                  server.key, the certificate every daemon serves https with; copy ca.pem to
#                  each site and point PWW_CA_FILE at the copy. Its names: localhost,
#                  127.0.0.1 and the public host (re-issued from the same CA when that changes).
#                  TLS_CERT=FILE TLS_KEY=FILE [TLS_CA_FILE=FILE] serve a certificate of your own
#                  instead; FedMom then reaches DARL and the blob store by the public host.
#   <name>.pid     one per daemon (darl, fedmom, blob); <name>.log their output
#   darl/ fedmom/ blobs/   each server's durable state (survives kill -9 and restart)
# First start needs the corpus size for DARL and the initial model for FedMom:
#   MANIFEST=/tmp/manifest.json INIT=runs/init/qwen3_0.6B.safetensors ./central.sh start
#   NUM_SAMPLES=1000000 BLOCK_SIZE=10000 INIT=... ./central.sh start
# Later starts (restarts) resume from the state dir and need neither.
# Network: binds PWW_CENTRAL_HOST (default 127.0.0.1; 0.0.0.0 to serve the sites, always
# with the token and TLS); ports DARL_PORT / FEDMOM_PORT / BLOB_PORT; PWW_PUBLIC_HOST is the
# address printed for the sites and named in the certificate (default: this host's FQDN
# when bound beyond loopback).
# Extra flags per daemon: DARL_ARGS, FEDMOM_ARGS, BLOB_ARGS (word-split).
# The front: a site's compute nodes reach this VM only through the site's HTTP proxy, whose
# stock rules CONNECT to port 443 only. So start also runs Debian's nginx (apt-get install
# nginx) as a process of this user, on PWW_PUBLIC_PORT (default 443: root, or
# `setcap cap_net_bind_service=+ep` on nginx), routing https://HOST/darl, /fedmom and /blob
# (prefix stripped) to the three daemons over TLS on loopback; the direct ports keep
# working. Its config, pid, logs (access.log names each client) and temp dirs: $STATE/front/.
# Without nginx (or PWW_FRONT=off) the direct ports only, said in one line.
#
# Variables `start` reads (all optional once the state dir exists):
#   MANIFEST             first start: the corpus manifest.json DARL leases (its training windows)
#   NUM_SAMPLES          first start, instead of MANIFEST: the number of samples
#   BLOCK_SIZE, SEED     first start: samples per DARL block (default 1), permutation seed (default 0)
#   INIT                 first start: FedMom's initial model (.safetensors, train.py --export-init)
#   PWW_CENTRAL_STATE    the state dir (default runs/central beside this script; --state-dir wins)
#   PWW_CENTRAL_HOST     bind address (default 127.0.0.1)
#   DARL_PORT FEDMOM_PORT BLOB_PORT   ports (default 29510 29511 29512)
#   DARL_ARGS FEDMOM_ARGS BLOB_ARGS   extra flags per daemon
#   PWW_START_TIMEOUT_S  seconds each daemon has to answer /health (default 60)
#   PWW_PUBLIC_HOST      the address `url` prints for the sites
#   PWW_PUBLIC_PORT      the front's one HTTPS port (default 443)
#   PWW_FRONT            auto (default: the front when nginx is installed), on (fail without
#                        it), off (the direct ports only)
#   NGINX                the nginx binary (default: nginx on PATH, else /usr/sbin/nginx)
#   PWW_SITE_TOKEN_FILE  where `url` tells the sites to keep the token (default $HOME/.pww/central.token)
#   PWW_SITE_CA_FILE     where `url` tells the sites to keep the CA (default $HOME/.pww/central-ca.pem)
#   PYTHON               the interpreter (default .venv/bin/python, else python3)
# ./central.sh --help prints this and creates nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
case "$1" in
    -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
CMD=$1; shift
STATE=${PWW_CENTRAL_STATE:-$ROOT/runs/central}
AUDIT_ARGS=()
SITE_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --state-dir) [ $# -ge 2 ] || usage; STATE=$2; shift 2 ;;
        --state-dir=*) STATE=${1#*=}; shift ;;
        --partial|--blocks) [ "$CMD" = audit ] || usage; AUDIT_ARGS+=("$1"); shift ;;
        *) if [ "$CMD" = site ]; then SITE_ARGS+=("$1"); shift; continue; fi
           echo "central.sh: unknown argument '$1'" >&2; usage ;;
    esac
done
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
HOST=${PWW_CENTRAL_HOST:-127.0.0.1}
DARL_PORT=${DARL_PORT:-29510}
FEDMOM_PORT=${FEDMOM_PORT:-29511}
BLOB_PORT=${BLOB_PORT:-29512}
TOKEN=$STATE/token
AGG_TOKEN=$STATE/aggregator.token
CREDS=$STATE/credentials.json
TLS_DIR=$STATE/tls
if [ -n "${TLS_CERT:-}" ] || [ -n "${TLS_KEY:-}" ]; then
    : "${TLS_CERT:?TLS_KEY is set: set TLS_CERT too}" "${TLS_KEY:?TLS_CERT is set: set TLS_KEY too}"
    CERT=$TLS_CERT KEY=$TLS_KEY CA=${TLS_CA_FILE:-}
else
    CERT=$TLS_DIR/server.pem KEY=$TLS_DIR/server.key CA=$TLS_DIR/ca.pem
fi
DAEMONS="darl fedmom blob"
FRONT_DIR=$STATE/front
PUBLIC_PORT=${PWW_PUBLIC_PORT:-443}
FRONT_MODE=${PWW_FRONT:-auto}
case "$FRONT_MODE" in auto|on|off) ;; *) echo "central.sh: PWW_FRONT=$FRONT_MODE: use auto, on or off" >&2; exit 2 ;; esac
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
CENTRAL_FILES="httpd.py httpc.py testhooks.py durable.py tensorio.py wire.py blobstore.py blob_client.py block_space.py darl_table.py darl_server.py fedmom_round.py fedmom_merge.py outer_state.py fedmom_state.py fedmom_server.py audit.py status_page.py"

script_of() { case "$1" in darl) echo darl_server.py ;; fedmom) echo fedmom_server.py ;; blob) echo blobstore.py ;;
                          front) echo "$FRONT_DIR/nginx.conf" ;; esac; }
port_of() { case "$1" in darl) echo "$DARL_PORT" ;; fedmom) echo "$FEDMOM_PORT" ;; blob) echo "$BLOB_PORT" ;; esac; }
# loop_host: where this VM reaches its own daemons and front (they bind PWW_CENTRAL_HOST)
loop_host() { case "$HOST" in 0.0.0.0|::|127.*|localhost) echo 127.0.0.1 ;; *:*) echo "[$HOST]" ;; *) echo "$HOST" ;; esac; }
local_url() { echo "https://$(loop_host):$(port_of "$1")"; }
public_host() {
    local host=${PWW_PUBLIC_HOST:-}
    if [ -z "$host" ]; then
        case "$HOST" in 127.*|localhost) host=$HOST ;; 0.0.0.0|::) host=$(hostname -f) ;; *) host=$HOST ;; esac
    fi
    echo "$host"
}
public_url() { echo "https://$(public_host):$(port_of "$1")"; }
# front_url NAME: the daemon's route on the front (its port recorded by start in front/port)
front_url() {
    local port hostport
    port=$(cat "$FRONT_DIR/port")
    hostport=$(public_host)
    [[ "$hostport" == *:* ]] && hostport="[$hostport]"      # an IPv6 address in a URL
    [ "$port" = 443 ] || hostport+=":$port"
    echo "https://$hostport/$1"
}
# site_url NAME: what the sites are given: the front's route when start ran it, else the port
site_url() { if [ -s "$FRONT_DIR/port" ]; then front_url "$1"; else public_url "$1"; fi; }
# internal_url NAME: how FedMom reaches DARL and the blob store (our certificate names
# 127.0.0.1; one of your own likely names only the public host)
internal_url() { if [ -n "${TLS_CERT:-}" ]; then public_url "$1"; else local_url "$1"; fi; }

pidfile_of() { if [ "$1" = front ]; then echo "$FRONT_DIR/nginx.pid"; else echo "$STATE/$1.pid"; fi; }
# pid_of NAME: the daemon's pid if its pid file names a live process running its script.
pid_of() {
    local f pid
    f=$(pidfile_of "$1")
    [ -s "$f" ] || return 0
    pid=$(tr -dc '0-9' < "$f")
    [ -n "$pid" ] && alive "$pid" || return 0
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$(script_of "$1")" && echo "$pid"
    return 0
}

# health NAME [TIMEOUT_S [PID]]: wait until GET /health answers 200 (python: no curl
# needed); gives up at once if PID exits. A liveness probe of our own daemon on
# loopback, so the certificate is not checked here (the sites check it).
health() { health_at "$(local_url "$1")" "${2:-0}" "${3:-}"; }
health_at() {
    "$PYTHON" - "$1" "${2:-0}" "${3:-}" <<'PY'
import os, ssl, sys, time, urllib.request
url, timeout, pid = sys.argv[1] + "/health", float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + timeout
ctx = ssl._create_unverified_context()
while True:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
            print(r.read().decode().strip()); sys.exit(0)
    except OSError as e:
        if pid and not os.path.exists(f"/proc/{pid}"):
            print(f"process {pid} exited"); sys.exit(1)
        if time.monotonic() >= deadline:
            print(f"no answer from {url}: {e}"); sys.exit(1)
        time.sleep(0.1)
PY
}

ensure_token() {
    if [ ! -s "$AGG_TOKEN" ]; then
        (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$AGG_TOKEN")
        echo "created the aggregator's token $AGG_TOKEN (mode 600): it stays on this VM"
    fi
    [ -s "$TOKEN" ] && return 0
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$TOKEN")
    echo "created token $TOKEN (mode 600): copy it to each site"
}

# san_list: the names the server certificate must carry, for openssl's subjectAltName.
san_list() {
    local host san="DNS:localhost,IP:127.0.0.1"
    for host in "$(public_host)" "$HOST"; do
        case "$host" in
            ""|localhost|127.0.0.1|0.0.0.0|::) ;;
            *[!0-9.]*) [[ "$host" == *:* ]] && san+=",IP:$host" || san+=",DNS:$host" ;;
            *) san+=",IP:$host" ;;
        esac
    done
    echo "$san"
}

# ensure_tls: on first start a CA (10 years) and a server certificate it signs (2 years),
# EC P-256 keys, mode 600; the server certificate again (same CA, so the sites' copies of
# ca.pem stay valid) when it no longer names the public host. Skipped for TLS_CERT/TLS_KEY.
ensure_tls() {
    [ -n "${TLS_CERT:-}" ] && return 0
    local san want have name
    san=$(san_list)
    mkdir -p "$TLS_DIR" && chmod 700 "$TLS_DIR"
    if [ ! -s "$TLS_DIR/ca.pem" ] || [ ! -s "$TLS_DIR/ca.key" ]; then
        (umask 077 && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -days 3650 -subj "/CN=pww central CA $(hostname -s)" -keyout "$TLS_DIR/ca.key" \
            -out "$TLS_DIR/ca.pem" -addext "basicConstraints=critical,CA:TRUE" \
            -addext "keyUsage=critical,keyCertSign,cRLSign" 2> "$TLS_DIR/openssl.log") || {
            echo "central.sh: openssl could not make the CA (see $TLS_DIR/openssl.log)" >&2; return 1; }
        rm -f "$TLS_DIR/server.pem"
        echo "created CA $TLS_DIR/ca.pem: copy it to each site (PWW_CA_FILE)"
    fi
    if [ -s "$TLS_DIR/server.pem" ]; then
        have=$(openssl x509 -in "$TLS_DIR/server.pem" -noout -ext subjectAltName 2>/dev/null | tail -n +2 | tr -d ' ')
        want=${san//IP:/IPAddress:}
        for name in ${want//,/ }; do
            [[ ",$have," == *",$name,"* ]] || { echo "server certificate lacks $name: issuing a new one (same CA)"; rm -f "$TLS_DIR/server.pem"; break; }
        done
    fi
    [ -s "$TLS_DIR/server.pem" ] && return 0
    (umask 077 && openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -subj "/CN=$(public_host)" -keyout "$TLS_DIR/server.key" -out "$TLS_DIR/server.csr" \
        2>> "$TLS_DIR/openssl.log" &&
     openssl x509 -req -in "$TLS_DIR/server.csr" -CA "$TLS_DIR/ca.pem" -CAkey "$TLS_DIR/ca.key" \
        -CAcreateserial -days 730 -out "$TLS_DIR/server.pem" -extfile <(printf '%s\n' \
        "subjectAltName=$san" "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
        "extendedKeyUsage=serverAuth" "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid,issuer") \
        2>> "$TLS_DIR/openssl.log") || {
        echo "central.sh: openssl could not make the server certificate (see $TLS_DIR/openssl.log)" >&2; return 1; }
    rm -f "$TLS_DIR/server.csr"
    echo "created server certificate $TLS_DIR/server.pem for $san"
}

# darl_space: the block-space flags. The first start takes them from MANIFEST (copied into
# the state dir, so a restart does not depend on /tmp) or NUM_SAMPLES, plus BLOCK_SIZE and
# SEED, and records them in $STATE/darl.space; restarts replay that record, because the
# space (and so its digest) must never change under a running corpus.
darl_space() {
    local record=$STATE/darl.space
    if [ -n "${MANIFEST:-}" ] || [ -n "${NUM_SAMPLES:-}" ]; then
        SPACE=()
        if [ -n "${MANIFEST:-}" ]; then
            if [ -s "$STATE/manifest.json" ] && ! cmp -s "$MANIFEST" "$STATE/manifest.json"; then
                echo "central.sh: $MANIFEST differs from the corpus this state dir serves ($STATE/manifest.json); use a new --state-dir for a new corpus" >&2
                return 1
            fi
            cp "$MANIFEST" "$STATE/manifest.json"
            SPACE+=(--manifest "$STATE/manifest.json")
        else
            SPACE+=(--num-samples "$NUM_SAMPLES")
        fi
        SPACE+=(--block-size "${BLOCK_SIZE:-1}" --seed "${SEED:-0}")
        if [ -s "$record" ] && [ "$(printf '%s\n' "${SPACE[@]}")" != "$(cat "$record")" ]; then
            echo "central.sh: the block space is already fixed in $record ($(tr '\n' ' ' < "$record")); use a new --state-dir for a new corpus" >&2
            return 1
        fi
        printf '%s\n' "${SPACE[@]}" > "$record"
    elif [ -s "$record" ]; then
        mapfile -t SPACE < "$record"
    else
        echo "central.sh: first start of DARL needs MANIFEST=<prep/tokenize.sh's manifest.json> or NUM_SAMPLES=<windows>" >&2
        return 1
    fi
}

daemon_args() {
    local name=$1 extra
    ARGS=("$ROOT/$(script_of "$name")" --host "$HOST" --port "$(port_of "$name")" --token-file "$TOKEN"
          --credentials "$CREDS" --tls-cert "$CERT" --tls-key "$KEY")
    case "$name" in
        darl)
            ARGS+=(--state-dir "$STATE" --aggregator-token-file "$AGG_TOKEN")   # -> $STATE/darl/
            darl_space || return 1
            ARGS+=("${SPACE[@]}")
            extra=${DARL_ARGS:-} ;;
        fedmom)
            ARGS+=(--state-dir "$STATE/fedmom")
            if [ -n "${INIT:-}" ]; then ARGS+=(--init "$INIT")
            elif [ ! -d "$STATE/fedmom" ]; then
                echo "central.sh: first start of FedMom needs INIT=<initial model .safetensors> (see RUNBOOK.md)" >&2
                return 1
            fi
            # FedMom takes accepted deltas' leases into custody at DARL (and commits them) and
            # serves big models via the blob store
            ARGS+=(--darl "$(internal_url darl)" --darl-token-file "$AGG_TOKEN" --blob-url "$(internal_url blob)"
                   --blob-token-file "$AGG_TOKEN")
            [ -n "$CA" ] && ARGS+=(--ca-file "$CA")
            extra=${FEDMOM_ARGS:-} ;;
        blob)
            ARGS+=(--root "$STATE" --aggregator-token-file "$AGG_TOKEN")   # -> $STATE/blobs/
            extra=${BLOB_ARGS:-} ;;
    esac
    local words
    read -r -a words <<< "$extra"
    ARGS+=("${words[@]}")
}

start_one() {
    local name=$1 pid log=$STATE/$1.log
    pid=$(pid_of "$name")
    if [ -n "$pid" ]; then echo "$name already running (pid $pid)"; return 0; fi
    daemon_args "$name" || return 1
    echo "$(date -Is) starting: $PYTHON ${ARGS[*]}" >> "$log"
    nohup "$PYTHON" "${ARGS[@]}" >> "$log" 2>&1 < /dev/null &
    pid=$!
    echo "$pid" > "$STATE/$name.pid"
    if ! health "$name" "${PWW_START_TIMEOUT_S:-60}" "$pid" > /dev/null; then
        echo "central.sh: $name did not become healthy; last lines of $log:" >&2
        tail -n 15 "$log" >&2
        return 1
    fi
    STARTED+=("$name")
    echo "$name started (pid $(pid_of "$name")), $(public_url "$name"), log $log"
}

# check_files: every module the daemons import sits beside this script (a partial copy
# onto the VM would otherwise fail later, one ImportError at a time, in a daemon's log).
check_files() {
    local f missing=()
    for f in $CENTRAL_FILES; do [ -f "$ROOT/$f" ] || missing+=("$f"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "central.sh: missing beside $0: ${missing[*]} (the central VM needs $CENTRAL_FILES)" >&2
    return 1
}

# alive PID: the process exists and is not a zombie (a container without an init that
# reaps orphans keeps exited daemons as zombies, which kill -0 still finds).
alive() {
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

stop_one() {
    local name=$1 pid kids k
    pid=$(pid_of "$name")
    if [ -z "$pid" ]; then echo "$name not running"; rm -f "$(pidfile_of "$name")"; return 0; fi
    kids=$(cat "/proc/$pid/task/$pid/children" 2>/dev/null || true)    # nginx's workers
    kill -TERM "$pid"
    for _ in $(seq 1 300); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
        echo "$name (pid $pid) ignored SIGTERM for 30 s; sending SIGKILL (state is durable)"
        kill -KILL "$pid"
    fi
    for k in $kids; do if alive "$k"; then kill -KILL "$k"; fi; done      # none outlives its master
    rm -f "$(pidfile_of "$name")"
    echo "$name stopped (pid $pid)"
}

status_one() {
    local name=$1 pid
    pid=$(pid_of "$name")
    if [ -z "$pid" ]; then echo "$name: NOT RUNNING (log $STATE/$name.log)"; return 1; fi
    echo "$name: pid $pid, $(local_url "$name") health: $(health "$name" 0)"
    local rc=0
    "$PYTHON" "$ROOT/$(script_of "$name")" status --url "$(internal_url "$name")" --token-file "$TOKEN" \
        ${CA:+--ca-file "$CA"} 2>&1 | sed 's/^/    /' || rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then echo "    !!! $name status exit $rc: see the lines above"; return 1; fi
}

# ---------------------------------------------------------------- the front (nginx)

# front_conf: nginx's config, rewritten by every start. Every size and timeout here is
# chosen so the front never decides what the daemons behind it would not (why, per line).
front_conf() {
    local listen=$HOST:$PUBLIC_PORT up trusted=$CA verify_name=localhost name
    up=$(loop_host)
    [[ "$HOST" == *:* ]] && listen="[$HOST]:$PUBLIC_PORT"
    if [ -n "${TLS_CERT:-}" ]; then
        verify_name=$(public_host)          # a certificate of your own names the public host only
        [ -n "$trusted" ] || trusted=/etc/ssl/certs/ca-certificates.crt
    fi
    echo "# written by central.sh start (each start rewrites it): the one HTTPS port for the sites"
    if [ "$(id -u)" = 0 ]; then echo "user nobody $(id -gn nobody 2>/dev/null || echo nogroup);   # workers never run as root"; fi
    cat <<EOF
worker_processes 2;
pid $FRONT_DIR/nginx.pid;
error_log $FRONT_DIR/error.log warn;
events { worker_connections 4096; }
http {
    log_format pww '\$remote_addr [\$time_iso8601] "\$request" \$status \$body_bytes_sent in=\$request_length '
                   '\${request_time}s up=\$upstream_addr';
    access_log $FRONT_DIR/access.log pww;
    client_body_temp_path $FRONT_DIR/tmp/body;
    proxy_temp_path $FRONT_DIR/tmp/proxy;
    fastcgi_temp_path $FRONT_DIR/tmp/fastcgi;
    uwsgi_temp_path $FRONT_DIR/tmp/uwsgi;
    scgi_temp_path $FRONT_DIR/tmp/scgi;
    default_type application/json;
    server_tokens off;
    absolute_redirect off;                 # /fedmom -> /fedmom/ whatever host and port the client used
    # the daemons take 64 KiB of headers (httpd.Limits); nginx's default 8 KiB line would
    # refuse a PUT /delta whose X-Delta-Meta lists many leases
    large_client_header_buffers 8 64k;
    client_max_body_size 0;                # the blob store enforces its own --max-blob-gb / quota
    client_body_buffer_size 1m;            # the unbuffered PUT's relay buffer
    # idle limits per read or write, not per transfer: above the longest wait a client
    # allows (POST /delta_blob: 3600 s while the aggregator fetches and merges)
    client_body_timeout 3700s;
    send_timeout 3700s;
    keepalive_timeout 75s;
    # each upstream keeps idle TLS connections (no handshake per call); closed after 50 s,
    # before the daemons' 60 s idle limit, so nginx never sends a request into a closing one
EOF
    for name in $DAEMONS; do
        printf '    upstream pww_%s { server %s:%s; keepalive 16; keepalive_timeout 50s; }\n' "$name" "$up" "$(port_of "$name")"
    done
    cat <<EOF
    server {
        listen $listen ssl;
        ssl_certificate $CERT;
        ssl_certificate_key $KEY;
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:pww_front:1m;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host \$host;
        proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
        proxy_set_header X-Real-IP \$remote_addr;
        proxy_set_header X-Forwarded-Proto https;
        # streams both ways, never spooled to disk: a 10 GB delta costs the front 1 MiB
        proxy_request_buffering off;
        proxy_buffering off;
        proxy_max_temp_file_size 0;
        proxy_buffer_size 256k;            # the relay buffer of a download (proxy_buffering off)
        proxy_buffers 4 256k;
        proxy_read_timeout 3700s;
        proxy_send_timeout 3700s;
        proxy_connect_timeout 10s;
        proxy_next_upstream off;           # never send a PUT or POST twice: the client's retry rule decides
        proxy_ssl_verify on;
        proxy_ssl_trusted_certificate $trusted;
        proxy_ssl_name $verify_name;
        proxy_ssl_session_reuse on;
        proxy_ssl_protocols TLSv1.2 TLSv1.3;
        error_page 502 503 504 @down;
        location @down {
            return 502 '{"error": "the front could not reach the service behind it (central.sh status on the central VM says why)"}\n';
        }
        location = /health { return 200 '{"ok": true, "service": "front", "routes": ["/darl", "/fedmom", "/blob"]}\n'; }
        location / { return 404 '{"error": "no such route on the front: the services are /darl/, /fedmom/ and /blob/"}\n'; }
EOF
    for name in $DAEMONS; do
        printf '        location /%s/ { proxy_pass https://pww_%s/; }\n' "$name" "$name"
    done
    echo "    }"
    echo "}"
}

# front_refusal: nginx's startup error as the one line that names the fix.
front_refusal() {
    local err=$1
    if grep -q "Permission denied" <<< "$err" && grep -q "bind()" <<< "$err"; then
        echo "central.sh: the front cannot bind port $PUBLIC_PORT: ports below 1024 need root or CAP_NET_BIND_SERVICE (sudo setcap cap_net_bind_service=+ep $NGINX), or choose another: PWW_PUBLIC_PORT=8443 ./central.sh start (PWW_FRONT=off: the direct ports only)"
    elif grep -q "Address already in use" <<< "$err"; then
        echo "central.sh: the front cannot bind $HOST:$PUBLIC_PORT: another process holds it (ss -ltnp 'sport = :$PUBLIC_PORT'); choose another: PWW_PUBLIC_PORT=8443 ./central.sh start"
    else
        echo "central.sh: nginx did not start the front: $(grep -m1 -E 'emerg|alert|crit' <<< "$err" || tail -n 1 <<< "$err") (config $FRONT_DIR/nginx.conf)"
    fi
}

# start_front: nginx up on PUBLIC_PORT (a running one re-reads the rewritten config), its
# port recorded in front/port for url and status; without nginx, one line saying how to get it.
start_front() {
    if [ "$FRONT_MODE" = off ]; then rm -f "$FRONT_DIR/port"; return 0; fi
    if [ ! -x "$NGINX" ]; then
        if [ "$FRONT_MODE" = on ]; then echo "central.sh: PWW_FRONT=on but there is no nginx ($NGINX): apt-get install nginx" >&2; return 1; fi
        rm -f "$FRONT_DIR/port"
        echo "no front: without nginx the sites need the direct ports $DARL_PORT $FEDMOM_PORT $BLOB_PORT, which a site proxy's stock rules refuse; for all three on one HTTPS port: apt-get install nginx, then central.sh start"
        return 0
    fi
    local pid err args
    mkdir -p "$FRONT_DIR/tmp"
    front_conf > "$FRONT_DIR/nginx.conf"
    args=(-p "$FRONT_DIR/" -c "$FRONT_DIR/nginx.conf" -e "$FRONT_DIR/error.log")
    pid=$(pid_of front)
    if [ -n "$pid" ]; then
        if ! err=$("$NGINX" "${args[@]}" -t 2>&1); then front_refusal "$err" >&2; return 1; fi
        kill -HUP "$pid"
        echo "$PUBLIC_PORT" > "$FRONT_DIR/port"
        echo "front already running (pid $pid): config re-read"
        return 0
    fi
    : > "$FRONT_DIR/error.log"
    if ! err=$("$NGINX" "${args[@]}" 2>&1); then
        front_refusal "$err"$'\n'"$(cat "$FRONT_DIR/error.log")" >&2
        return 1
    fi
    echo "$PUBLIC_PORT" > "$FRONT_DIR/port"
    STARTED+=(front)
}

front_local_url() { echo "https://$(loop_host):$(cat "$FRONT_DIR/port")/$1"; }

# check_front: each daemon's /health through the front (its TLS to the daemon checked).
check_front() {
    [ -s "$FRONT_DIR/port" ] || return 0
    local name out
    for name in $DAEMONS; do
        if ! out=$(health_at "$(front_local_url "$name")" 10); then
            echo "central.sh: the front does not reach $name: $out (see $FRONT_DIR/error.log)" >&2
            return 1
        fi
    done
    echo "front started (pid $(pid_of front)), $(front_url darl) /fedmom /blob on port $(cat "$FRONT_DIR/port"), log $FRONT_DIR/access.log"
}

status_front() {
    if [ ! -s "$FRONT_DIR/port" ]; then
        if [ -x "$NGINX" ]; then echo "front: not started (start runs it unless PWW_FRONT=off): the direct ports only"
        else echo "front: none, the direct ports only (for one HTTPS port: apt-get install nginx, then central.sh start)"; fi
        return 0
    fi
    local pid name line rc=0
    pid=$(pid_of front)
    if [ -z "$pid" ]; then echo "front: NOT RUNNING (port $(cat "$FRONT_DIR/port"), log $FRONT_DIR/error.log)"; return 1; fi
    line="front: pid $pid, https://$(loop_host):$(cat "$FRONT_DIR/port")"
    for name in $DAEMONS; do
        if health_at "$(front_local_url "$name")" 0 > /dev/null; then line+=" /$name ok"; else line+=" /$name FAILING"; rc=1; fi
    done
    echo "$line (access log $FRONT_DIR/access.log)"
    return $rc
}

print_urls() {
    local token_file=${PWW_SITE_TOKEN_FILE:-} ca_file=${PWW_SITE_CA_FILE:-} host dirs
    # $HOME stays literal: it is the site's, expanded at the site when central.env is sourced
    # shellcheck disable=SC2016
    [ -n "$token_file" ] || token_file='$HOME/.pww/central.token'
    # shellcheck disable=SC2016
    [ -n "$ca_file" ] || ca_file='$HOME/.pww/central-ca.pem'
    host=$(public_host)
    dirs=$(for f in "$token_file" ${CA:+"$ca_file"}; do [[ $f == */* ]] && echo "${f%/*}"; done | sort -u | tr '\n' ' ')
    echo "# central services: write these lines to central.env in each site's checkout"
    echo "# (jobs/*_titan.sh sources it; \$HOME is the site's, expanded there), after copying"
    echo "# the files below to the site (the token chmod 600):"
    echo "#   token file $TOKEN -> $token_file"
    echo "#   (each site its own instead: ./central.sh site add NAME, then copy $STATE/sites/NAME.token)"
    [ -n "$CA" ] && echo "#   CA file    $CA -> $ca_file"
    echo "# at the site, e.g.:"
    [ -z "$dirs" ] || echo "#   mkdir -p ${dirs% }"
    echo "#   scp $host:$TOKEN $token_file && chmod 600 $token_file"
    [ -n "$CA" ] && echo "#   scp $host:$CA $ca_file"
    if [ -s "$FRONT_DIR/port" ]; then
        echo "# the front: all three on one HTTPS port, which a site's proxy passes (open it to the sites);"
        echo "# with no proxy between, the direct ports work too: $(public_url darl) $(public_url fedmom) $(public_url blob)"
    fi
    echo "export PWW_DARL_URL=$(site_url darl)"
    echo "export PWW_FEDMOM_URL=$(site_url fedmom)"
    echo "export PWW_BLOB_URL=$(site_url blob)"
    echo "export PWW_TOKEN_FILE=$token_file"
    if [ -n "$CA" ]; then echo "export PWW_CA_FILE=$ca_file"; fi
}

case "$CMD" in
    start)
        check_files || exit 1
        ensure_token
        ensure_tls || exit 1
        STARTED=()
        # the front first: a port it cannot bind stops the start before any daemon runs;
        # then DARL and the blob store: FedMom commits into DARL and reads blobs.
        start_front || exit 1
        for name in darl blob fedmom check; do
            if ! { if [ $name = check ]; then check_front; else start_one "$name"; fi; }; then
                echo "central.sh: start failed; stopping what this call started" >&2
                for n in "${STARTED[@]}"; do stop_one "$n" > /dev/null; done
                [ $name = check ] || stop_one "$name" > /dev/null
                exit 1
            fi
        done
        print_urls ;;
    stop)
        for name in front fedmom darl blob; do stop_one "$name"; done ;;
    status)
        rc=0
        for name in $DAEMONS; do status_one "$name" || rc=1; done
        status_front || rc=1
        exit $rc ;;
    url) print_urls ;;
    audit) exec "$PYTHON" "$ROOT/audit.py" --state-dir "$STATE" "${AUDIT_ARGS[@]}" ;;
    site)
        # add, rotate and read write the credential to $STATE/sites/<name>.token (mode 600)
        case "${SITE_ARGS[0]:-}" in add|rotate|read) SITE_ARGS+=(--out "$STATE/sites") ;; esac
        exec "$PYTHON" "$ROOT/httpd.py" site --file "$CREDS" "${SITE_ARGS[@]}" ;;
    *) usage ;;
esac
