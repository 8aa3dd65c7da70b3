"""What tests share, importable as ``support.*`` (pytest puts tests/ on the path; see pyproject.toml).

- ``ports``: free 127.0.0.1 ports for servers started later.
- ``waiting``: ``wait_until`` (sync) and ``eventually`` (async), one signature, a message naming the wait.
- ``processes``: subprocesses in their own process group, stopped by that group's id.
- ``engines``: ``kvstack sim`` and real vLLM servers; the vLLM virtualenv and ``require_vllm``.
- ``metrics``: Prometheus pages as samples and counter totals.
- ``cache``: cache-server doubles and processes, the fuzz frames, a tier listener.
- ``fake_k8s``: a fake Kubernetes API server for discovery.
"""
