"""The router: the cluster's front door, reaching the workers over gRPC only (no torch).

Top level: the gRPC front door (``grpc_server``, its health service ``health``), the request
path both doors share (``core``), starting and stopping the doors (``app``, ``__main__``), the
worker pools and routing policies (``pool``, ``policies``), admission and request caps
(``limits``), metrics, settings, the API key and exposure checks (``auth``, ``security``),
tokenize/detokenize (``tokenize``) and the router's own warm-up (``warmup``).

Packages: ``router.flow`` (a request's life across attempts on the workers) and
``router.http`` (the OpenAI-compatible HTTP surface).
"""
