"""kvstack's own HTTP/1.1: the server the router serves with, and the pooled client to engines.

- `server`: HTTP/1.1 on uvloop + httptools (llhttp): keep-alive, pipelining, ``Expect: 100-continue``,
  chunked bodies, limits answered as OpenAI error JSON.
- `client`: `UpstreamPool`, pooled keep-alive connections for proxied requests and for every side call to
  an engine (/metrics, /v1/models, /tokenize, /kv_event_sources); `origin`: `Origin`, a parsed base URL;
  `errors`: why a call failed. The client re-exports both, as its methods take and raise them.
"""
