"""KV events: vLLM's wire format and the one publisher and subscriber kvstack has.

- `codec`: the msgspec structs of vLLM's KV-event batches (both encodings) and their decoding.
- `publisher`: a ZMQ PUB publisher with vLLM's bounded replay service, used by the simulated engine and by
  the cache server.
- `replay`: the client of that replay service.
- `subscriber`: follows an engine's (or a cache server's) stream, detects gaps and restarts, resyncs
  through replay, and feeds an index.
Imports nothing of kvstack outside this package but the leaf `kvstack.backoff` (the subscriber's retries).
"""
