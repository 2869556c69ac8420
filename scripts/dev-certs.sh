#!/usr/bin/env bash
# Make a development CA, a coordinator certificate and client certificates (PEM).
#
#   scripts/dev-certs.sh [OUT_DIR] [CLIENT_NAME ...]     (default: certs site-a site-b)
#
# The coordinator certificate is valid for the names in FEDSADDLE_CERT_SANS
# (default DNS:localhost,DNS:coordinator,IP:127.0.0.1). Each client certificate's
# common name is its identity name in the coordinator's credentials file.
# For development and tests only: keys are unencrypted and expire in 30 days.
set -euo pipefail
out=${1:-certs}
shift || true
clients=("$@")
[ ${#clients[@]} -gt 0 ] || clients=(site-a site-b)
sans=${FEDSADDLE_CERT_SANS:-DNS:localhost,DNS:coordinator,IP:127.0.0.1}
mkdir -p "$out"
cd "$out"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -out ca.pem -days 30 -subj "/CN=fedsaddle development CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"

sign() {  # name, common name, extensions
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$2"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" -days 30 \
    -extfile <(printf '%s\n' "$3") 2>/dev/null
  rm -f "$1.csr"
}
sign coordinator coordinator "subjectAltName=$sans
extendedKeyUsage=serverAuth"
for name in "${clients[@]}"; do
  sign "$name" "$name" "extendedKeyUsage=clientAuth"
done
rm -f ca.srl
echo "wrote $(pwd): ca.pem, coordinator.{pem,key}, and for ${clients[*]}: NAME.{pem,key}"
