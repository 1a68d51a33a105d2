#!/usr/bin/env bash
# Local certificates for TierCache's TLS and mutual TLS (development and tests only).
#
#   scripts/gen-certs.sh [OUT_DIR] [EXTRA_SAN...]      (default OUT_DIR: .run/certs)
#
# Writes, with openssl:
#   ca.pem / ca.key           a private CA (10 years)
#   server.pem / server.key   one serving certificate for every service, SAN: localhost,
#                             127.0.0.1, ::1 and any EXTRA_SAN (DNS names or IPs)
#   client.pem / client.key   the client certificate services present to each other (mTLS)
# Then run every service with
#   TIERCACHE_TLS_CERT=OUT/server.pem TIERCACHE_TLS_KEY=OUT/server.key   (TLS)
#   TIERCACHE_TLS_CA=OUT/ca.pem                                          (+ mutual TLS)
# The services' own clients trust this private CA only through TIERCACHE_TLS_CA: without it
# they verify servers against the system's roots, which do not include it.
#   TIERCACHE_TLS_CLIENT_CERT=OUT/client.pem TIERCACHE_TLS_CLIENT_KEY=OUT/client.key
# See docs/reliability.md ("TLS and mutual TLS"). Production certificates come from your PKI
# (e.g. cert-manager), never from this script.
set -euo pipefail

out="${1:-.run/certs}"
shift || true
mkdir -p "$out"
cd "$out"
umask 077

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for extra in "$@"; do
  # IPv4, or IPv6 (hex digits and colons: fd00::1); anything else is a DNS name.
  if [[ "$extra" =~ ^[0-9.]+$ || ( "$extra" == *:* && "$extra" =~ ^[0-9a-fA-F:.]+$ ) ]]; then
    san="$san,IP:$extra"
  else
    san="$san,DNS:$extra"
  fi
done

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
  -subj "/CN=TierCache local CA" -keyout ca.key -out ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null

issue() {  # name, subject CN, extendedKeyUsage, subjectAltName
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n%s\n%s\n' \
    "extendedKeyUsage=$3" "${4:+subjectAltName=$4}" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

issue server "tiercache" serverAuth "$san"
issue client "tiercache-client" clientAuth ""
rm -f ca.srl
chmod 600 ./*.key
chmod 644 ./*.pem
echo "certificates in $out: ca.pem server.pem/key client.pem/key (SAN $san)"
