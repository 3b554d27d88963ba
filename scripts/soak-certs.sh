#!/usr/bin/env bash
# Makes a throwaway CA and a leaf certificate for 127.0.0.1/localhost signed by it, for a
# soak or a local test run with TLS: the leaf is CA:FALSE with serverAuth (rustls refuses a
# CA certificate used as a leaf), the CA is what initiators trust. Prints the environment to
# export. Usage: scripts/soak-certs.sh [DIR]   (default: a fresh folder under /tmp)
set -euo pipefail
dir=${1:-$(mktemp -d /tmp/kvbridge-soak-certs.XXXXXX)}
mkdir -p "$dir"
chmod 700 "$dir"
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj "/CN=kvbridge soak CA" -keyout ca.key -out ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -subj "/CN=localhost" -keyout leaf.key -out leaf.csr 2>/dev/null
cat > leaf.ext <<'EXT'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost
EXT
openssl x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
  -extfile leaf.ext -out leaf.pem 2>/dev/null
rm -f leaf.csr leaf.ext ca.srl
chmod 600 ca.key leaf.key
openssl verify -CAfile ca.pem leaf.pem >/dev/null
echo "export KVBRIDGE_TLS_CERT=$dir/leaf.pem KVBRIDGE_TLS_KEY=$dir/leaf.key KVBRIDGE_TLS_CA=$dir/ca.pem"
