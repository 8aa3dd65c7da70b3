"""What tests share, importable as ``support.*`` (pytest puts tests/ on the path; see pyproject.toml).

- ``ports``: free 127.0.0.1 ports for servers started later.
- ``waiting``: ``wait_until`` (sync) and ``eventually`` (async), one signature, a message naming the wait.
- ``processes``: subprocesses in their own process group, stopped by that group's id.
- ``engines``: ``kvstack sim`` and real vLLM servers; the vLLM virtualenv and ``require_vllm``.
- ``connector``: real vLLM with kvstack's KV connector: the weighted tiny model, engines, greedy answers.
- ``metrics``: Prometheus pages as samples, sums of samples and counter totals.
- ``routers``: routers in this event loop in front of in-process simulated engines; a raw fake engine.
- ``end_to_end``: the router end-to-end tests' router, engines (processes or in-process), bodies, SSE reader.
- ``cache``: cache servers (in this loop, in a thread, as processes), a dict tier, a tier listener, and
  the tier tests' chunk keys, payloads and chunk-file paths.
- ``cache_fuzz``: seeded fuzz messages for the cache protocol.
- ``fake_k8s``: a fake Kubernetes API server for discovery.
- ``kv_events``: a scripted KV-event publisher, and the sink and observer a subscriber test records with.
- ``openai_bodies``: OpenAI request bodies and the serving limits the request-parsing tests use.

Fixtures stay in conftest.py files: tests/conftest.py (the tiny model, the session's vLLM and simulator),
and one per folder where a concern has its own (tests/router/, tests/connector/, tests/cache/).
"""
