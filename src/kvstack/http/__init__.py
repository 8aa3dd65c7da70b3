"""kvstack's own HTTP/1.1: the server the router and picker serve with, and the pooled upstream client.

- `server`: HTTP/1.1 on uvloop + httptools (llhttp): keep-alive, pipelining, ``Expect: 100-continue``,
  chunked bodies, limits answered as OpenAI error JSON.
- `client`: `Origin` (a parsed base URL) and a pooled keep-alive client used for proxied requests and for
  every side call to an engine (/metrics, /v1/models, /tokenize, /kv_event_sources).
"""
