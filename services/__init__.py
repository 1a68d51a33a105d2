"""TierCache's services. Imported first by every `python -m services.<name>`, so what is set
here holds before any of them loads gRPC."""

import os

# gRPC's core reads this once, as it loads. Left unset, it wrote one plain-text INFO line to
# the service's stderr for every refused TLS handshake (a plaintext client, one without a
# client certificate or with a foreign one, a port scan): not JSON and never thinned, so each
# such connection grew the log by a line. An operator's own value (DEBUG, to trace) is kept.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
