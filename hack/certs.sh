#!/usr/bin/env bash
# Development certificates for the mTLS link between Envoy and pd-extproc (`make certs`): a CA,
# pd-extproc's server certificate and Envoy's client certificate, each written as the keys of a
# kubernetes.io/tls Secret (tls.crt, tls.key, ca.crt), the layout cert-manager produces:
#
#   DIR/extproc/{tls.crt,tls.key,ca.crt}   pd-extproc: --tls-cert-file, --tls-key-file, --tls-client-ca-file
#   DIR/envoy/{tls.crt,tls.key,ca.crt}     Envoy: the ext_proc cluster's transport_socket
#
# The names are the ones every shipped config checks: pd-extproc's certificate carries
# DNS:pd-extproc.pd-extproc.svc (Envoy's SAN matcher, the BackendTLSPolicy's hostname), Envoy's
# carries DNS:envoy.pd-extproc (pd-extproc's --tls-client-allowed-sans). The CA's key is deleted
# once both are signed: run the script again for a new set. Keys are left readable by every user
# (0644) because the containers of the compose demo run as their own users; these certificates
# are for development only. For a cluster, see the README ("Secure by default").
#
# Usage: hack/certs.sh [DIR]   (DIR defaults to config/envoy/certs; needs OpenSSL 1.1.1 or later)
# SERVER_SANS, CLIENT_SANS and DAYS override the defaults below.
set -euo pipefail

dir=${1:-config/envoy/certs}
days=${DAYS:-365}
server_sans=${SERVER_SANS:-DNS:pd-extproc.pd-extproc.svc,DNS:pd-extproc.pd-extproc.svc.cluster.local,DNS:pd-extproc-headless.pd-extproc.svc}
client_sans=${CLIENT_SANS:-DNS:envoy.pd-extproc}

mkdir -p "$dir/extproc" "$dir/envoy"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -keyout "$work/ca.key" -out "$work/ca.crt" -subj "/CN=pd-extproc development CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# issue NAME COMMON_NAME SANS EXTENDED_KEY_USAGE
issue() {
  local out="$dir/$1"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$out/tls.key" -out "$work/$1.csr" -subj "/CN=$2" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\nsubjectAltName=%s\n' "$4" "$3" >"$work/$1.ext"
  openssl x509 -req -in "$work/$1.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -extfile "$work/$1.ext" -out "$out/tls.crt" 2>/dev/null
  cp "$work/ca.crt" "$out/ca.crt"
  chmod 0644 "$out/tls.key" "$out/tls.crt" "$out/ca.crt"
}
issue extproc pd-extproc "$server_sans" serverAuth
issue envoy envoy "$client_sans" clientAuth
echo "wrote $dir/extproc and $dir/envoy (CA: $(openssl x509 -in "$work/ca.crt" -noout -subject))"
