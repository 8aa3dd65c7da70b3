"""kvstack's own HTTP: the router's HTTP/1.1 server, the pooled client to engines, a gRPC server.

- `server`: HTTP/1.1 on uvloop + httptools (llhttp): keep-alive, pipelining, ``Expect: 100-continue``,
  chunked bodies, limits answered as OpenAI error JSON.
- `client`: `UpstreamPool`, pooled keep-alive connections for proxied requests and for every side call to
  an engine (/metrics, /v1/models, /tokenize, /kv_event_sources); `origin`: `Origin`, a parsed base URL;
  `errors`: why a call failed. The client re-exports both, as its methods take and raise them.
- `grpc_server`: `GrpcServer`, gRPC over HTTP/2 cleartext (h2c) for Envoy's ext_proc and health checks:
  one asyncio protocol per connection (`grpc_connection`), callbacks per call (`grpc_stream`); HTTP/2
  frames in `h2_frames`, request headers through hpack in `h2_headers`, statuses and trailers in
  `grpc_status`.
"""
